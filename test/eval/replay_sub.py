"""Child process for test_replay.py: receive raw messages on the recorder's topics.

replay_sub.py N_IMAGES TIMEOUT_S [IMAGE_TOPIC]: subscribes (reliable, raw CDR) to the camera
(IMAGE_TOPIC, default /camera/image_raw), wrench, joint state and command topics; once
N_IMAGES images arrived and the other topics went quiet for 1 s
(or after TIMEOUT_S) prints one JSON line: per topic count, and per image its receive time
(time.monotonic) and header stamp (ns).
"""

import json
import signal
import struct
import sys
import time

import rclpy
from geometry_msgs.msg import WrenchStamped
from rclpy.qos import QoSProfile, ReliabilityPolicy
from sensor_msgs.msg import Image, JointState
from trajectory_msgs.msg import JointTrajectory

TOPICS = {
    "/camera/image_raw": Image,
    "/wrench": WrenchStamped,
    "/joint_states": JointState,
    "/joint_command": JointTrajectory,
}


def stamp_ns(raw: bytes) -> int:
    endian = "<" if raw[1] & 1 else ">"
    sec, nsec = struct.unpack_from(f"{endian}iI", raw, 4)
    return sec * 1_000_000_000 + nsec


def main() -> int:
    want, timeout_s = int(sys.argv[1]), float(sys.argv[2])
    image_topic = sys.argv[3] if len(sys.argv) > 3 else "/camera/image_raw"
    topics = {image_topic if t == "/camera/image_raw" else t: c for t, c in TOPICS.items()}
    # SIGTERM leaves through the finally below: a participant killed without destroying its
    # node stays matched to writers started after it (reliable ones then wait on its ACKs)
    # until its lease runs out.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    rclpy.init()
    node = rclpy.create_node("replay_sub")
    try:
        return _receive(node, topics, want, timeout_s, image_topic)
    finally:
        node.destroy_node()
        rclpy.try_shutdown()


def _receive(node, topics, want: int, timeout_s: float, image_topic: str) -> int:
    counts = dict.fromkeys(topics, 0)
    images = []

    def on_msg(topic):
        def cb(raw):
            counts[topic] += 1
            if topic == image_topic:
                images.append((time.monotonic(), stamp_ns(raw)))

        return cb

    qos = QoSProfile(depth=100, reliability=ReliabilityPolicy.RELIABLE)
    for topic, cls in topics.items():
        node.create_subscription(cls, topic, on_msg(topic), qos, raw=True)
    print("ready", flush=True)
    deadline = time.monotonic() + timeout_s
    while len(images) < want and time.monotonic() < deadline:
        rclpy.spin_once(node, timeout_sec=0.05)
    # the other topics' last messages: spin until none has come for 1 s (a loaded host can
    # leave a backlog of 100 Hz messages behind the last image)
    quiet_since, seen = time.monotonic(), sum(counts.values())
    while time.monotonic() - quiet_since < 1.0 and time.monotonic() < deadline:
        rclpy.spin_once(node, timeout_sec=0.05)
        if sum(counts.values()) != seen:
            quiet_since, seen = time.monotonic(), sum(counts.values())
    print(json.dumps({"counts": counts, "images": images, "now_ns": time.time_ns()}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
