"""Child process for the object test: the real bridge node with ``object_topics``
(box=object_position), a link client that records the observations the bridge hands it (and
says the model is push-wam, which takes box_x, box_y), and a robot that publishes camera
images, wrenches, joint states and an object tracker's positions on the real topics.

    object_bridge.py

Three instants, each stamped alike on every topic: a tracked position, then a NaN one
(dropped: its image has no object within the slop and is never sent), then another; prints
one JSON line: each sent observation's box_x, box_y and the bridge's drops.
"""

import json
import sys
import time

import numpy as np
import rclpy
from geometry_msgs.msg import PointStamped, WrenchStamped
from rclpy.qos import qos_profile_sensor_data
from recording_link import RecordingClient, spin_until
from sensor_msgs.msg import Image, JointState

from physis_ros.nodes.bridge import Bridge
from physis_ros.nodes.conversions import fill_image_msg

POSITIONS_M = [(0.1, -0.2, 0.0), (float("nan"), -0.2, 0.0), (0.3, -0.1, 0.05)]
STEP_NS = 100_000_000
"""Between instants: past the bridge's slop, so no sample pairs with another instant's."""


class Robot:
    """Publishes one instant's image, wrench, joint states and tracked position, stamped
    alike (as sim_robot and its object tracker would)."""

    def __init__(self) -> None:
        self.node = rclpy.create_node("object_robot")
        qos = qos_profile_sensor_data
        self.pubs = {
            "image": self.node.create_publisher(Image, "camera/image", qos),
            "wrench": self.node.create_publisher(WrenchStamped, "wrench", qos),
            "joints": self.node.create_publisher(JointState, "joint_states", qos),
            "object": self.node.create_publisher(PointStamped, "object_position", qos),
        }

    def matched(self) -> bool:
        return all(pub.get_subscription_count() > 0 for pub in self.pubs.values())

    def publish(self, stamp_ns: int, position_m) -> None:
        stamp = rclpy.time.Time(nanoseconds=stamp_ns).to_msg()
        point = PointStamped()
        point.header.stamp, point.header.frame_id = stamp, "table"
        point.point.x, point.point.y, point.point.z = position_m
        wrench = WrenchStamped()
        wrench.header.stamp = stamp
        joints = JointState(name=["shoulder", "elbow"], position=[0.1, 0.2], velocity=[0.0, 0.0])
        joints.header.stamp = stamp
        image = Image()
        fill_image_msg(image, np.zeros((4, 4, 3), np.uint8), stamp=stamp, frame_id="camera")
        for kind, msg in (("object", point), ("wrench", wrench), ("joints", joints)):
            self.pubs[kind].publish(msg)
        self.pubs["image"].publish(image)  # last: its partners are there when it comes


def main() -> int:
    rclpy.init(
        args=["--ros-args", "-p", "object_topics:=['box=object_position']",
              "-p", "task_topic:=goal", "-p", "command_topic:=''",
              "-p", "resize_to_model:=false"]
    )  # fmt: skip
    client = RecordingClient()
    node = Bridge(client=client)
    robot = Robot()
    spin_until([node, robot.node], robot.matched)
    t0_ns = time.time_ns()
    for i, position in enumerate(POSITIONS_M):
        robot.publish(t0_ns + i * STEP_NS, position)
        spin_until([node, robot.node], lambda: False, timeout_s=0.5)
    spin_until([node, robot.node], lambda: len(client.observations) >= 2)
    node.shutdown()
    report = {
        "object_positions": [
            [obs.state.get("box_x"), obs.state.get("box_y")] for obs in client.observations
        ],
        "state_names": sorted(client.observations[0].state) if client.observations else [],
        "drops": node.drops.snapshot(),
    }
    print(json.dumps(report), flush=True)
    node.destroy_node()
    robot.node.destroy_node()
    rclpy.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
