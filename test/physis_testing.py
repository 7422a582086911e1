"""Test helpers shared by every test directory (importable by a unique name, unlike conftest)."""

from __future__ import annotations

import contextlib
import fcntl
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


DISCOVERY_ENV = ("ROS_AUTOMATIC_DISCOVERY_RANGE", "FASTDDS_DEFAULT_PROFILES_FILE")
"""What a test's own Monitor must share with a LocalSystem's children to discover them."""


def adopt_discovery_env(system_env: dict[str, str]) -> dict[str, str | None]:
    """Set this process's discovery settings to a LocalSystem's; returns the old values."""
    import os

    saved = {k: os.environ.get(k) for k in DISCOVERY_ENV}
    os.environ.update({k: system_env[k] for k in DISCOVERY_ENV})
    return saved


def restore_env(saved: dict[str, str | None]) -> None:
    """Undo ``adopt_discovery_env``."""
    import os

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
