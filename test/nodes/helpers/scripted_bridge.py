"""Child process for the safety test: the real bridge node, fed by a scripted link client.

    scripted_bridge.py INTERVAL_MS RUN_S STOP_AT_S RESUME_AT_S [world-model]

The client delivers a chunk (4 x 2 actions, 2 frames of 16x16; a world model's: the frames
only) every INTERVAL_MS, stops at
STOP_AT_S (the "server" goes silent), resumes at RESUME_AT_S with a new stream (chunk indices
restart), and the node runs RUN_S in all. Prints one JSON line of what it did at the end.
This drives the bridge's publishing and safety side exactly as the link client would,
with times the test controls.
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

DISCOVERY_TIMEOUT_S = 60.0
"""Longest the script waits for the test's monitor to subscribe (then it runs anyway)."""


class ScriptedClient:
    def __init__(
        self, interval_ms: float, stop_at_s: float, resume_at_s: float, world_model: bool
    ) -> None:
        self.world_model = world_model
        self.interval_s = interval_ms / 1e3
        self.stop_at_s, self.resume_at_s = stop_at_s, resume_at_s
        self.queue: queue.Queue[Prediction] = queue.Queue()
        self.sent = 0
        self.stream_id = 1
        self.clock_ns = time.time_ns
        self._running = True

    def promise(self) -> LinkPromise:
        return LinkPromise(
            stream_id=self.stream_id, model="scripted", steps=4, blocks=2,
            expected_interval_ms=self.interval_s * 1e3, pipeline_depth=1,
            expected_response_latency_ms=self.interval_s * 1e3, chunk_frames=2, image_height=16,
            image_width=16, action_horizon=4, action_dim=2, max_observation_bytes=1 << 20,
            horizon=1, action_mode="condition" if self.world_model else "predict",
        )  # fmt: skip

    def start(self) -> None:
        """The bridge starts its client; the script begins once the test watches (begin)."""

    def begin(self) -> None:
        threading.Thread(target=self._produce, daemon=True).start()

    def _produce(self) -> None:
        t0 = time.monotonic()
        chunk = 0
        while self._running:
            t = time.monotonic() - t0
            if self.stop_at_s <= t < self.resume_at_s:
                time.sleep(0.005)
                continue
            if t >= self.resume_at_s and self.stream_id == 1:
                self.stream_id, chunk = 2, 0
            now = self.clock_ns()
            self.queue.put(
                Prediction(
                    stream_id=self.stream_id,
                    chunk_index=chunk,
                    frames=np.full((2, 16, 16, 3), chunk % 255, np.uint8),
                    actions=None if self.world_model else np.full((4, 2), 0.1 * chunk, np.float32),
                    observation_seq=-1,
                    observation_stamp_ns=0,
                    server_times_ns={},
                    received_ns=now,
                    hop_ms={"pipeline": 1.0},
                )
            )
            chunk += 1
            time.sleep(self.interval_s)

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


def main() -> int:
    interval_ms, run_s, stop_at_s, resume_at_s = (float(a) for a in sys.argv[1:5])
    world_model = len(sys.argv) > 5 and sys.argv[5] == "world-model"
    rclpy.init()
    client = ScriptedClient(interval_ms, stop_at_s, resume_at_s, world_model)
    node = Bridge(client=client)
    client.clock_ns = lambda: node.get_clock().now().nanoseconds
    # The script's times count from when the test's monitor is matched: on a loaded host
    # discovery took longer than the whole first stream, and the silence went unseen.
    watched_by = time.monotonic() + DISCOVERY_TIMEOUT_S
    while time.monotonic() < watched_by and not (
        node.topics.action_chunk.get_subscription_count()
        and node.topics.diagnostics.get_subscription_count()
    ):
        rclpy.spin_once(node, timeout_sec=0.05)
    client.begin()
    deadline = time.monotonic() + run_s
    while time.monotonic() < deadline:
        rclpy.spin_once(node, timeout_sec=0.05)
    node.shutdown()
    snapshot = node.snapshot()
    print(
        json.dumps(
            {
                "counts": snapshot.counts,
                "drops": node.drops.snapshot(),
                "holding": snapshot.outputs.holding,
            }
        ),
        flush=True,
    )
    node.destroy_node()
    rclpy.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
