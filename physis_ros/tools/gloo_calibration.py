"""The gloo calibration of ``physis-profile --runtime gloo``: what the simulator needs beyond
the per-block times, measured on a live two-rank torch.distributed job on the local CPU
(``serve.dist.calibrate.calibrate_on``, repeated and counted only while other jobs leave the
host quiet). ``tools.experiments.realcheck`` calibrates its jobs with the same pieces.
"""

from __future__ import annotations

import statistics
import time

from physis_ros.engine.placement import layout_even
from physis_ros.engine.ranks.calibrate import (
    K,
    W,
    _all_tasks_cpu_ms,
    _cpu_times,
    calibrate_on,
    fit_worker_costs,
    run_free,
    scaled_entries,
)
from physis_ros.engine.ranks.config import RuntimeConfig
from physis_ros.engine.ranks.executor import ranks_engine

QUIET_CORES = 0.1
"""A run counts as quiet when other jobs used fewer processors than this while it ran."""


def host_busy(window_s: float = 0.3) -> float:
    """Fraction of all processors busy over ``window_s`` (ours idle: other jobs' load)."""
    b0, t0 = _cpu_times()
    time.sleep(window_s)
    b1, t1 = _cpu_times()
    return (b1 - b0) / max(t1 - t0, 1)


def wait_for_quiet(max_wait_s: float, below: float = 0.15) -> float:
    """Wait (up to ``max_wait_s``) until other jobs leave the host nearly idle; returns the
    last busy fraction seen. A quiet host returns at once."""
    deadline = time.monotonic() + max_wait_s
    busy = host_busy()
    while busy > below and time.monotonic() < deadline:
        busy = host_busy()
    return busy


def runtime_config(model: str = "tiny", steps: int = K, window: int = W) -> RuntimeConfig:
    """A CPU job of gloo ranks, stages split evenly, with timeouts for a loaded host."""
    return RuntimeConfig(
        model=model,
        steps=steps,
        window=window,
        device="cpu",
        placement="even",
        heartbeat_interval_s=0.2,
        fault_timeout_s=5.0,
        comm_timeout_s=60.0,
        startup_timeout_s=60.0,
    )


def calibrate_gloo(
    model: str, steps: int, window: int, entries, *, chunks: int = 120, repeats: int = 5
) -> tuple[dict, list]:
    """Worker-loop, controller and message costs of a two-rank gloo job on the local host, and
    the probed block times ``entries`` at the level the worker's forwards ran at: the
    medians of ``repeats`` calibrations (``calibrate_on``; the worker's scale and cost per
    message fitted over all of them), counting only those during which other jobs used
    under ``QUIET_CORES`` (up to ``3 * repeats`` tries; all of them when none was quiet)."""
    older = set(_all_tasks_cpu_ms())
    quiet, noisy = [], []
    with ranks_engine(runtime_config(model, steps, window), world_size=2) as engine:
        warm_up(engine)
        while len(quiet) < repeats and len(quiet) + len(noisy) < 3 * repeats:
            if noisy:
                wait_for_quiet(5.0)
            costs, scaled, foreign, samples = calibrate_on(
                engine, entries, chunks=chunks, older=older
            )
            (quiet if foreign < QUIET_CORES else noisy).append((costs, scaled, samples))
    runs = quiet or noisy
    medians = {key: statistics.median(c[key] for c, _, _ in runs) for key in runs[0][0]}
    scale, per_message_ms = fit_worker_costs([samples for _, _, samples in runs])
    medians.update(rank_work_scale=scale, worker_message_ms=per_message_ms)
    level = statistics.median(e[0].ms_p50 for _, e, _ in runs) / entries[0].ms_p50
    return medians, scaled_entries(entries, level)


def warm_up(engine) -> None:
    """A few chunks through every rank and the transport's threads (first-use costs)."""
    K_, L = engine.sampler.steps, engine.cfg.num_blocks
    run_free(engine, [layout_even(K_, L, engine.executor.world_size)], 8)
    if engine.executor.world_size > 1:
        engine.executor.measure_hop_ms(rounds=5, warmup=5)
