"""An object tracker's positions, for push-wam's box_x, box_y: sim_robot publishes its box
centre on ``object_position`` as a tracker would, and the bridge with ``object_topics``
(box=object_position) sends each image with the tracked position stamped with it, as the
model's named state values box_x, box_y; a NaN position is dropped and counted, and its
image, with no object within the slop, is not sent. Real topics in real ROS processes
(helpers/object_bridge.py); the wire and the server's side are test/link/test_link_units.py's
and test/serve/test_serve_wam.py's."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from physis_ros.children import stop_child
from physis_ros.nodes.system import ros_args

from physis_testing import child_report

HELPER = str(Path(__file__).parent / "helpers" / "object_bridge.py")
pytestmark = pytest.mark.ros


def test_each_image_goes_with_the_object_position_stamped_with_it(ros_env):
    report = child_report([sys.executable, HELPER], ros_env)
    sent = report["object_positions"]
    assert len(sent) == 2, report  # the NaN one's image was not sent
    np.testing.assert_allclose(sent, [[0.1, -0.2], [0.3, -0.1]], atol=1e-6)
    assert report["drops"].get("nan_object") == 1, report["drops"]
    # every robot input of the model's contract, by name (the task's come with the stream)
    assert report["state_names"] == sorted(
        ["shoulder_pos", "elbow_pos", "shoulder_vel", "elbow_vel", "box_x", "box_y",
         "force_x", "force_y", "force_z", "torque_x", "torque_y", "torque_z"]
    )  # fmt: skip


def test_sim_robot_publishes_its_box_centre_stamped_as_its_wrench(ros_env, monitor):
    """goal_push with the arm held: the box stays at its episode's start, in the table
    frame, published with each physics step's wrench (the same stamp)."""
    from geometry_msgs.msg import PointStamped, WrenchStamped
    from rclpy.qos import qos_profile_sensor_data

    from physis_ros.sim.task import sample_task

    got: dict[str, list] = {"object_position": [], "wrench": []}
    for topic, kind in (("object_position", PointStamped), ("wrench", WrenchStamped)):
        monitor.node.create_subscription(kind, topic, got[topic].append, qos_profile_sensor_data)
    params = {"task": "goal_push", "idle_policy": "hold", "camera_rate_hz": 2.0}
    child = subprocess.Popen(
        [sys.executable, "-m", "physis_ros.nodes.sim_robot", *ros_args(params)],
        env=ros_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        assert monitor.wait_for(lambda: len(got["object_position"]) >= 20, timeout_s=120)
    finally:
        assert stop_child(child, timeout_s=60) == 0, child.stdout.read()
    points = list(got["object_position"])
    assert {p.header.frame_id for p in points} == {"table"}
    # each episode (15 s held still) starts the box where its seed puts it
    starts = [sample_task(seed).box_xy for seed in range(4)]
    assert all((p.point.x, p.point.y) in starts and p.point.z == 0 for p in points), points[0]

    def stamps(msgs) -> set[tuple[int, int]]:
        return {(m.header.stamp.sec, m.header.stamp.nanosec) for m in msgs}

    # best effort may lose a few of either
    assert len(stamps(points) & stamps(got["wrench"])) >= len(points) // 2
