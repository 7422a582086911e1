"""sim_robot with ``scene: reach``: the 3-joint arm on the same topics as push's (camera,
joint_states, joint_command, tf), its episode's target on ``target``, no wrench and no
tracked object; its expert moves the arm towards the target."""

from __future__ import annotations

import signal
import subprocess
import sys

import numpy as np
import pytest

from physis_ros.children import stop_child
from physis_ros.nodes.system import ros_args

pytestmark = [pytest.mark.ros, pytest.mark.slow]


def test_sim_robot_with_the_reach_scene_publishes_three_joints_and_its_target(ros_env, monitor):
    from geometry_msgs.msg import PointStamped
    from rclpy.qos import qos_profile_sensor_data
    from sensor_msgs.msg import JointState

    from physis_ros.nodes.run import LATCHED_QOS
    from physis_ros.sim.reach import sample_reach

    got: dict[str, list] = {"joint_states": [], "target": []}
    node = monitor.node
    node.create_subscription(
        JointState, "joint_states", got["joint_states"].append, qos_profile_sensor_data
    )
    node.create_subscription(PointStamped, "target", got["target"].append, LATCHED_QOS)
    params = {"scene": "reach", "seed": 3, "camera_rate_hz": 2.0, "image_height": 32,
              "image_width": 32}  # fmt: skip
    child = subprocess.Popen(
        [sys.executable, "-m", "physis_ros.nodes.sim_robot", *ros_args(params)],
        env=ros_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        assert monitor.wait_for(
            lambda: monitor.count("joint_command") >= 100 and got["target"], timeout_s=60
        ), child.stdout.read() if child.poll() is not None else "no messages"
        commands = [m for _, m in monitor.messages("joint_command")]
        assert {tuple(m.joint_names) for m in commands} == {("shoulder", "elbow", "wrist")}
        assert {len(m.points[0].positions) for m in commands} == {3}
        moved = np.array([m.points[0].positions for m in commands])
        assert np.ptp(moved, axis=0).max() > 1e-3  # the expert moves the arm
        states = list(got["joint_states"])
        assert states and {tuple(s.name) for s in states} == {("shoulder", "elbow", "wrist")}
        assert {len(s.position) for s in states} == {len(s.velocity) for s in states} == {3}
        # the target of episode seed 3, or (latched, depth 1: a subscription matched late on a
        # loaded host gets the newest) of a later episode, each episode's seed the next one
        targets = [(m.point.x, m.point.y) for m in got["target"]]
        assert {m.header.frame_id for m in got["target"]} == {"table"}
        first = next(
            (s for s in range(3, 103) if targets[0] == pytest.approx(sample_reach(s).target_xy)),
            None,
        )
        assert first is not None, targets
        for i, xy in enumerate(targets):
            assert xy == pytest.approx(sample_reach(first + i).target_xy), (first, targets)
        assert monitor.wait_for(lambda: monitor.count("camera/image") >= 1, timeout_s=10)
        assert monitor.get("camera/image").height == 32
        topics = dict(node.get_topic_names_and_types())
        assert "/wrench" not in topics and "/object_position" not in topics
        assert child.poll() is None
    finally:
        code = stop_child(child, sig=signal.SIGINT)
    assert code == 0
