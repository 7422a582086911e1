"""What a pool simulation measured: per stream intervals, latency and misses, per device
utilization, batch size and memory (``SimReport``), built from the times of every chunk."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from physis_ros.engine.pool.memory import MemoryModel
from physis_ros.engine.pool.simconfig import SimConfig, SimStream


@dataclass(frozen=True, kw_only=True)
class StreamReport:
    stream_id: int
    model: str
    target_interval_ms: float
    interval_p50_ms: float
    interval_p99_ms: float
    interval_mean_ms: float
    latency_p50_ms: float
    """Release (observation in) -> chunk out; with T = 0, first stage start -> out."""
    latency_p99_ms: float
    deadline_misses: int
    """Chunks out later than their slot on the output clock (+ jitter tolerance)."""
    latency_promise_misses: int
    """Chunks out later than release + the promised response latency."""
    chunks_measured: int
    meets_target: bool


@dataclass(frozen=True, kw_only=True)
class DeviceReport:
    device: int
    utilization: float
    """Busy fraction over the measured window."""
    mean_batch: float
    memory: dict


@dataclass(frozen=True, kw_only=True)
class SimReport:
    streams: tuple[StreamReport, ...]
    devices: tuple[DeviceReport, ...]
    window_ms: float
    tasks: int

    @property
    def all_meet_target(self) -> bool:
        return all(s.meets_target for s in self.streams)

    def to_json(self) -> dict:
        return {
            "all_meet_target": self.all_meet_target,
            "window_ms": round(self.window_ms, 3),
            "tasks": self.tasks,
            "streams": [asdict(s) for s in self.streams],
            "devices": [asdict(d) for d in self.devices],
        }


def _pct(values: list[float], q: float) -> float:
    if not values:
        return math.nan
    v = sorted(values)
    return v[min(len(v) - 1, max(0, math.ceil(q * len(v)) - 1))]


def build_report(
    streams: list[SimStream],
    config: SimConfig,
    memory: MemoryModel | None,
    *,
    release: list[list[float]],
    start: list[list[float]],
    done: list[list[float]],
    busy_spans: list[list[tuple[float, float]]],
    batches: list[list[int]],
    tasks_run: int,
) -> SimReport:
    """The report of a run from, per stream, each generated chunk's release, first-stage start
    and finish times (ms), and per device its busy spans and (groups, tasks) run."""
    stream_reports = tuple(
        _stream_report(s, config, release=release[si], start=start[si], done=done[si])
        for si, s in enumerate(streams)
    )
    t0, t1 = _utilization_window(config, release, done)
    window = max(t1 - t0, 1e-9)
    plans = [s.plan for s in streams]
    device_reports = []
    for d in range(config.num_devices):
        busy = sum(max(0.0, min(b, t1) - max(a, t0)) for a, b in busy_spans[d])
        groups, tasks = batches[d]
        mem = memory.device_usage(plans, d).gib() if memory is not None else {}
        device_reports.append(
            DeviceReport(
                device=d,
                utilization=round(busy / window, 4),
                mean_batch=round(tasks / groups, 3) if groups else 0.0,
                memory=mem,
            )
        )
    return SimReport(
        streams=stream_reports,
        devices=tuple(device_reports),
        window_ms=window,
        tasks=tasks_run,
    )


def _stream_report(
    s: SimStream,
    config: SimConfig,
    *,
    release: list[float],
    start: list[float],
    done: list[float],
) -> StreamReport:
    W, C = config.warmup_chunks, config.chunks - config.cooldown_chunks
    plan = s.plan
    T = plan.target_interval_ms
    out = done
    if any(math.isnan(x) for x in out):
        raise RuntimeError(f"internal: stream {plan.stream_id} did not finish every chunk")
    intervals = [out[c] - out[c - 1] for c in range(W + 1, C)]
    ref = release if T > 0 else start
    lat = [out[c] - ref[c] for c in range(W, C)]
    budget = s.latency_budget_ms * (1 + 1e-9)  # a promise met to float round-off is met
    promise_misses = sum(1 for c in range(W, C) if out[c] - release[c] > budget)
    misses = 0
    if T > 0:
        # Output clock anchored at the earliest slot the stream ever reached (a consumer
        # that starts playing as soon as it can and then plays one chunk per T).
        anchor = min(out[c] - c * T for c in range(W, C))
        slack = config.jitter_tolerance * T
        misses = sum(1 for c in range(W, C) if out[c] > anchor + c * T + slack)
    p50 = _pct(intervals, 0.5)
    meets = T == 0 or (p50 <= T * (1 + config.interval_tolerance) and misses == 0)
    return StreamReport(
        stream_id=plan.stream_id,
        model=plan.model.name,
        target_interval_ms=T,
        interval_p50_ms=round(p50, 4),
        interval_p99_ms=round(_pct(intervals, 0.99), 4),
        interval_mean_ms=round(sum(intervals) / len(intervals), 4),
        latency_p50_ms=round(_pct(lat, 0.5), 4),
        latency_p99_ms=round(_pct(lat, 0.99), 4),
        deadline_misses=misses,
        latency_promise_misses=promise_misses,
        chunks_measured=C - W,
        meets_target=meets,
    )


def _utilization_window(
    config: SimConfig, release: list[list[float]], done: list[list[float]]
) -> tuple[float, float]:
    """Every stream past warm-up, and no stream's source exhausted yet (after the last
    release, upstream devices drain and would read as idle)."""
    W, C = config.warmup_chunks, config.chunks - config.cooldown_chunks
    n = len(done)
    t0 = max(done[si][W] for si in range(n))
    last_release = min(release[si][-1] for si in range(n))
    t1 = min(max(done[si][C - 1] for si in range(n)), last_release)
    if t1 <= t0:  # too few chunks for such a window: fall back to the measured span
        t0 = min(done[si][W] for si in range(n))
        t1 = max(done[si][C - 1] for si in range(n))
    return t0, t1
