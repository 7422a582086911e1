"""The terms of admission: the pool the controller manages (``PoolConfig``), what a stream
asks of it (``StreamRequest``) and what an admitted stream is promised (``Admission``).
``admission.AdmissionController`` decides; ``packing`` places; both read these."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from physis_ros.engine.config import ModelConfig, SamplerConfig
from physis_ros.engine.pool.latency import budget_bound
from physis_ros.engine.pool.memory import MemoryModel
from physis_ros.engine.pool.plan import StreamPlan, check_chunks

POLICIES = ("shared", "static")


@dataclass(frozen=True, kw_only=True)
class PoolConfig:
    num_devices: int
    """G: devices in the pool."""
    usable_bytes: float
    """Memory per device that streams may use (capacity minus runtime reserve)."""
    policy: str = "shared"
    """``shared`` or ``static``."""
    max_utilization: float = 0.9
    """Most of each interval a device may be busy with admitted work (headroom for jitter)."""
    memory: MemoryModel = field(default_factory=MemoryModel)
    charged_batch: int = 1
    """Tasks per batched forward the compute charge counts on: a stage is charged
    ``group_ms(b) / b`` per chunk. 1 charges every stage unbatched, a bound (batching only
    makes work cheaper); more counts on the batching a pipelined stream gets (a block's
    stages at different steps run together), which the simulator then has to confirm."""
    controller_device: int | None = None
    """Device whose worker shares its processor with the controller (rank 0 of a CPU job):
    every stream's entry and exit hops and its per-chunk controller work are charged there,
    as far as the cost model says messages cost compute. None: not charged (GPU pools, where
    the controller and the transport run beside the devices' compute)."""

    def __post_init__(self) -> None:
        if self.num_devices < 1:
            raise ValueError(f"num_devices must be >= 1, got {self.num_devices}")
        if self.controller_device is not None and not (
            0 <= self.controller_device < self.num_devices
        ):
            raise ValueError(
                f"controller_device {self.controller_device} outside 0..{self.num_devices - 1}"
            )
        if not self.usable_bytes > 0:
            raise ValueError(f"usable_bytes must be > 0, got {self.usable_bytes}")
        if self.policy not in POLICIES:
            raise ValueError(f"policy {self.policy!r} is not one of {POLICIES}")
        if not 0 < self.max_utilization <= 1:
            raise ValueError(f"max_utilization must be in (0, 1], got {self.max_utilization}")
        if self.charged_batch < 1:
            raise ValueError(f"charged_batch must be >= 1, got {self.charged_batch}")


@dataclass(frozen=True, kw_only=True)
class StreamRequest:
    model: ModelConfig
    sampler: SamplerConfig
    target_interval_ms: float
    """Interval the stream needs between chunks; 0: as fast as free devices allow (the
    fastest exclusive placement within the latency budget)."""
    latency_budget_ms: float = 0.0
    """Most response latency the stream accepts (an observation in to the first chunk
    conditioned on it out, ``latency``); 0: no budget."""
    chunks_per_interval: int = 1
    """Chunks through every stage per interval (2: each generated chunk comes with a context
    chunk, the observation it is conditioned on; 1 + h: a rollout of h with its context)."""
    rollout: int = 1
    """Generated chunks per interval, released together (h: every observation generates the
    stream's horizon h again); the rest of ``chunks_per_interval`` is the context chunk."""

    def __post_init__(self) -> None:
        check_chunks(self.chunks_per_interval, self.rollout)
        if not (self.target_interval_ms >= 0 and math.isfinite(self.target_interval_ms)):
            raise ValueError(
                f"target_interval_ms must be finite and >= 0 (0: as fast as free devices "
                f"allow), got {self.target_interval_ms}"
            )
        budget_bound(self.latency_budget_ms)


@dataclass(frozen=True, kw_only=True)
class Admission:
    """The promise made to an admitted stream."""

    plan: StreamPlan
    candidate: str
    """Which search candidate placed it: packed-used, packed-shallow, fresh-group,
    packed-any, static, fastest."""
    expected_interval_ms: float
    no_contention_latency_ms: float
    """One chunk through every stage and hop with no other work queued."""
    pipeline_latency_ms: float
    """Predicted time of one chunk through the pipeline: no-contention latency plus the other
    streams' work queued ahead of it (``latency``), as the pool is at admission."""
    expected_response_latency_ms: float
    """Interval (the wait for the next slot, at most) + pipeline latency."""
    latency_budget_ms: float = 0.0
    """The budget the stream asked for (0: none); later admissions never push it past."""
    pipeline_depth: int
    """Chunks in flight at once in steady state."""
