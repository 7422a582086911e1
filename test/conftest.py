"""Shared test fixtures: isolated ROS 2 domains and child-process hygiene."""

from __future__ import annotations

import contextlib
import fcntl
import os
import random
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
_DOMAIN_LOCK_DIR = Path("/tmp/physis_ros_test_domains")


@contextlib.contextmanager
def reserved_ros_domain() -> Iterator[int]:
    """A ROS_DOMAIN_ID no other test on this machine holds while the context is open.

    Parallel pytest runs (CI, developers) each lock a file per domain id, so two tests never
    share a DDS domain and never see each other's topics.
    """
    _DOMAIN_LOCK_DIR.mkdir(exist_ok=True)
    ids = list(range(1, 101))
    random.shuffle(ids)
    for domain_id in ids:
        lock = open(_DOMAIN_LOCK_DIR / f"{domain_id}.lock", "w")  # noqa: SIM115 - held below
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.close()
            continue
        try:
            yield domain_id
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
            lock.close()
        return
    raise RuntimeError("all ROS domain ids 1..100 are held by other tests")


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
