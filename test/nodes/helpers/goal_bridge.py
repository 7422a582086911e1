"""Child process for the task test: the real bridge node with ``task_topic``, a link client
that records what the bridge asks of it (and says the model is push-wam, which takes task
values goal_x, goal_y), and a publisher of goals on the real topic (kept for late joiners,
as sim_robot's are).

    goal_bridge.py

Publishes a first goal before the bridge exists (a late joiner must still get it), then the
same goal again, a NaN goal and a second goal; prints one JSON line: the task values the
client was given, whether it had been started before the first goal, the bridge's drops.
"""

import json
import sys

import rclpy
from geometry_msgs.msg import PointStamped
from recording_link import RecordingClient, spin_until

from physis_ros.nodes.bridge import Bridge
from physis_ros.nodes.run import LATCHED_QOS

GOALS = [(0.1, -0.3), (0.1, -0.3), (float("nan"), 0.0), (-0.2, -0.25)]


def main() -> int:
    rclpy.init(args=["--ros-args", "-p", "task_topic:=goal"])
    teacher = rclpy.create_node("goal_teacher")
    pub = teacher.create_publisher(PointStamped, "goal", LATCHED_QOS)  # as sim_robot's

    def publish(x: float, y: float) -> None:
        msg = PointStamped()
        msg.header.frame_id = "table"
        msg.point.x, msg.point.y = x, y
        pub.publish(msg)

    publish(*GOALS[0])  # before the bridge exists
    client = RecordingClient()
    node = Bridge(client=client)
    started_before_goal = client.started_with is not None
    spin_until([node, teacher], lambda: len(client.tasks) >= 1)
    for goal in GOALS[1:]:
        publish(*goal)
        spin_until([node, teacher], lambda: False, timeout_s=0.5)
    spin_until([node, teacher], lambda: len(client.tasks) >= 2)
    node.shutdown()
    report = {
        "tasks": client.tasks,
        "started_before_goal": started_before_goal,
        "started_with": client.started_with,
        "drops": node.drops.snapshot(),
    }
    print(json.dumps(report), flush=True)
    node.destroy_node()
    teacher.destroy_node()
    rclpy.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
