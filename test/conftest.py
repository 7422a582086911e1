"""Shared test fixtures (isolated ROS 2 domains, a monitor of the topics in one) and how the
suite is spread over pytest-xdist workers (``make test`` runs it on several).

Under xdist each test goes to the next free worker, except that the tests of a file that
defines a module-scoped fixture (a server, a ROS system, trained weights) go together to one
worker, in file order, so that the fixture starts once. Slow tests (``pytest.mark.slow``) are
handed out first, so that no long test starts last and ends the run alone. What the workers
share is reserved per test: a ROS_DOMAIN_ID (``physis_testing.reserved_ros_domain``), ports
(servers bind port 0 on 127.0.0.1) and files (``tmp_path``).
"""

from __future__ import annotations

import functools
import os
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from physis_testing import REPO_ROOT, reserved_ros_domain, sharing_the_host


@functools.cache
def _has_module_fixture(path: Path) -> bool:
    return re.search(r"scope=[\"']module[\"']", path.read_text()) is not None


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Slow tests first (stable: otherwise in collection order); a file whose tests share a
    module-scoped fixture moves as a whole, its tests in their order."""
    slow_files = {item.path for item in items if item.get_closest_marker("slow")}

    def first(item: pytest.Item) -> bool:
        if _has_module_fixture(item.path):
            return item.path in slow_files
        return item.get_closest_marker("slow") is not None

    items.sort(key=lambda item: not first(item))


@pytest.hookimpl(optionalhook=True)  # xdist's hook: absent without xdist
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """``--dist load`` (the default with ``-n``), but a file with a module-scoped fixture is
    one unit of work, and units go out in collection order (slow first)."""
    if config.getvalue("dist") != "load":
        return None
    from xdist.scheduler import LoadScopeScheduling  # only called where xdist is loaded

    class ModuleFixturesTogether(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return path if _has_module_fixture(config.rootpath / path) else nodeid

    config.option.loadscopereorder = False
    return ModuleFixturesTogether(config, log)


@pytest.fixture(autouse=True)
def _sharing_the_host() -> Iterator[None]:
    """Every test shares the host with the other workers' tests, unless it asks for the host
    to itself (``physis_testing.host_to_myself``)."""
    with sharing_the_host():
        yield


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
