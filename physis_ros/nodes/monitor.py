"""``Monitor``: a listening node for the demo, the ROS benchmark and the tests.

Subscribes to everything the bridge publishes (and the camera), keeps counts and the latest
message of each, every message of the topics asked for with its arrival time
(``time.monotonic()``; the newest ``keep_last`` of each where a long run asks for a bound),
and reads topic types from the graph. It spins in its own thread with its own rclpy
context, so a process can run it beside other work and stop it cleanly.
"""

from __future__ import annotations

import threading
import time
from collections import Counter, defaultdict, deque

import rclpy
from diagnostic_msgs.msg import DiagnosticArray
from rclpy.context import Context
from rclpy.executors import SingleThreadedExecutor
from rclpy.node import Node
from rclpy.qos import QoSProfile, ReliabilityPolicy, qos_profile_sensor_data
from sensor_msgs.msg import Image
from trajectory_msgs.msg import JointTrajectory
from visualization_msgs.msg import MarkerArray

from physis_ros.msg import ActionChunk, PipelineStats

TOPICS = {
    "camera/image": (Image, "sensor"),
    "predicted/image": (Image, "reliable"),
    "predicted/side_by_side": (Image, "reliable"),
    "action_chunk": (ActionChunk, "reliable"),
    "joint_trajectory": (JointTrajectory, "reliable"),
    "joint_command": (JointTrajectory, "reliable"),
    "predicted/ee_path": (MarkerArray, "reliable"),
    "pipeline_stats": (PipelineStats, "reliable"),
    "/diagnostics": (DiagnosticArray, "reliable"),
}


class Monitor:
    def __init__(
        self,
        *,
        domain_id: int | None = None,
        keep: tuple[str, ...] = (),
        images: tuple[str, ...] = (),
        namespace: str = "",
        keep_last: int | None = None,
    ) -> None:
        """``keep``: topics whose every message is kept (others: only the latest), the newest
        ``keep_last`` of each when given (memory stays flat however long it runs);
        ``images``: more sensor_msgs/Image topics to watch (e.g. predicted/preview/step_<k>);
        ``namespace``: the robot's, against which the relative topic names resolve."""
        self.context = Context()
        # args=[]: the host program's own arguments (physis-demo's, a test's) are not ROS ones
        rclpy.init(args=[], context=self.context, domain_id=domain_id)
        self.node = Node("physis_monitor", namespace=namespace, context=self.context)
        self._lock = threading.Lock()
        self.counts: Counter[str] = Counter()
        self.latest: dict[str, object] = {}
        self.kept: dict[str, deque] = defaultdict(lambda: deque(maxlen=keep_last))
        self._keep = set(keep)
        reliable = QoSProfile(depth=50, reliability=ReliabilityPolicy.RELIABLE)
        topics = {**TOPICS, **{t: (Image, "reliable") for t in images}}
        for topic, (kind, qos) in topics.items():
            self.node.create_subscription(
                kind,
                topic,
                lambda msg, topic=topic: self._on(topic, msg),
                qos_profile_sensor_data if qos == "sensor" else reliable,
            )
        self.executor = SingleThreadedExecutor(context=self.context)
        self.executor.add_node(self.node)
        self._thread = threading.Thread(target=self._spin, name="monitor", daemon=True)
        self._running = True
        self._thread.start()

    def _spin(self) -> None:
        while self._running and self.context.ok():
            self.executor.spin_once(timeout_sec=0.05)

    def _on(self, topic: str, msg) -> None:
        now_s = time.monotonic()
        with self._lock:
            self.counts[topic] += 1
            self.latest[topic] = msg
            if topic in self._keep:
                self.kept[topic].append((now_s, msg))

    def count(self, topic: str) -> int:
        with self._lock:
            return self.counts[topic]

    def get(self, topic: str):
        with self._lock:
            return self.latest.get(topic)

    def messages(self, topic: str, since_s: float = 0.0) -> list:
        """(arrival monotonic s, msg) of a kept topic, arrived at or after ``since_s``."""
        with self._lock:
            return [(t, m) for t, m in self.kept[topic] if t >= since_s]

    def published_types(self, topic: str) -> set[str]:
        """Types offered by the publishers of ``topic`` other than this monitor."""
        name = self.node.resolve_topic_name(topic)  # graph queries want full names
        return {info.topic_type for info in self.node.get_publishers_info_by_topic(name)}

    def wait_for(self, predicate, timeout_s: float, poll_s: float = 0.05) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if predicate():
                return True
            time.sleep(poll_s)
        return bool(predicate())

    def close(self) -> None:
        self._running = False
        self._thread.join(timeout=2.0)
        self.executor.shutdown()
        self.node.destroy_node()
        rclpy.shutdown(context=self.context)


def diagnostics_by_name(array: DiagnosticArray) -> dict[str, tuple[int, str, dict[str, str]]]:
    """status name -> (level as int, message, {key: value})."""
    result = {}
    for status in array.status:
        level = status.level[0] if isinstance(status.level, bytes) else int(status.level)
        result[status.name] = (level, status.message, {kv.key: kv.value for kv in status.values})
    return result
