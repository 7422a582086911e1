"""Measuring a whole engine as it serves (what physis-serve does at start-up to plan and
promise): a burst of context + generated chunk pairs all queued at once, pairs sent one at a
time, the forwards an engine's worker ran meanwhile (block time by batch size as the engine
runs them), and a profile scaled to what the whole engine measured.
"""

from __future__ import annotations

import itertools
import statistics
import time
from dataclasses import replace

import numpy as np

from physis_ros.engine.api import StreamSpec
from physis_ros.engine.pool.costmodel import Profile, ProfileEntry


def _p99(values: list[float]) -> float:
    v = sorted(values)
    return v[min(len(v) - 1, int(0.99 * len(v)))]


def device_name(device) -> str:
    # torch only here: the rest of the pool package is pure Python and imports without it
    import torch

    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu x{torch.get_num_threads()} threads"


def _blank_inputs(engine):
    """(model config, frames, actions, state) of one blank observation for ``engine``."""
    cfg = engine.model_cfg if hasattr(engine, "model_cfg") else engine.cfg
    frames = np.zeros((cfg.frames_per_chunk, *cfg.image_size, 3), np.uint8)
    actions = None
    if cfg.action_mode != "none":
        actions = np.zeros((cfg.action_horizon, cfg.action_dim), np.float32)
    state = np.zeros((cfg.frames_per_chunk, cfg.state_dim), np.float32) if cfg.state_dim else None
    return cfg, frames, actions, state


def run_burst(engine, layout, *, pairs: int, skip: int, timeout_s: float = 120.0) -> float:
    """Mean interval (ms) of ``pairs`` generated chunks, each behind a context chunk, all
    queued at once on a stream of ``layout`` of ``engine`` (a ``StreamEngine`` whose
    ``open_stream`` takes a layout): the whole engine as it serves (worker threads or ranks,
    transport, controller, decoding), free running. Intervals after the first ``skip``."""
    cfg, frames, actions, state = _blank_inputs(engine)
    sid = engine.open_stream(StreamSpec(seed=0), layout=layout).stream_id
    try:
        for _ in range(pairs):
            engine.submit_context(sid, frames, actions, state)
            engine.submit_generate(sid, actions if cfg.action_mode == "condition" else None)
        left: list[float] = []
        deadline = time.monotonic() + timeout_s
        while len(left) < pairs:
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"calibration burst: {len(left)} of {pairs} chunks in {timeout_s} s"
                )
            left += [out.left_s for out in engine.poll(0.5) if out.stream_id == sid]
    finally:
        engine.close_stream(sid)
    gaps = [(b - a) * 1e3 for a, b in itertools.pairwise(left[skip:])]
    return statistics.mean(gaps)


def scaled_profile(profile: Profile, scale: float) -> Profile:
    """``profile`` with every worker-time number (block forwards, loop overheads, controller
    work per chunk) multiplied by ``scale``: what the whole engine measured relative to what
    the profile's parts predicted."""
    return replace(
        profile,
        entries=tuple(
            replace(e, ms_p50=e.ms_p50 * scale, ms_p99=e.ms_p99 * scale) for e in profile.entries
        ),
        task_overhead_ms=profile.task_overhead_ms * scale,
        batch_overhead_ms=profile.batch_overhead_ms * scale,
        chunk_overhead_ms=profile.chunk_overhead_ms * scale,
    )


def run_sequential(engine, layout, *, pairs: int, timeout_s: float = 120.0) -> list[float]:
    """Latency (ms, entered to left) of ``pairs`` context + generated chunk pairs sent one at
    a time (each after the previous one's chunk came back): the pipeline with no batching
    across pairs."""
    cfg, frames, actions, state = _blank_inputs(engine)
    sid = engine.open_stream(StreamSpec(seed=1), layout=layout).stream_id
    latencies = []
    try:
        for _ in range(pairs):
            engine.submit_context(sid, frames, actions, state)
            engine.submit_generate(sid, actions if cfg.action_mode == "condition" else None)
            deadline = time.monotonic() + timeout_s
            got = []
            while not got:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"calibration pair not back in {timeout_s} s")
                got = [o for o in engine.poll(0.5) if o.stream_id == sid]
            latencies.append((got[0].left_s - got[0].entered_s) * 1e3)
    finally:
        engine.close_stream(sid)
    return latencies


def recorded_forwards(worker, run) -> tuple[list[tuple[int, float]], float]:
    """(batch size, wall ms) of every forward ``worker`` (an engine ``Worker``) ran while
    ``run()`` drove its engine, and the wall time (ms) ``run()`` took."""
    worker.record_block_times()
    try:
        t0 = time.perf_counter()
        run()
        wall_ms = (time.perf_counter() - t0) * 1e3
        forwards = [(size, ms) for _, size, _, ms in worker.stats.block_times]
    finally:
        worker.record_block_times(False)
    return forwards, wall_ms


def entries_from_forwards(forwards: list[tuple[int, float]]) -> tuple[ProfileEntry, ...]:
    """Block time by batch size as an engine ran them (every block, edges included)."""
    by_size: dict[int, list[float]] = {}
    for size, ms in forwards:
        by_size.setdefault(size, []).append(ms)
    return tuple(
        ProfileEntry(tasks=b, ms_p50=statistics.median(v), ms_p99=_p99(v))
        for b, v in sorted(by_size.items())
    )
