"""Child process for test_messages.py: publish or receive one physis_ros message type.

msg_peer.py pub ActionChunk   publishes a filled message every 50 ms until killed
msg_peer.py sub ActionChunk   prints the first message received as JSON, then exits
"""

import json
import sys

import rclpy
from rclpy.node import Node
from rclpy.qos import QoSProfile, ReliabilityPolicy

from physis_ros.msg import ActionChunk, PipelineStats


def filled(kind: str):
    if kind == "ActionChunk":
        msg = ActionChunk()
        msg.header.frame_id = "table"
        msg.header.stamp.sec = 12
        msg.stream_id = 3
        msg.chunk_index = 41
        msg.observation_seq = 7
        msg.action_names = ["shoulder", "elbow"]
        msg.dt = 0.1
        msg.horizon = 3
        msg.dim = 2
        msg.data = [0.5, -0.25, 1.0, 2.0, -3.0, 4.5]
        return msg
    msg = PipelineStats()
    msg.connection_state = PipelineStats.STREAMING
    msg.model = "tiny"
    msg.steps = 4
    msg.interval_median_ms = 12.5
    msg.hop_names = ["link_up", "pipeline"]
    msg.hop_median_ms = [0.75, 9.0]
    msg.drop_reasons = ["bad_encoding"]
    msg.drop_counts = [2]
    return msg


def as_dict(msg) -> dict:
    if isinstance(msg, ActionChunk):
        return {
            "frame_id": msg.header.frame_id,
            "sec": msg.header.stamp.sec,
            "stream_id": msg.stream_id,
            "chunk_index": msg.chunk_index,
            "observation_seq": msg.observation_seq,
            "action_names": list(msg.action_names),
            "dt": round(msg.dt, 6),
            "shape": [msg.horizon, msg.dim],
            "data": [round(float(v), 6) for v in msg.data],
        }
    return {
        "connection_state": msg.connection_state,
        "model": msg.model,
        "steps": msg.steps,
        "interval_median_ms": msg.interval_median_ms,
        "hops": dict(zip(msg.hop_names, [float(v) for v in msg.hop_median_ms], strict=True)),
        "drops": dict(zip(msg.drop_reasons, [int(v) for v in msg.drop_counts], strict=True)),
    }


def main() -> int:
    role, kind = sys.argv[1], sys.argv[2]
    msg_type = {"ActionChunk": ActionChunk, "PipelineStats": PipelineStats}[kind]
    qos = QoSProfile(depth=10, reliability=ReliabilityPolicy.RELIABLE)
    with rclpy.init():
        node = Node(f"msg_{role}")
        if role == "pub":
            pub = node.create_publisher(msg_type, "physis_test", qos)
            node.create_timer(0.05, lambda: pub.publish(filled(kind)))
            rclpy.spin(node)
            return 0
        got = []
        node.create_subscription(msg_type, "physis_test", got.append, qos)
        while not got:
            rclpy.spin_once(node, timeout_sec=0.1)
        print(json.dumps(as_dict(got[0])), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
