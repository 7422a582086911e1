"""What the task and object helper processes give the real bridge node in place of a
``LinkClient``: it records what the bridge asks of it (task values, observations) and never
connects, and says what the served model is (push-wam's contract, as a server would); and
the loop that spins their nodes until a condition holds."""

import time

import rclpy

from physis_ros.contract.model import WamContract
from physis_ros.contract.safetensors import read_metadata
from physis_ros.link.client import LinkPromise, LinkStats
from physis_ros.weights import WAM_WEIGHTS

CONTRACT = WamContract.from_metadata(read_metadata(WAM_WEIGHTS))


class RecordingClient:
    def __init__(self) -> None:
        self.tasks: list[dict] = []
        self.observations = []
        self.started_with: list[dict] | None = None
        """The task values set before ``start`` (None: never started): the real client
        connects then, and opens its stream only once it has the task's values
        (test/link/test_link_stream.py)."""
        self.clock_ns = time.time_ns
        self.contract = CONTRACT
        self.promise = LinkPromise(
            stream_id=1, model="push-wam", steps=4, blocks=2, expected_interval_ms=200.0,
            pipeline_depth=1, expected_response_latency_ms=100.0, chunk_frames=2,
            image_height=32, image_width=32, action_horizon=12, action_dim=2,
            max_observation_bytes=1 << 20, action_mode="predict", contract=CONTRACT.to_json(),
        )  # fmt: skip

    def start(self) -> None:
        if self.started_with is None:
            self.started_with = list(self.tasks)

    def set_task(self, task: dict) -> None:
        self.tasks.append(task)

    def send_observation(self, obs) -> None:
        self.observations.append(obs)

    def get_prediction(self, timeout_s: float):
        time.sleep(timeout_s)

    def stats(self) -> LinkStats:
        return LinkStats(
            state="connecting", promise=self.promise, clock_offset_ms=None,
            clock_offset_uncertainty_ms=None, robot_time_ns=self.clock_ns(), server_time_ns=None,
            observations_sent=len(self.observations),
        )  # fmt: skip

    def close(self, timeout_s: float = 5.0) -> None:
        pass


def spin_until(nodes, done, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not done():
        for node in nodes:
            rclpy.spin_once(node, timeout_sec=0.02)
