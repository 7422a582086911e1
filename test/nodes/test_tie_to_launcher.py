"""``children.tie_to_launcher``, on plain processes: a program whose launcher named itself in
PHYSIS_PARENT_PID gets SIGINT (its clean stop, as on Ctrl-C) when that launcher dies, by
SIGKILL or SIGTERM, whether the launcher is its parent (the kernel's parent-death signal:
once per launcher thread that dies, which a program that ignores SIGINT once stopping
survives) or an ancestor with a shell in between (the watch thread); one started without it
is not tied, and one started with SIGINT ignored still stops. The real ``ros2 launch`` is
test/ros_launch/test_launch_death.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from physis_ros.children import PARENT_PID_ENV

ENDS_WITHIN_S = 15.0  # the watch looks every 0.5 s; a loaded host adds to it

PROGRAM = textwrap.dedent(
    """
    import os, signal, sys, time
    from physis_ros.children import tie_to_launcher

    out = sys.argv[1]

    def stop(signum, frame):
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # stopping: as every program does
        time.sleep(1.0)  # a clean stop takes a while; more signals may come meanwhile
        with open(out, "a") as f:
            f.write("stopped cleanly\\n")
        sys.exit(0)

    ignored = signal.getsignal(signal.SIGINT) == signal.SIG_IGN
    tie_to_launcher()
    if ignored:  # started with SIGINT ignored (a background job): now it stops on it
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    signal.signal(signal.SIGINT, stop)
    with open(out, "a") as f:
        f.write(f"tied {os.getpid()} {os.environ.get('PHYSIS_PARENT_PID')}\\n")
    time.sleep(300)
    """
)

LAUNCHER = textwrap.dedent(
    """
    import os, signal, subprocess, sys, threading, time

    program, out, how = sys.argv[1:4]
    env = dict(os.environ)
    if how != "untied":
        env["PHYSIS_PARENT_PID"] = str(os.getpid())
    cmd = [sys.executable, "-c", program, out]
    if how == "through a shell":  # a launch prefix: the launcher is not the parent
        cmd = ["sh", "-c", '"$0" "$@"; true', *cmd]
    # ignored only where asked: not inherited from how the test run itself was started
    # (a background job's SIGINT is ignored, and exec keeps it so)
    ignore = how == "with SIGINT ignored"
    signal.signal(signal.SIGINT, signal.SIG_IGN if ignore else signal.default_int_handler)
    for _ in range(4):  # as ros2 launch: threads, each a parent in turn as they die
        threading.Thread(target=time.sleep, args=(300,), daemon=True).start()
    subprocess.Popen(cmd, env=env)
    time.sleep(300)
    """
)


def _running(pid: int) -> bool:
    """Alive and not a zombie waiting for a reaper."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def _start(tmp_path: Path, how: str) -> tuple[subprocess.Popen, Path, int]:
    out = tmp_path / "program.out"
    env = dict(os.environ)
    env.pop(PARENT_PID_ENV, None)
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, PROGRAM, str(out), how], env=env)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and "tied" not in (out.read_text() if out.exists() else ""):
        time.sleep(0.05)
    line = out.read_text().split("\n")[0].split()
    assert line[0] == "tied", out.read_text()
    return launcher, out, int(line[1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize(
    "how, sig",
    [
        ("directly", signal.SIGKILL),
        ("directly", signal.SIGTERM),
        ("through a shell", signal.SIGKILL),
        ("with SIGINT ignored", signal.SIGKILL),
    ],
)
def test_a_tied_program_stops_cleanly_when_its_launcher_dies(tmp_path, how, sig):
    launcher, out, pid = _start(tmp_path, how)
    try:
        # what it starts in turn ties to it
        assert out.read_text().split()[2] == str(pid)
        launcher.send_signal(sig)
        launcher.wait(10)
        deadline = time.monotonic() + ENDS_WITHIN_S
        while time.monotonic() < deadline and _running(pid):
            time.sleep(0.05)
        assert not _running(pid), f"still running {ENDS_WITHIN_S} s after its launcher died"
        assert "stopped cleanly" in out.read_text()  # its own handler ran to the end
    finally:
        if _running(pid):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_program_started_without_the_variable_is_not_tied(tmp_path):
    launcher, out, pid = _start(tmp_path, "untied")
    try:
        assert out.read_text().split()[2] == "None"
        launcher.kill()
        launcher.wait(10)
        time.sleep(1.5)  # three looks of a watch, had there been one
        assert _running(pid)
    finally:
        os.kill(pid, signal.SIGKILL)
