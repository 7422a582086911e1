"""What the goal and object helper processes give the real bridge node in place of a
``LinkClient``: it records what the bridge asks of it (prompts, observations) and never
connects; and the loop that spins their nodes until a condition holds."""

import time

import rclpy

from physis_ros.link.client import LinkStats


class RecordingClient:
    def __init__(self) -> None:
        self.prompts: list[str] = []
        self.observations = []
        self.started_with: list[str] | None = None
        """The prompts set before ``start`` (None: never started)."""
        self.clock_ns = time.time_ns

    def start(self) -> None:
        if self.started_with is None:
            self.started_with = list(self.prompts)

    def set_prompt(self, prompt: str) -> None:
        self.prompts.append(prompt)

    def send_observation(self, obs) -> None:
        self.observations.append(obs)

    def get_prediction(self, timeout_s: float):
        time.sleep(timeout_s)

    def stats(self) -> LinkStats:
        return LinkStats(
            state="connecting", promise=None, clock_offset_ms=None,
            clock_offset_uncertainty_ms=None, robot_time_ns=self.clock_ns(), server_time_ns=None,
            observations_sent=len(self.observations),
        )  # fmt: skip

    def close(self) -> None:
        pass


def spin_until(nodes, done, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not done():
        for node in nodes:
            rclpy.spin_once(node, timeout_sec=0.02)
