"""Shared test fixtures: isolated ROS 2 domains, and a monitor of the topics in one."""

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


@pytest.fixture
def monitor(ros_env, monkeypatch):
    """A Monitor on ``ros_env``'s domain (every joint_command message kept), closed after."""
    from physis_ros.nodes.monitor import Monitor

    for key in ("ROS_AUTOMATIC_DISCOVERY_RANGE", "FASTDDS_DEFAULT_PROFILES_FILE"):
        monkeypatch.setenv(key, ros_env[key])
    mon = Monitor(domain_id=int(ros_env["ROS_DOMAIN_ID"]), keep=("joint_command",))
    try:
        yield mon
    finally:
        mon.close()
