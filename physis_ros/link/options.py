"""What a robot asks of its link (``LinkOptions``): the connection (credentials, timeouts,
backoff), the stream it opens (its ``StreamSpec``: pacing, latency budget, horizon, prompt,
task) and how the client behaves on the robot (queue size, pings, process tuning). Checked
when made, so a bad value is refused where it is written, not when the link first connects.
numpy + protobuf only (no torch, no rclpy).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from physis_ros.link.encoding import array_to_tensor
from physis_ros.link.proto_gen import physis_pb2 as pb
from physis_ros.link.wire import PROTOCOL_VERSION

DEFAULT_MAX_MESSAGE_BYTES = 16 * 1024 * 1024

ROLLOUTS = {
    None: pb.StreamSpec.ROLLOUTS_DEFAULT,
    True: pb.StreamSpec.ROLLOUTS_ON,
    False: pb.StreamSpec.ROLLOUTS_OFF,
}
ROLLOUT_CHOICES = {"default": None, "on": True, "off": False}
"""What a user types (bridge parameter, physis-eval --rollouts) -> ``rollouts=``."""


@dataclass(frozen=True, kw_only=True)
class LinkOptions:
    """Everything ``LinkClient`` takes besides its server, clock and prediction callback."""

    # ---- the stream it opens ------------------------------------------------------------
    seed: int = 0
    target_interval_ms: float = 0.0
    """The interval between chunks the stream asks for (0: as fast as the server can)."""
    response_latency_budget_ms: float = 0.0
    """The most response latency the stream accepts (an observation in to the first chunk
    conditioned on it out); the server refuses to open the stream when it cannot promise it.
    0: no budget."""
    horizon: int = 0
    """Chunks ahead of its newest observation the stream asks for (0: the model's default)."""
    previews: bool = False
    """Also receive each chunk's x0 estimate after every denoising step but the last
    (``Prediction.preview_steps`` > 0), before the chunk."""
    rollouts: bool | None = None
    """Whether every observation generates the whole horizon again (None: the server's
    default, on for world models)."""
    prompt: str = ""
    prompt_embedding: np.ndarray | None = field(default=None, compare=False)
    """[n, text_dim] float32/float16 text embedding instead of a prompt (the server checks)."""
    task: dict[str, float] | None = None
    """The task's values by the names the model's contract gives them (a world-action
    model's, e.g. a goal's coordinates; the stream opens only once it has the ones the model
    takes: ``LinkClient.set_task``)."""
    client_name: str = ""

    # ---- the connection ------------------------------------------------------------------
    token: str | None = None
    root_cert_path: str | None = None
    client_cert_path: str | None = None
    client_key_path: str | None = None
    tls_server_name: str | None = None
    connect_timeout_s: float = 5.0
    reconnect_backoff_s: tuple[float, float] = (0.1, 2.0)
    """(first, longest) wait between connection attempts, doubling in between."""
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES

    # ---- the client on the robot ---------------------------------------------------------
    prediction_queue_size: int = 32
    """Predictions kept for ``get_prediction`` (the oldest dropped beyond it)."""
    ping_interval_s: float = 0.5
    """How often the clock offset is probed."""
    tune_process: bool = True
    """On start, (1) let this process reuse freed large buffers instead of page-faulting each
    camera image's buffers in afresh (physis_ros.memtune, glibc only; ~0.5 ms per fresh
    0.9 MB buffer measured here), and (2) collect once, then ``gc.freeze()`` what exists by
    then (modules, the node), so that a full garbage collection, which stops every thread of
    the process, does not walk it (measured 18 ms with the link's imports, 29 ms with rclpy,
    before freezing). Both are process-wide."""

    def __post_init__(self) -> None:
        lo, hi = self.reconnect_backoff_s
        if not 0 < lo <= hi:
            raise ValueError(
                f"reconnect_backoff_s must be 0 < min <= max, got {self.reconnect_backoff_s}"
            )
        if self.connect_timeout_s <= 0:
            raise ValueError(f"connect_timeout_s must be > 0, got {self.connect_timeout_s}")
        if self.target_interval_ms < 0:
            raise ValueError(f"target_interval_ms must be >= 0, got {self.target_interval_ms}")
        if not self.response_latency_budget_ms >= 0:
            raise ValueError(
                f"response_latency_budget_ms must be >= 0 (0: none), got "
                f"{self.response_latency_budget_ms}"
            )
        if self.horizon < 0:
            raise ValueError(f"horizon must be >= 0 (0: the model's), got {self.horizon}")
        if self.prediction_queue_size < 1:
            raise ValueError(
                f"prediction_queue_size must be >= 1, got {self.prediction_queue_size}"
            )

    def stream_spec(self) -> pb.StreamSpec:
        """The ``StreamSpec`` its streams open with (``set_prompt``/``set_task`` change the
        client's copy)."""
        spec = pb.StreamSpec(
            protocol_version=PROTOCOL_VERSION,
            seed=self.seed,
            target_interval_ms=self.target_interval_ms,
            client_name=self.client_name,
            prompt=self.prompt,
            response_latency_budget_ms=self.response_latency_budget_ms,
            horizon=self.horizon,
            previews=self.previews,
            rollouts=ROLLOUTS[self.rollouts],
            resumable=True,
        )
        spec.task.update(self.task or {})
        if self.prompt_embedding is not None:
            array_to_tensor(self.prompt_embedding, spec.prompt_embedding)
        return spec
