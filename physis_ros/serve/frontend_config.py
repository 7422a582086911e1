"""How the server front end listens and what it accepts (``FrontendConfig``; every
stream's limits: ``SessionLimits``), and what it reports about the model it serves
(``ServerDescription``): plain data, checked when made.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from physis_ros.engine.live import LiveLimits


@dataclass(frozen=True, kw_only=True)
class SessionLimits:
    """Front-end limits that apply to every stream."""

    max_observation_bytes: int = 8 * 1024 * 1024
    """Larger observations are dropped ("oversized") and the stream goes on."""
    outbound_queue: int = 16
    """Messages waiting for a slow client; beyond it the oldest prediction is dropped."""
    unattached_timeout_s: float = 10.0
    """A stream opened but never attached to a Stream call is closed after this."""
    stall_timeout_s: float = 60.0
    """Chunks in flight but none finished for this long: the stream ends with UNAVAILABLE
    (the client reconnects) instead of waiting forever on a stuck engine."""
    max_non_finite_chunks: int = 3
    """Chunks in a row whose model output held NaN or inf (never published, each counted
    "non_finite_output") before the stream ends with INTERNAL: its KV history is poisoned."""
    drop_log_interval_s: float = 10.0
    """A stream's drops are logged (WARNING) the first time per reason, then at most once
    per this interval with the count since: a flood of bad input cannot flood the log."""

    def __post_init__(self) -> None:
        for name in ("stall_timeout_s", "unattached_timeout_s", "drop_log_interval_s"):
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"{name} must be a finite number, got {getattr(self, name)}")
        if self.max_non_finite_chunks < 1:
            raise ValueError(
                f"max_non_finite_chunks must be >= 1, got {self.max_non_finite_chunks}"
            )
        if self.drop_log_interval_s < 0:
            raise ValueError(f"drop_log_interval_s must be >= 0, got {self.drop_log_interval_s}")
        if self.max_observation_bytes <= 0:
            raise ValueError(f"max_observation_bytes must be > 0, got {self.max_observation_bytes}")
        if self.outbound_queue < 2:
            raise ValueError(f"outbound_queue must be >= 2, got {self.outbound_queue}")
        if self.stall_timeout_s <= 0:
            raise ValueError(f"stall_timeout_s must be > 0, got {self.stall_timeout_s}")
        if self.unattached_timeout_s <= 0:
            raise ValueError(f"unattached_timeout_s must be > 0, got {self.unattached_timeout_s}")

    def live(self) -> LiveLimits:
        """The limits the engine core ends a served stream by."""
        return LiveLimits(
            stall_timeout_s=self.stall_timeout_s, max_non_finite_chunks=self.max_non_finite_chunks
        )


@dataclass(frozen=True, kw_only=True)
class FrontendConfig:
    """How the server front end listens and what it accepts."""

    host: str = "127.0.0.1"
    """Interface to bind; anything but loopback should come with TLS and a token."""
    port: int = 0
    """0: an ephemeral port (see ServerHandle.port)."""
    max_message_bytes: int = 16 * 1024 * 1024
    """gRPC limit per message; a larger one ends its call with RESOURCE_EXHAUSTED."""
    limits: SessionLimits = field(default_factory=SessionLimits)
    max_streams: int = 16
    """Streams open at once, whatever the engine could admit."""
    worker_threads: int = 64
    """gRPC handler threads; each attached stream holds one."""
    open_timeout_s: float = 30.0
    """How long OpenStream waits for the engine to admit."""
    resume_grace_s: float = 10.0
    """How long a resumable stream whose Stream call broke is held for its client to resume
    it (serve/resume.py); 0: closed when its call ends."""
    token: str | None = None
    """Bearer token every call must carry (metadata ``authorization: Bearer <token>``)."""
    tls_cert_path: str | None = None
    tls_key_path: str | None = None
    tls_client_ca_path: str | None = None
    """When given, clients must present a certificate signed by this CA."""
    metrics_port: int | None = None
    """Prometheus /metrics over HTTP on ``host`` at this port (serve/metrics.py); None: none,
    0: an ephemeral port."""

    def __post_init__(self) -> None:
        if not (math.isfinite(self.open_timeout_s) and self.open_timeout_s > 0):
            raise ValueError(
                f"open_timeout_s must be a finite number > 0, got {self.open_timeout_s}"
            )
        if not (math.isfinite(self.resume_grace_s) and self.resume_grace_s >= 0):
            raise ValueError(
                f"resume_grace_s must be a finite number >= 0 (0: off), got {self.resume_grace_s}"
            )
        for name in ("port", "metrics_port"):
            if not 0 <= (getattr(self, name) or 0) <= 65535:
                raise ValueError(f"{name} must be 0..65535, got {getattr(self, name)}")
        if self.limits.max_observation_bytes > self.max_message_bytes:
            raise ValueError(
                f"max_observation_bytes {self.limits.max_observation_bytes} exceeds "
                f"max_message_bytes {self.max_message_bytes}"
            )
        if self.max_streams < 1:
            raise ValueError(f"max_streams must be >= 1, got {self.max_streams}")
        if self.worker_threads < self.max_streams + 4:
            raise ValueError(
                f"worker_threads {self.worker_threads} must be >= max_streams + 4 "
                f"({self.max_streams + 4}): every attached stream holds a thread"
            )
        if (self.tls_cert_path is None) != (self.tls_key_path is None):
            raise ValueError("tls_cert_path and tls_key_path go together")
        if self.tls_client_ca_path is not None and self.tls_cert_path is None:
            raise ValueError("tls_client_ca_path needs tls_cert_path and tls_key_path")
        if self.token is not None and not self.token.strip():
            raise ValueError("token must not be empty")


@dataclass(frozen=True, kw_only=True)
class ServerDescription:
    """What GetServerInfo reports about the model and placement."""

    model: str
    steps: int
    blocks: int
    placement: str = ""
    action_mode: str = "none"
    """The model's action_mode; "condition": generate requests carry commanded actions."""
    horizon: int = 0
    """The model's default horizon (weights' metadata; 0: none, streams then get
    ``DEFAULT_HORIZON``)."""
    engine_info: Callable[[], dict[str, Any]] | None = None
    """What the engine reports about itself (workers, open streams / slots), on demand."""
    rollouts: bool = True
    """A world model's streams with a horizon > 1 get rollouts unless they ask otherwise
    (False: the engine's codec is causal, so none can have them)."""
