"""Stopping a child process: ask it to stop, wait, then kill it. Standard library only, so
both sides (ROS nodes, server tools, evaluation) and the tests can use it."""

from __future__ import annotations

import signal
import subprocess


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
