"""Shared test fixtures: isolated ROS 2 domains."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from physis_testing import REPO_ROOT, reserved_ros_domain


@pytest.fixture
def ros_env() -> Iterator[dict[str, str]]:
    """Environment for child processes that use ROS: own domain, localhost discovery,
    the project's Fast DDS profile (shared-memory segment large enough for images)."""
    with reserved_ros_domain() as domain_id:
        env = dict(os.environ)
        env.update(
            ROS_DOMAIN_ID=str(domain_id),
            ROS_AUTOMATIC_DISCOVERY_RANGE="LOCALHOST",
            FASTDDS_DEFAULT_PROFILES_FILE=str(REPO_ROOT / "config" / "fastdds.xml"),
            RMW_IMPLEMENTATION="rmw_fastrtps_cpp",
            PYTHONPATH=str(REPO_ROOT) + os.pathsep + env.get("PYTHONPATH", ""),
        )
        yield env
