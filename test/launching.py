"""Running the user's ROS commands in tests: ``ros2 launch physis_ros ...`` stopped the way a
terminal's Ctrl-C stops it, the check that every process it started ended cleanly, and the
skip (with its reason) where the ROS 2 command line is not installed (a failure under CI).

The ``ros2`` command, ``launch`` and ``launch_ros`` have no PyPI wheels; ``make test``
installs them from source where their sources lie beside the repository (as in CI).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from physis_testing import REPO_ROOT

ROS_CLI_MISSING = (
    "the ros2 command line and launch_ros are not installed (no PyPI wheels; make test "
    "installs them from ../shared/ros_cli when that folder exists)"
)


def require_ros2_cli() -> None:
    """Skips where the ROS 2 command line is missing, except under CI (``CI`` set), which
    installs it: there a missing one fails, so the launch tests never pass unrun."""
    if shutil.which("ros2") is None or importlib.util.find_spec("launch_ros") is None:
        if os.environ.get("CI", "").lower() not in ("", "0", "false"):
            pytest.fail(f"CI is set and {ROS_CLI_MISSING}")
        pytest.skip(ROS_CLI_MISSING)


def source_files() -> list[Path]:
    """What a clean clone holds: tracked files and new ones git does not ignore, relative."""
    out = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
        cwd=REPO_ROOT, capture_output=True, check=True,
    ).stdout  # fmt: skip
    return [Path(p) for p in out.decode().split("\0") if p and (REPO_ROOT / p).is_file()]


def copy_clean_tree(dest: Path) -> Path:
    """The working tree as a fresh clone of it would be (no build outputs, no generated
    code), copied to ``dest``."""
    for rel in source_files():
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO_ROOT / rel, target)
    return dest


_STARTED = re.compile(r"\[INFO\] \[([\w.-]+)\]: process started with pid \[(\d+)\]")
_CLEAN = re.compile(r"\[INFO\] \[([\w.-]+)\]: process has finished cleanly \[pid (\d+)\]")
_DIED = re.compile(r"\[ERROR\] \[([\w.-]+)\]: process has died \[pid (\d+), exit code (-?\d+)")


def _why_it_died(log: str, name: str) -> str:
    """A died process's own lines around the first sign of its end (a C++ terminate's
    message, Python's fatal error, a traceback): the cause comes before the thread stacks
    faulthandler prints, which would push it out of the log's tail."""
    lines = [line for line in log.splitlines() if line.startswith(f"[{name}] ")]
    first = next(
        (i for i, line in enumerate(lines)
         if re.search(r"terminate called|Fatal Python error|Traceback|what\(\)", line)),
        max(0, len(lines) - 40),
    )  # fmt: skip
    return "\n".join(lines[max(0, first - 20) : first + 20])


class LaunchRun:
    """``ros2 launch physis_ros ARGS`` in a session of its own (a terminal's foreground
    group), its output in ``log_path``; a context manager that never leaves it running."""

    def __init__(self, args: list[str], *, env: dict[str, str], log_path: Path) -> None:
        self.args = args
        self.log_path = log_path
        self._log = open(log_path, "wb")  # noqa: SIM115 - closed in wait/__exit__
        self.proc = subprocess.Popen(
            ["ros2", "launch", "physis_ros", *args],
            env=env, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def running(self) -> bool:
        return self.proc.poll() is None

    def interrupt(self) -> None:
        """Ctrl-C: SIGINT to the whole process group, launch and its children alike."""
        os.killpg(self.proc.pid, signal.SIGINT)

    def wait(self, timeout_s: float = 90.0) -> int:
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self._kill()
            raise AssertionError(
                f"ros2 launch {' '.join(self.args)} still ran {timeout_s} s after Ctrl-C:\n"
                + self.log()[-3000:]
            ) from None
        finally:
            self._log.close()

    def _kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):  # already gone
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)

    def assert_every_process_ended_cleanly(self, returncode: int) -> list[str]:
        """After Ctrl-C: launch exited 0, each process it started 'finished cleanly'
        (exit 0), none died, nothing printed a traceback. Returns the process names."""
        log = self.log()
        started = {pid: name for name, pid in _STARTED.findall(log)}
        clean = {pid for _name, pid in _CLEAN.findall(log)}
        died = _DIED.findall(log)
        assert started, f"launch started nothing:\n{log[-3000:]}"
        assert not died, f"processes died: {died}\n" + "\n".join(
            _why_it_died(log, name) for name, _pid, _code in died
        )
        assert set(started) == clean, (
            f"not finished cleanly: {[started[p] for p in set(started) - clean]}\n{log[-3000:]}"
        )
        # a Python traceback, or a callback error the EventsExecutor logged with its stack
        for sign in ("Traceback", "[FATAL]", "Error occurred at"):
            assert sign not in log, log[-5000:]
        assert returncode == 0, f"ros2 launch exited {returncode}:\n{log[-3000:]}"
        return sorted(started.values())

    def __enter__(self) -> LaunchRun:
        return self

    def __exit__(self, *exc) -> None:
        if self.running():
            self._kill()
        self._log.close()


def wait_for_file(path: Path, timeout_s: float, run: LaunchRun) -> str:
    """The stripped contents of ``path`` once it has some; fails early if launch ended."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.exists() and path.read_text().strip():
            return path.read_text().strip()
        assert run.running(), f"ros2 launch ended before {path} appeared:\n{run.log()[-3000:]}"
        time.sleep(0.2)
    raise AssertionError(f"no {path} after {timeout_s} s:\n{run.log()[-3000:]}")
