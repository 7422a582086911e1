"""Test helpers shared by every test directory (importable by a unique name, unlike conftest)."""

from __future__ import annotations

import contextlib
import fcntl
import os
import random
from collections.abc import Iterator
from pathlib import Path

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


# Under pytest-xdist every running test holds the run's host lock shared; ``host_to_myself``
# takes it exclusively. The gate in front of it gives the exclusive taker precedence: tests
# that start meanwhile wait at the gate instead of starving it.
_HOST_LOCK_DIR = Path("/tmp/physis_ros_test_host")
_held: dict[str, object] = {}
"""This worker's open lock files while a test runs ("gate", "host")."""


def _host_lock(name: str):
    _HOST_LOCK_DIR.mkdir(exist_ok=True)
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID", "")
    return open(_HOST_LOCK_DIR / f"{run}.{name}", "w")


@contextlib.contextmanager
def sharing_the_host() -> Iterator[None]:
    """What every test runs in (test/conftest.py): under xdist, the host lock held shared;
    without xdist, nothing."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        yield
        return
    gate, host = _host_lock("gate"), _host_lock("host")
    try:
        fcntl.flock(gate, fcntl.LOCK_SH)
        fcntl.flock(host, fcntl.LOCK_SH)
        fcntl.flock(gate, fcntl.LOCK_UN)
        _held.update(gate=gate, host=host)
        yield
    finally:
        _held.clear()
        gate.close()
        host.close()  # closing releases its lock


@contextlib.contextmanager
def host_to_myself() -> Iterator[None]:
    """The body runs while no other test of this run does (the other workers wait between
    tests): for what measures the host's speed, such as a server that refuses a stream when
    it found the host busy at start-up. Without xdist (or outside a test) it runs as is."""
    if not _held:
        yield
        return
    gate, host = _held["gate"], _held["host"]
    fcntl.flock(host, fcntl.LOCK_UN)  # so another test waiting at the gate holds nothing
    fcntl.flock(gate, fcntl.LOCK_EX)  # no test starts from here on
    fcntl.flock(host, fcntl.LOCK_EX)  # the running ones have ended
    try:
        yield
    finally:
        fcntl.flock(host, fcntl.LOCK_SH)
        fcntl.flock(gate, fcntl.LOCK_UN)


DISCOVERY_ENV = ("ROS_AUTOMATIC_DISCOVERY_RANGE", "FASTDDS_DEFAULT_PROFILES_FILE")
"""What a test's own Monitor must share with a LocalSystem's children to discover them."""


def adopt_discovery_env(system_env: dict[str, str]) -> dict[str, str | None]:
    """Set this process's discovery settings to a LocalSystem's; returns the old values."""
    saved = {k: os.environ.get(k) for k in DISCOVERY_ENV}
    os.environ.update({k: system_env[k] for k in DISCOVERY_ENV})
    return saved


def restore_env(saved: dict[str, str | None]) -> None:
    """Undo ``adopt_discovery_env``."""
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def child_report(args: list[str], env: dict[str, str], timeout_s: float = 300.0) -> dict:
    """Runs a helper process to its end (killed if it outlives ``timeout_s``) and returns the
    JSON report on its last line of output; a failed helper fails the test with its stderr."""
    import json
    import subprocess

    child = subprocess.Popen(
        args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        out, err = child.communicate(timeout=timeout_s)
    finally:
        child.kill()
    assert child.returncode == 0, err
    return json.loads(out.strip().splitlines()[-1])
