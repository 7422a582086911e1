"""Child processes: stopping one (ask it to stop, wait, then kill it), and tying a program to
the launcher that started it so that it never outlives it. Standard library only, so both
sides (ROS nodes, server tools, evaluation) and the tests can use it.

A launcher that wants its children to end with it puts its own pid in ``PHYSIS_PARENT_PID``
(the launch files do, ``ros2 launch`` being the launcher; so does ``LocalSystem``). Each
program of the package calls ``tie_to_launcher`` first thing: when that launcher dies,
however it died (SIGTERM, SIGKILL, a crash), the program gets SIGINT and stops as on a
Ctrl-C. ``ros2 launch`` itself exits on SIGTERM without stopping what it started, and
nothing stops anything after a SIGKILL; this is what ends them then. SIGINT, because every
program stops cleanly on the first and ignores the ones after it, and the kernel sends the
parent-death signal more than once: a child whose launcher had several threads passes from
each dying thread to the next, with a signal each time (a second SIGTERM is a hard stop). The
program puts its own pid in the variable for the programs it starts in turn
(physis-torchrun's ranks). Without the variable (a program started by hand, by ``nohup``, by
a supervisor) nothing is tied.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import threading
import time

PARENT_PID_ENV = "PHYSIS_PARENT_PID"
"""The pid of the process a program started with it must not outlive."""

PARENT_WATCH_PERIOD_S = 0.5
"""How often the fallback watch looks whether the launcher is still there."""

LAUNCHER_GONE_SIGNAL = signal.SIGINT
"""What a tied program gets when its launcher dies (see the module docstring)."""

_PR_SET_PDEATHSIG = 1


def stop_child(
    proc: subprocess.Popen, *, sig: int = signal.SIGTERM, timeout_s: float = 10.0
) -> int:
    """Send ``sig`` (if it still runs), wait ``timeout_s``, SIGKILL if it lingers; the exit
    status."""
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout_s)
    return proc.returncode


def tie_to_launcher() -> None:
    """Stop (``LAUNCHER_GONE_SIGNAL``) when the launcher named by ``PHYSIS_PARENT_PID`` dies
    (see the module docstring); no-op without it. The kernel signals a child whose parent died
    (``PR_SET_PDEATHSIG``, Linux) when the launcher is this process's parent; else (another
    system, or something in between such as a launch prefix) a thread watches the launcher.
    A launcher already gone by now ends this process at once."""
    value = os.environ.get(PARENT_PID_ENV, "")
    if not value.isdigit():
        return
    launcher = int(value)
    os.environ[PARENT_PID_ENV] = str(os.getpid())  # what this program starts ties to it
    if signal.getsignal(LAUNCHER_GONE_SIGNAL) == signal.SIG_IGN:  # a shell's background job
        signal.signal(LAUNCHER_GONE_SIGNAL, signal.default_int_handler)
    is_parent = launcher == os.getppid()
    tied = is_parent and _die_with_parent()
    # checked after the kernel was asked: the launcher may have died just before
    if _launcher_gone(launcher, is_parent=is_parent):
        _end_now()
    elif not tied:
        threading.Thread(
            target=_watch, args=(launcher, is_parent), name="launcher-watch", daemon=True
        ).start()


def _die_with_parent() -> bool:
    """The signal to this process when its parent dies; False where the kernel cannot."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_PDEATHSIG, LAUNCHER_GONE_SIGNAL, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _launcher_gone(launcher: int, *, is_parent: bool) -> bool:
    """A dead parent leaves its children to another (init, a subreaper); a dead ancestor is
    gone from the process table, or a zombie until its own parent reaps it."""
    if is_parent:
        return os.getppid() != launcher
    try:
        os.kill(launcher, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # another user's process: it exists
        return False
    try:
        with open(f"/proc/{launcher}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):  # no /proc (not Linux): it exists
        return False
    return state in ("Z", "X")


def _watch(launcher: int, is_parent: bool) -> None:
    """Until ``launcher`` is gone, then the signal once (the program's own clean stop)."""
    while not _launcher_gone(launcher, is_parent=is_parent):
        time.sleep(PARENT_WATCH_PERIOD_S)
    _end_now()


def _end_now() -> None:
    os.kill(os.getpid(), LAUNCHER_GONE_SIGNAL)
