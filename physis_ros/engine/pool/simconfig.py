"""What the pool simulator runs: the streams (``SimStream``) and the run's settings
(``SimConfig``); ``simulator.simulate`` runs them."""

from __future__ import annotations

import math
from dataclasses import dataclass

from physis_ros.engine.pool.plan import StreamPlan

PRIORITIES = ("oldest_chunk", "ready_first", "engine")


@dataclass(frozen=True, kw_only=True)
class SimStream:
    plan: StreamPlan
    phase_ms: float = 0.0
    """Release time of chunk 0."""
    latency_budget_ms: float = math.inf
    """The promised response latency: a chunk leaving later than release + budget counts as
    a latency-promise miss (reported; the target that admission guarantees is the interval)."""
    max_inflight: int = 0
    """Chunks kept in flight when the plan's target interval is 0."""
    context_chunks: bool = False
    """Every release also brings an observation: a context chunk that enters just ahead of the
    generated chunk and passes every stage too (the server puts the newest observation in
    right before a generate request). Reported are the generated chunks only; their latency
    counts from the release, when the observation entered. Needs a target interval."""
    rollout: int = 1
    """Generated chunks per release (a rollout of the stream's horizon from each
    observation); reported is the first of each release, the one its response latency means."""


@dataclass(frozen=True, kw_only=True)
class SimConfig:
    num_devices: int
    chunks: int = 16
    """Chunks simulated per stream."""
    warmup_chunks: int = 4
    """Chunks per stream excluded from the statistics (pipeline fill)."""
    cooldown_chunks: int = 2
    """Last chunks per stream excluded too: once other streams finish, the pool is emptier
    than in steady state."""
    max_batch: int = 8
    batching: bool = True
    sink_device: int | None = None
    """Device that collects finished chunks (one more hop from the last stage's device);
    None: the exit hop is not modelled."""
    forward_scale: float = 1.0
    """Multiplies every batched forward's cost (``cost.group_ms``): a slowdown of every
    forward that the cost model's isolated timing does not see (what-if studies; CPU ranks
    beside each other: ``Profile.rank_work_scale``)."""
    worker_message_ms: float = 0.0
    """Work each remote message adds to the sending and to the receiving device (the sink
    for a finished chunk), beside the message's own ``send_cpu_ms`` / ``recv_cpu_ms``
    (CPU ranks: ``Profile.worker_message_ms``)."""
    host_cores: float = 0.0
    """Processors the devices share (CPU workers on one host; may be fractional: the share of
    a loaded host that is left); 0: each device is its own processor."""
    foreign_load: float = 0.0
    """Processors' worth of other jobs' runnable work on that host, sharing it with the busy
    devices (processor sharing: each busy device runs at min(1, cores / (busy + foreign)))."""
    priority: str = "oldest_chunk"
    """Which ready task picks the next block: ``oldest_chunk`` (earliest released chunk, so
    late chunks catch up), ``ready_first`` (the task that became ready first) or ``engine``
    (``Worker._pick``: the block with most ready tasks, ties and cuts to the most downstream
    stages; without batching the most downstream task)."""
    interval_tolerance: float = 0.01
    """A stream meets its target when its median interval is within this of T and it
    misses no deadline."""
    jitter_tolerance: float = 0.10
    """Deadline of chunk c: the stream's output clock, first measured chunk out + (c - c0) * T,
    plus this fraction of T (a consumer that plays chunks at the target rate)."""

    def __post_init__(self) -> None:
        if self.num_devices < 1:
            raise ValueError(f"num_devices must be >= 1, got {self.num_devices}")
        if self.warmup_chunks < 0 or self.cooldown_chunks < 0:
            raise ValueError("warmup_chunks and cooldown_chunks must be >= 0")
        if self.chunks < self.warmup_chunks + self.cooldown_chunks + 3:
            raise ValueError(
                f"chunks ({self.chunks}) must exceed warmup_chunks ({self.warmup_chunks}) + "
                f"cooldown_chunks ({self.cooldown_chunks}) by >= 3"
            )
        if self.max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {self.max_batch}")
        if not self.forward_scale > 0:
            raise ValueError(f"forward_scale must be > 0, got {self.forward_scale}")
        if self.worker_message_ms < 0:
            raise ValueError(f"worker_message_ms must be >= 0, got {self.worker_message_ms}")
        if self.foreign_load < 0:
            raise ValueError(f"foreign_load must be >= 0, got {self.foreign_load}")
        if self.host_cores < 0:
            raise ValueError(f"host_cores must be >= 0, got {self.host_cores}")
        if self.sink_device is not None and not 0 <= self.sink_device < self.num_devices:
            raise ValueError(f"sink_device {self.sink_device} outside 0..{self.num_devices - 1}")
        if self.priority not in PRIORITIES:
            raise ValueError(f"priority {self.priority!r} is not one of {PRIORITIES}")
