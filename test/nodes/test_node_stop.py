"""Ctrl-C and SIGTERM stop a node cleanly (exit 0, no traceback) at any moment: while the
bridge still waits for a starting server's port file and while a node spins (each node's own
hook, then the node, then rclpy). Real processes in an isolated domain."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest

from physis_ros.children import stop_child
from physis_ros.nodes.system import ros_args

pytestmark = [pytest.mark.ros, pytest.mark.slow]

STOP_TIMEOUT_S = 60.0
"""Generous on a busy host; the bug it guards against kept the node up for minutes."""


def _stop(child: subprocess.Popen, sig: int) -> tuple[int, str]:
    """Signal, wait (SIGKILL after STOP_TIMEOUT_S), and the child's output."""
    code = stop_child(child, sig=sig, timeout_s=STOP_TIMEOUT_S)
    return code, child.stdout.read()


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_bridge_waiting_for_its_server_stops_at_once(ros_env, monitor, tmp_path, sig):
    """The bridge is in the graph and waits (up to 10 minutes) for a port file that never
    comes: a signal stops it at once, however long the wait still had to run."""
    child = subprocess.Popen(
        [sys.executable, "-m", "physis_ros.nodes.bridge",
         *ros_args({"server_port_file": str(tmp_path / "never.port")}),
         "-r", "__node:=waiting_bridge"],
        env=ros_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        assert monitor.wait_for(
            lambda: "waiting_bridge" in monitor.node.get_node_names(), timeout_s=120
        ), "the bridge never appeared in the graph"
        assert child.poll() is None
    finally:
        code, output = _stop(child, sig)
    assert code == 0, output
    assert "Traceback" not in output, output


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_spinning_node_stops_cleanly(ros_env, monitor, sig):
    child = subprocess.Popen(
        [sys.executable, "-m", "physis_ros.nodes.sim_robot", *ros_args({"camera_rate_hz": 5.0})],
        env=ros_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        assert monitor.wait_for(lambda: monitor.count("joint_command") >= 20, timeout_s=120)
    finally:
        code, output = _stop(child, sig)
    assert code == 0, output
    assert "Traceback" not in output, output
    assert "[ERROR]" not in output, output
