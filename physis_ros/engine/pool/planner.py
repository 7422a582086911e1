"""The planner's latency model: depth against width, and the (interval, response latency,
devices) frontier of a model on a pool.

A robot cares about two numbers per stream: the *interval* I between its chunks and the
*response latency* R, from an observation reaching the server to the first chunk conditioned
on it leaving the pipeline. The observation waits for the stream's next slot (at most one
interval) and that chunk then crosses the pipeline: its *pipeline latency* L, every stage and
hop plus any wait behind other work. So R = I + L, the worst case over when the observation
arrives (the depth experiment and admission use the same definition).

A *shape* says how one stream's K*L stages sit on devices:
- depth d: devices a chunk passes through (the stages cut into d contiguous runs). Deeper:
  each device does 1/d of a chunk, so a shorter interval; L gains the d - 1 hops.
- width: streams per device. ``staggered``: b streams time-share the same d devices, their
  slots offset by one run's time, so they never wait for each other (I grows b-fold, L does
  not). ``batched``: b streams on one device released in the same slot, every stage one
  batched forward of b tasks (I = L = K*L forwards of b tasks: worth it where batching is
  cheap, on CPUs and small models). And floor(G / d) groups side by side (replicas).

``estimate`` is the closed form of a shape (what the simulator gives when every stream keeps
its slots; ``tools/experiments/frontier.py`` checks it by simulation); ``shapes`` enumerates
what fits in memory; ``pareto`` keeps the shapes no other beats on all of I, R and devices per
stream.
Chunk size (latent frames per chunk) and window W are inputs: the caller passes the model
with ``latent_frames`` replaced and the sampler with its window.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

from physis_ros.engine.config import ModelConfig, SamplerConfig
from physis_ros.engine.pool.costmodel import CostModel
from physis_ros.engine.pool.memory import MemoryModel
from physis_ros.engine.pool.plan import contiguous_split

SHARING = ("alone", "staggered", "batched")


@dataclass(frozen=True, kw_only=True)
class Shape:
    depth: int
    """Devices a chunk passes through."""
    streams: int = 1
    """Streams sharing those devices."""
    sharing: str = "alone"
    """``alone`` (one stream), ``staggered`` or ``batched`` (see the module docstring)."""

    def __post_init__(self) -> None:
        if self.depth < 1 or self.streams < 1:
            raise ValueError(f"depth and streams must be >= 1, got {self.depth}, {self.streams}")
        if self.sharing not in SHARING:
            raise ValueError(f"sharing {self.sharing!r} is not one of {SHARING}")
        if (self.sharing == "alone") != (self.streams == 1):
            raise ValueError(f"sharing {self.sharing!r} with {self.streams} stream(s)")
        if self.sharing == "batched" and self.depth != 1:
            # Over several devices a batch would not stay together: the first stream's
            # activation reaching the next device starts a batch of one there.
            raise ValueError("batched sharing is planned on one device only")


@dataclass(frozen=True, kw_only=True)
class Estimate:
    """What the planner promises a shape: every stream of it gets this interval and latency."""

    shape: Shape
    interval_ms: float
    pipeline_latency_ms: float
    """One chunk, release to out: every stage and hop (no waiting: slots keep streams apart)."""
    stage_devices: tuple[int, ...]
    """Device of stage i, devices numbered 0..depth-1 within the group."""
    phases_ms: tuple[float, ...]
    """First slot of each stream of the group, relative to the first one's."""
    memory_bytes: int
    """The most any device of the group holds."""

    @property
    def response_latency_ms(self) -> float:
        return self.interval_ms + self.pipeline_latency_ms

    @property
    def devices_per_stream(self) -> float:
        return self.shape.depth / self.shape.streams

    def streams_in_pool(self, devices: int) -> int:
        """Streams a pool of ``devices`` holds with groups of this shape side by side."""
        return devices // self.shape.depth * self.shape.streams

    def to_json(self, devices: int) -> dict:
        return {
            "depth": self.shape.depth,
            "streams_per_group": self.shape.streams,
            "sharing": self.shape.sharing,
            "devices_per_stream": round(self.devices_per_stream, 4),
            "streams_in_pool": self.streams_in_pool(devices),
            "interval_ms": round(self.interval_ms, 4),
            "pipeline_latency_ms": round(self.pipeline_latency_ms, 4),
            "response_latency_ms": round(self.response_latency_ms, 4),
            "memory_gib_max": round(self.memory_bytes / 1024**3, 2),
        }


def path_latency_ms(
    cost: CostModel, cfg: ModelConfig, sampler: SamplerConfig, stage_devices, tasks: int = 1
) -> float:
    """One chunk through ``stage_devices`` with nothing in its way: every stage (a batched
    forward of ``tasks``) and every hop."""
    stages = len(stage_devices) * cost.group_ms(cfg, sampler, tasks)
    hops = sum(cost.hop_ms(cfg, a, b) for a, b in itertools.pairwise(stage_devices) if a != b)
    return stages + hops


def device_work_ms(
    cost: CostModel, cfg: ModelConfig, sampler: SamplerConfig, stage_devices, tasks: int = 1
) -> dict[int, float]:
    """Work per chunk each device does for ``stage_devices``: its forwards and, where messages
    cost its processor time, its sends and receives (send threads' time is beside it)."""
    stage_ms = cost.group_ms(cfg, sampler, tasks)
    send_ms = 0.0 if cost.comm_threads else cost.send_cpu_ms(cfg)
    recv_ms = 0.0 if cost.comm_threads else cost.recv_cpu_ms(cfg)
    work: dict[int, float] = {}
    for d in stage_devices:
        work[d] = work.get(d, 0.0) + stage_ms
    for a, b in itertools.pairwise(stage_devices):
        if a != b:
            work[a] += send_ms
            work[b] += recv_ms
    return work


def estimate(
    cost: CostModel,
    cfg: ModelConfig,
    sampler: SamplerConfig,
    shape: Shape,
    memory: MemoryModel,
) -> Estimate:
    """The closed form of ``shape`` (module docstring)."""
    if shape.sharing == "staggered":
        return stagger(
            estimate(cost, cfg, sampler, Shape(depth=shape.depth), memory),
            shape.streams,
            cfg,
            sampler,
            memory,
        )
    S = sampler.steps * cfg.num_blocks
    if shape.depth > S:
        raise ValueError(f"depth {shape.depth} > {S} stages")
    sd = contiguous_split(S, list(range(shape.depth)))
    b = shape.streams
    latency = path_latency_ms(cost, cfg, sampler, sd, tasks=b)
    interval = max(device_work_ms(cost, cfg, sampler, sd, tasks=b).values())
    # A device's link carries one activation per chunk it hands on: never the bottleneck on
    # an NVLink/IB pool, but it bounds the interval where hops are slow.
    if cost.comm_overlaps_compute:  # (otherwise the send is in the sender's work already)
        hops = [cost.hop_ms(cfg, a, c) for a, c in itertools.pairwise(sd) if a != c]
        interval = max(interval, *hops) if hops else interval
    return Estimate(
        shape=shape,
        interval_ms=interval,
        pipeline_latency_ms=latency,
        stage_devices=sd,
        phases_ms=(0.0,) * b,
        memory_bytes=group_memory_bytes(memory, cfg, sampler, sd, streams=b),
    )


def stagger(
    alone: Estimate, streams: int, cfg: ModelConfig, sampler: SamplerConfig, memory: MemoryModel
) -> Estimate:
    """``streams`` streams time-sharing the devices of ``alone``, each slot one run's time
    after the previous stream's: none waits for another, so the latency stays."""
    slot = alone.interval_ms
    return Estimate(
        shape=Shape(depth=alone.shape.depth, streams=streams, sharing="staggered"),
        interval_ms=streams * slot,
        pipeline_latency_ms=alone.pipeline_latency_ms,
        stage_devices=alone.stage_devices,
        phases_ms=tuple(j * slot for j in range(streams)),
        memory_bytes=group_memory_bytes(memory, cfg, sampler, alone.stage_devices, streams=streams),
    )


def group_memory_bytes(
    memory: MemoryModel, cfg: ModelConfig, sampler: SamplerConfig, stage_devices, *, streams: int
) -> int:
    """The most any device holds when ``streams`` streams share ``stage_devices``: what
    ``MemoryModel.device_usage`` gives for their plans, in one pass over the stages."""
    L = cfg.num_blocks
    stages: dict[int, int] = {}
    blocks: dict[int, set[int]] = {}
    inbound: dict[int, int] = {}
    prev = None
    for i, d in enumerate(stage_devices):
        stages[d] = stages.get(d, 0) + 1
        blocks.setdefault(d, set()).add(i % L)
        if prev is not None and prev != d:
            inbound[d] = inbound.get(d, 0) + 1
        prev = d
    most = 0
    for d, n in stages.items():
        weights = len(blocks[d]) * memory.block_weight_bytes(cfg)
        if blocks[d] & {0, L - 1}:
            weights += memory.edge_weight_bytes(cfg)
        per_stream = (
            n * memory.stage_kv_bytes(cfg, sampler)
            + len(blocks[d]) * memory.cross_kv_bytes(cfg)
            + inbound.get(d, 0) * memory.recv_buffer_bytes(cfg)
        )
        most = max(most, weights + streams * per_stream + memory.workspace_bytes(cfg))
    return most


def shapes(
    cost: CostModel,
    cfg: ModelConfig,
    sampler: SamplerConfig,
    *,
    devices: int,
    usable_bytes: float,
    memory: MemoryModel,
    max_streams: int = 8,
) -> list[Estimate]:
    """Every shape up to ``devices`` deep and ``max_streams`` wide whose devices hold it."""
    S = sampler.steps * cfg.num_blocks
    out = []
    for depth in range(1, min(devices, S) + 1):
        alone = estimate(cost, cfg, sampler, Shape(depth=depth), memory)
        found = [alone]
        for b in range(2, max_streams + 1):
            found.append(stagger(alone, b, cfg, sampler, memory))
            if depth == 1:
                found.append(
                    estimate(
                        cost, cfg, sampler, Shape(depth=1, streams=b, sharing="batched"), memory
                    )
                )
        out += [e for e in found if e.memory_bytes <= usable_bytes]
    return out


def objectives(e: Estimate) -> tuple[float, float, float]:
    """What the front minimises: interval, response latency (to 1e-9 ms, so float round-off
    of equal shapes ties) and devices per stream."""
    return (round(e.interval_ms, 9), round(e.response_latency_ms, 9), e.devices_per_stream)


def pareto(estimates: list[Estimate]) -> list[Estimate]:
    """The estimates no other beats: none has all ``objectives`` at most its own and one of
    them lower. Sorted by interval, fewest devices first; of exact ties, the shallowest."""
    # In this order every estimate that beats another comes before it, and whatever beats a
    # beaten one beats what it beats: checking against the front found so far is enough.
    front: list[Estimate] = []
    for e in sorted(estimates, key=lambda e: (*objectives(e), e.shape.depth)):
        k = objectives(e)
        if not any(all(a <= b for a, b in zip(objectives(f), k, strict=True)) for f in front):
            front.append(e)
    return sorted(front, key=lambda e: (e.interval_ms, e.devices_per_stream))


def fastest_within(estimates: list[Estimate], budget_ms: float) -> Estimate | None:
    """The shortest interval whose response latency is within ``budget_ms`` (math.inf: no
    budget), fewest devices per stream on ties; None when none is."""
    ok = [e for e in estimates if e.response_latency_ms <= budget_ms]
    if not ok:
        return None
    return min(ok, key=lambda e: (e.interval_ms, e.devices_per_stream, e.shape.depth))


def no_budget(budget_ms: float) -> float:
    """A request's latency budget as a bound: 0 (none asked) is no bound."""
    if budget_ms < 0 or math.isnan(budget_ms):
        raise ValueError(f"latency budget must be >= 0 (0: none), got {budget_ms}")
    return math.inf if budget_ms == 0 else budget_ms
