"""Child process: the real bridge node fed timed world-action chunks by a scripted client.

    timed_bridge.py RUN_S EXECUTION JOIN

Every 200 ms the client delivers a chunk of 12 rows at 50 ms whose first row is for 50 ms
after the observation it answers; the observation was taken 150 ms (three control periods)
before the chunk arrives, every third chunk 300 ms (six). All chunks continue one ramp of
the joint targets (0.4 rad/s), so a bridge that executes each row at its time commands a
trajectory that only ever moves forward. Prints one JSON line of what the node did.
"""

import json
import queue
import sys
import threading
import time

import numpy as np
import rclpy

from physis_ros.link.client import LinkPromise, LinkStats, Prediction
from physis_ros.nodes.bridge import Bridge

MS = 1_000_000
ROWS, ROW_NS = 12, 50 * MS
T0_NS = [0]


def ramp(t_ns) -> np.ndarray:
    return 0.5 + 0.4 * (np.asarray(t_ns) - T0_NS[0]) / 1e9


class TimedClient:
    def __init__(self) -> None:
        self.queue: queue.Queue[Prediction] = queue.Queue()
        self.clock_ns = time.time_ns
        self.sent = 0
        self.late_chunks = 0
        self._running = True
        self.go = threading.Event()
        """Set once the test's monitor is subscribed: the run starts then (discovery takes
        seconds on a busy machine, and chunks published before it would go unseen)."""

    def promise(self) -> LinkPromise:
        return LinkPromise(
            stream_id=1, model="scripted-wam", steps=4, blocks=2, expected_interval_ms=200.0,
            pipeline_depth=1, expected_response_latency_ms=150.0, chunk_frames=2,
            image_height=16, image_width=16, action_horizon=ROWS, action_dim=2,
            max_observation_bytes=1 << 20,
        )  # fmt: skip

    def start(self) -> None:
        threading.Thread(target=self._produce, daemon=True).start()

    def _produce(self) -> None:
        self.go.wait()
        chunk = 0
        while self._running:
            now = self.clock_ns()
            late_ns = (300 if chunk % 3 == 2 else 150) * MS
            obs_ns = now - late_ns
            start_ns = obs_ns + ROW_NS
            rows = ramp(start_ns + ROW_NS * np.arange(ROWS))
            self.late_chunks += int(late_ns > ROW_NS)
            self.queue.put(
                Prediction(
                    stream_id=1, chunk_index=chunk,
                    frames=np.zeros((2, 16, 16, 3), np.uint8),
                    actions=np.stack([rows, -rows], axis=1).astype(np.float32),
                    observation_seq=chunk, observation_stamp_ns=obs_ns, server_times_ns={},
                    received_ns=now, hop_ms={}, action_start_ns=start_ns, action_dt_ns=ROW_NS,
                )
            )  # fmt: skip
            chunk += 1
            time.sleep(0.2)

    def send_observation(self, obs) -> None:
        self.sent += 1

    def get_prediction(self, timeout_s: float):
        try:
            return self.queue.get(timeout=timeout_s)
        except queue.Empty:
            return None

    def stats(self) -> LinkStats:
        return LinkStats(
            state="streaming", promise=self.promise(), clock_offset_ms=0.0,
            clock_offset_uncertainty_ms=0.0, robot_time_ns=self.clock_ns(), server_time_ns=None,
            observations_sent=self.sent,
        )  # fmt: skip

    def close(self) -> None:
        self._running = False
        self.go.set()  # a producer still waiting for the monitor ends


def main() -> int:
    run_s, execution, join = float(sys.argv[1]), sys.argv[2], sys.argv[3]
    rclpy.init(
        args=[
            "--ros-args", "-p", f"execution:={execution}", "-p", f"join:={join}",
            "-p", "joint_names:=[shoulder,elbow]", "-p", "max_observation_age_s:=0.0",
        ]
    )  # fmt: skip
    client = TimedClient()
    node = Bridge(client=client)
    client.clock_ns = lambda: node.get_clock().now().nanoseconds
    discovery_deadline = time.monotonic() + 60.0
    topics = node.topics
    while not (
        topics.joint_trajectory.get_subscription_count()
        and topics.action_chunk.get_subscription_count()
    ):
        if time.monotonic() > discovery_deadline:
            raise SystemExit("the test's monitor never subscribed to joint_trajectory")
        rclpy.spin_once(node, timeout_sec=0.05)
    T0_NS[0] = client.clock_ns()
    client.go.set()
    deadline = time.monotonic() + run_s
    while time.monotonic() < deadline:
        rclpy.spin_once(node, timeout_sec=0.05)
    node.shutdown()
    stats = node.execution.stats
    print(
        json.dumps(
            {
                "counts": node.snapshot().counts,
                "drops": node.drops.snapshot(),
                "t0_ns": T0_NS[0],
                "accepted": stats.accepted,
                "rows_skipped": stats.rows_skipped,
                "refused": stats.refused,
            }
        ),
        flush=True,
    )
    node.destroy_node()
    rclpy.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
