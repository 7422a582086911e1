"""The frontier experiment: the (interval, response latency, devices per stream) Pareto front
of a model on a pool of modelled H200s, every point's placement simulated, and the published
points placed on it.

``planner.shapes`` enumerates depth (devices a chunk passes through) and width (streams that
time-share or batch on the same devices; groups side by side); ``planner.pareto`` keeps the
front. Each front point is then simulated as planned (its streams, its slots) and must keep
its promise: median interval and every chunk's pipeline latency at most the planner's. Groups
side by side use disjoint devices and run alike, so one group is simulated.
"""

from __future__ import annotations

import math
from dataclasses import asdict

from physis_ros.engine.config import ModelConfig, SamplerConfig, get_preset
from physis_ros.engine.pool.costmodel import H200, AnalyticCostModel, CostModel, DeviceSpec
from physis_ros.engine.pool.memory import MemoryModel
from physis_ros.engine.pool.plan import StreamPlan
from physis_ros.engine.pool.planner import Estimate, pareto, shapes
from physis_ros.engine.pool.simulator import SimConfig, SimStream, simulate
from physis_ros.tools.experiments.pool24 import POOL24_SAMPLER, backbone_facts

PROMISE_TOLERANCE = 1e-5
"""Relative slack of a simulated point against its promise (float round-off)."""
REPORT_ROUNDING_MS = 5e-5
"""The simulator's report rounds intervals to 0.1 us."""

PUBLISHED = {
    "wan2.1-14b": [
        {
            "label": "published pool24 static (24 streams on 24 GPUs, T = 1600 ms)",
            "interval_ms": 1600.0,
            "devices_per_stream": 1.0,
            "devices": 24,
            "chunk_latent_frames": 3,
        },
        {
            "label": "published pool24 shared (18 streams on 24 GPUs, T = 1600 ms)",
            "interval_ms": 1600.0,
            "devices_per_stream": 24 / 18,
            "devices": 24,
            "chunk_latent_frames": 3,
        },
    ],
    "dit-33b": [
        {
            "label": "published depth (one stream, one stage per GPU on 200 GPUs)",
            "interval_ms": 4.083,
            "devices_per_stream": 200.0,
            "devices": 200,
            "chunk_latent_frames": None,
        },
    ],
}
"""Published results as points: interval and devices per stream (their response latency is
not published). ``chunk_latent_frames``: the chunk the point is compared at (pool24 as run
here, 3 latent frames); None: not stated with the result, placed on every front."""


def simulate_point(
    est: Estimate, cost: CostModel, cfg, sampler: SamplerConfig, *, measured_chunks: int = 12
) -> dict:
    """One group of ``est`` run by the simulator as planned; what it measured against the
    promise."""
    T = est.interval_ms
    fill = math.ceil(est.pipeline_latency_ms / T) + 2  # chunks in flight before steady state
    sim = SimConfig(
        num_devices=est.shape.depth,
        chunks=fill + measured_chunks + 2,
        warmup_chunks=fill,
        cooldown_chunks=2,
        max_batch=max(8, est.shape.streams),
    )
    streams = [
        SimStream(
            plan=StreamPlan(
                stream_id=j,
                model=cfg,
                sampler=sampler,
                target_interval_ms=T,
                stage_devices=est.stage_devices,
            ),
            phase_ms=phase,
            latency_budget_ms=est.pipeline_latency_ms * (1 + PROMISE_TOLERANCE),
        )
        for j, phase in enumerate(est.phases_ms)
    ]
    report = simulate(streams, cost, sim)
    interval = max(s.interval_p50_ms for s in report.streams)
    latency = max(s.latency_p99_ms for s in report.streams)
    keeps = all(
        s.interval_p50_ms <= T * (1 + PROMISE_TOLERANCE) + REPORT_ROUNDING_MS
        and s.deadline_misses == 0
        and s.latency_promise_misses == 0
        for s in report.streams
    )
    return {
        "interval_p50_ms": interval,
        "pipeline_latency_p99_ms": latency,
        "response_latency_ms": round(interval + latency, 4),
        "keeps_promise": keeps,
    }


def place_published(front: list[Estimate], point: dict) -> dict:
    """Where a published (interval, devices per stream) point lies against the front."""
    within = [e for e in front if e.devices_per_stream <= point["devices_per_stream"] + 1e-9]
    best = min(within, key=lambda e: e.interval_ms, default=None)
    out = dict(point, devices_per_stream=round(point["devices_per_stream"], 4))
    if best is None:
        out.update(reached=False, why="no front point with so few devices per stream")
        return out
    out.update(
        reached=best.interval_ms <= point["interval_ms"],
        front_interval_ms=round(best.interval_ms, 4),
        front_response_latency_ms=round(best.response_latency_ms, 4),
        front_depth=best.shape.depth,
        front_devices_per_stream=round(best.devices_per_stream, 4),
        interval_ratio_front_to_published=round(best.interval_ms / point["interval_ms"], 3),
    )
    return out


def frontier(
    model: str | ModelConfig,
    devices: int,
    *,
    sampler: SamplerConfig | None = None,
    max_streams: int = 8,
    simulate_points: bool = True,
    device: DeviceSpec = H200,
) -> dict:
    """The front of ``model`` (a preset name, or its config with the chunk chosen: latent
    frames, resolution) on ``devices`` modelled H200s, with every point simulated and the
    published points placed. ``sampler``: K and W (default: those of pool24); ``device``: the
    modelled H200, or one fitted to a calibration."""
    sampler = sampler or POOL24_SAMPLER
    cfg = get_preset(model) if isinstance(model, str) else model
    cost = AnalyticCostModel(device)
    memory = MemoryModel(dtype_bytes=device.dtype_bytes, max_batch=max(8, max_streams))
    candidates = shapes(
        cost,
        cfg,
        sampler,
        devices=devices,
        usable_bytes=device.usable_bytes,
        memory=memory,
        max_streams=max_streams,
    )
    front = pareto(candidates)
    points = []
    for est in front:
        row = est.to_json(devices)
        if simulate_points:
            row["simulated"] = simulate_point(est, cost, cfg, sampler)
        points.append(row)
    published = [
        place_published(front, p)
        for p in PUBLISHED.get(cfg.name, [])
        if p["devices"] <= devices and p["chunk_latent_frames"] in (None, cfg.latent_frames)
    ]
    return {
        "experiment": "frontier",
        "model": cfg.name,
        "devices": devices,
        "latent_frames": cfg.latent_frames,
        "window": sampler.window,
        "steps": sampler.steps,
        "shapes_considered": len(candidates),
        "frontier": points,
        "all_points_keep_promise": all(
            p.get("simulated", {}).get("keeps_promise", True) for p in points
        ),
        "published": published,
        "assumptions": {
            **backbone_facts(cfg.name, sampler, device, cfg),
            "response_latency": "interval (an observation waits at most one slot) + pipeline "
            "latency (release to out: every stage and hop)",
            "depth": "devices a chunk passes through: the K*L stages in that many contiguous "
            "runs of nearly equal size",
            "width": "staggered: streams time-share a group's devices, each stream's slots one "
            "run's time after the previous one's (the server sets each stream's first slot); "
            "batched: streams on one device released in the same slot, each stage one batched "
            "forward; groups side by side on disjoint devices",
            "devices_per_stream": "depth / streams per group",
            "memory": f"every device of a group within {device.usable_bytes / 1024**3:.1f} GiB "
            "(weights of its blocks, KV and cross-attention K/V per stream, receive buffers, "
            f"workspace of {memory.max_batch} tasks)",
            "simulated": "one group, its streams paced at the point's interval with the "
            "planned slots; keeps_promise: median interval and every chunk's pipeline latency "
            "within the promise and no chunk late on its output clock",
            "memory_model": asdict(memory),
            **cost.assumptions(),
        },
    }
