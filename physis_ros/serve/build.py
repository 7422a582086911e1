"""Building what physis-serve serves from a resolved ``ServingSpec``: the cost model (measured at
start-up or read from a physis-profile file), the pool's memory, the placement planned for the
default target (or given by hand and checked), and the engine with the pool in front of it.

``build_local`` is the single-process server (worker threads on one device);
``physis_ros.serve.torchrun_main`` builds the torchrun one with the helpers here.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass
from typing import Any

import torch

from physis_ros.cli_errors import UsageError
from physis_ros.engine.config import ModelConfig, SamplerConfig
from physis_ros.engine.core import EngineCore
from physis_ros.engine.placement import layout_balanced, layout_single, stage_costs
from physis_ros.engine.pool.costmodel import GIB, CostModel, Profile, ProfileCostModel
from physis_ros.engine.pool.footprint import available_bytes
from physis_ros.engine.pool.gate import plan_layout
from physis_ros.engine.pool.measure import (
    device_name,
    entries_from_forwards,
    recorded_forwards,
    run_burst,
    run_sequential,
    scaled_profile,
)
from physis_ros.engine.pool.memory import MemoryModel
from physis_ros.engine.pool.planning import DefaultPlan, PoolSimulation, plan_default_target
from physis_ros.engine.pool.service import PoolAdmission
from physis_ros.engine.pool.simulator import SimStream, simulate
from physis_ros.engine.pool.terms import PoolConfig, StreamRequest
from physis_ros.engine.ranks.config import parse_placement
from physis_ros.engine.stage import measure_block_ms
from physis_ros.engine.threads import local_engine
from physis_ros.serve.frontend_config import ServerDescription
from physis_ros.serve.spec import ServingSpec

log = logging.getLogger("physis-serve")

HOST_MEMORY_SHARE = 0.8
"""Share of the host's available memory that CPU workers may plan with (the rest: the OS,
the server's buffers, other processes)."""
DEVICE_MEMORY_SHARE = 0.9
"""Share of a GPU's free memory that its workers may plan with (allocator slack)."""
TIE = 0.03
"""Planning prefers fewer workers unless more of them shorten the interval by more than this."""
BURST_PAIRS = 24
"""Context + generated chunk pairs in the start-up burst that measures the whole engine."""
SCALE_BOUNDS = (0.1, 10.0)
"""Measured over predicted burst beyond these is measured again, and warned about."""
BURST_SKIP = 6
"""Pairs of the burst not measured (the pipeline filling)."""


@dataclass(frozen=True)
class Pool:
    """What the pool in front of an engine needs, and what was planned."""

    config: PoolConfig
    cost: CostModel
    simulation: PoolSimulation
    request: StreamRequest
    """One stream of the served model (its target is the default target)."""
    stage_devices: tuple[int, ...] | None
    """The placement given by hand, if any."""
    default: DefaultPlan


def torch_device(spec: ServingSpec) -> torch.device:
    if spec.device == "cpu" or (spec.device == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise UsageError(
            f"device {spec.device!r} asked for: no usable CUDA device (CUDA is not available)",
            "use device cpu, or auto",
        )
    return torch.device("cuda", torch.cuda.current_device())


def usable_bytes(spec: ServingSpec, device: torch.device, workers_sharing: int) -> float:
    """Memory each worker may plan with: ``memory_gib``, or a share of what is free now
    (the device's, or the host's for CPU workers) split over the workers sharing it."""
    if spec.memory_gib:
        return spec.memory_gib * GIB
    share = DEVICE_MEMORY_SHARE if device.type == "cuda" else HOST_MEMORY_SHARE
    return share * available_bytes(device) / workers_sharing


def memory_model(spec: ServingSpec) -> MemoryModel:
    """The pool's memory model for the spec's dtype."""
    return MemoryModel(dtype_bytes=4 if spec.dtype == "float32" else 2)


def load_profile(spec: ServingSpec, cfg: ModelConfig, sampler: SamplerConfig) -> Profile | None:
    """The spec's physis-profile file, checked to be of this model, K and W (None: none)."""
    if not spec.profile:
        return None
    try:
        profile = Profile.load(spec.profile)
    except (OSError, ValueError) as err:
        raise ValueError(f"profile {spec.profile}: {err}") from None
    if (profile.model, profile.steps, profile.window) != (cfg.name, sampler.steps, sampler.window):
        raise ValueError(
            f"profile {spec.profile} is of model {profile.model} K={profile.steps} "
            f"W={profile.window}; this server runs {cfg.name} K={sampler.steps} W={sampler.window}"
        )
    return profile


def hand_layout(spec: ServingSpec, workers: int, block_ms: list[float] | None = None):
    """The placement given by hand over ``workers`` workers, as stage -> worker."""
    cfg, sampler = spec.model_config, spec.sampler()
    K, L = sampler.steps, cfg.num_blocks
    if spec.plan == "balanced" and block_ms is not None:
        layout = layout_balanced(K, L, workers, stage_costs(K, block_ms))
    else:
        layout = parse_placement(spec.plan, K, L, workers)
    return tuple(r for row in layout for r in row)


def hand_workers(spec: ServingSpec, default: int) -> int:
    """Workers a hand-written placement runs on (``workers`` when the spec gives them)."""
    K, L = spec.sampler().steps, spec.model_config.num_blocks
    if spec.plan == "single":
        return spec.workers or 1
    if spec.plan == "one-stage":
        return K * L
    if spec.plan.startswith("groups:"):
        return len(spec.plan.split(":", 1)[1].split(","))
    return spec.workers or default


def plan_pool(
    spec: ServingSpec,
    cost: CostModel,
    simulation: PoolSimulation,
    *,
    workers: int,
    usable: float,
    stage_devices: tuple[int, ...] | None = None,
) -> Pool:
    """The pool of ``workers`` workers with ``usable`` bytes each, and its default plan (the
    fastest target it can promise one stream; ``stage_devices``: the placement by hand)."""
    cfg, sampler = spec.model_config, spec.sampler()
    request = StreamRequest(
        model=cfg,
        sampler=sampler,
        target_interval_ms=1.0,  # replaced by the targets searched
        chunks_per_interval=2 if spec.context_chunks else 1,
    )
    config = PoolConfig(
        num_devices=workers,
        usable_bytes=usable,
        policy=spec.policy,
        max_utilization=spec.max_utilization,
        memory=memory_model(spec),
        # A pipelined stream's worker runs a block's stages of several steps together; the
        # simulator confirms every admission with the batches it really gets.
        charged_batch=sampler.steps if spec.batching and spec.mode == "pipelined" else 1,
    )
    default = plan_default_target(config, cost, simulation, request, stage_devices=stage_devices)
    return Pool(config, cost, simulation, request, stage_devices, default)


def check_default_target(spec: ServingSpec, pool: Pool) -> None:
    """A default target given by hand must be one the pool can promise a stream."""
    fastest_ms = pool.default.target_interval_ms
    if spec.default_target_ms and spec.default_target_ms < fastest_ms:
        raise ValueError(
            f"default_target_ms {spec.default_target_ms} is faster than the pool can promise "
            f"one stream of {spec.model_config.name}: {pool.default.describe()}"
        )


def as_served(engine: EngineCore, pool: Pool, spec: ServingSpec) -> EngineCore:
    """``engine`` as physis-serve serves it: the pool in it (from now on it admits, places
    and promises), a world-action model's contract as the spec resolved it."""
    engine.contract = spec.contract()
    default_ms = spec.default_target_ms or pool.default.target_interval_ms
    engine.admission = PoolAdmission(
        pool.config,
        pool.cost,
        pool.simulation,
        model=spec.model_config,
        sampler=spec.sampler(),
        default_target_ms=default_ms,
        chunks_per_interval=pool.request.chunks_per_interval,
        stage_devices=pool.stage_devices,
        recalibrate=spec.recalibrate,
    )
    return engine


def build_local(spec: ServingSpec) -> tuple[EngineCore, ServerDescription]:
    """The single-process server's engine: worker threads on one device, planned (or given by
    hand), with the pool in front."""
    cfg, sampler = spec.model_config, spec.sampler()
    device = torch_device(spec)
    cores = len(os.sched_getaffinity(0))
    most = 1 if device.type == "cuda" else min(cores, sampler.steps * cfg.num_blocks)
    if spec.plan != "auto":
        candidates = [hand_workers(spec, most)]
    elif spec.workers:
        candidates = [spec.workers]
    else:  # 1, 2, 4, ... and all of them
        candidates = sorted({2**i for i in range(most.bit_length()) if 2**i <= most} | {most})
    engine = local_engine(
        # a directory loads its own weights; otherwise the resolved config and weights file
        spec.model if spec.model_directory else cfg,
        steps=sampler.steps,
        window=sampler.window,
        shift=sampler.shift,
        context_noise=sampler.context_noise,
        horizon=spec.horizon,
        mode=spec.mode,
        workers=max(candidates),
        batching=spec.batching,
        max_streams=spec.max_streams,
        device=str(device),
        dtype=spec.dtype,
        seed=spec.seed,
        checkpoint=spec.weights or None,
        prompts=spec.prompts,
        latent_frames=spec.latent_frames,
        resolution=spec.resolution,
        vae=spec.vae,
        variant=spec.variant,
    )
    try:
        profile = load_profile(spec, cfg, sampler)
        measured: dict[int, float] = {}  # workers -> burst ms per chunk, measured
        if profile is None:
            log.info("measuring %s on the engine (%s)", cfg.name, device)
            profile, measured[1] = engine_profile(engine, spec, device)
        block_ms = None
        if spec.plan == "balanced":
            block_ms = [
                measure_block_ms(engine.model, [sampler.window], block=b, repeats=5, warmup=2)
                for b in range(cfg.num_blocks)
            ]
        hand = (
            {w: hand_layout(spec, w, block_ms) for w in candidates} if spec.plan != "auto" else None
        )
        simulation = PoolSimulation(
            host_cores=cores if device.type == "cpu" else 0.0, batching=spec.batching
        )
        pools = {}
        for workers in candidates:
            pool = plan_pool(
                spec,
                ProfileCostModel(profile),
                simulation,
                workers=workers,
                usable=usable_bytes(spec, device, workers),
                stage_devices=hand[workers] if hand else None,
            )
            if not spec.profile and (workers > 1 or pool.stage_devices):
                pool, measured[workers] = shared_processors(engine, pool, spec)
            pools[workers] = pool
        pool = fastest(pools, measured)
        check_default_target(spec, pool)
    except BaseException:
        engine.shutdown()
        raise
    log.info("planned %s", pool.default.describe())
    served = as_served(engine, pool, spec)
    return served, describe(spec, served, pool, kind="threads")


def describe(spec: ServingSpec, served: EngineCore, pool: Pool, *, kind: str):
    cfg = spec.model_config

    def engine_info() -> dict[str, Any]:
        names = ",".join(served.prompts.names())
        return {"kind": kind, "mode": spec.mode, "prompts": names, **served.admission.info()}

    plan = pool.default
    return ServerDescription(
        model=cfg.name,
        steps=spec.sampler().steps,
        blocks=cfg.num_blocks,
        placement=(
            ("planned" if spec.plan == "auto" else f"by hand ({spec.plan})")
            + f": {plan.describe()}; policy {spec.policy}"
        ),
        action_mode=cfg.action_mode,
        horizon=spec.horizon or 0,
        engine_info=engine_info,
        # a causal codec decodes each slot once, in order: no slot can be generated again
        rollouts=not served.codec.causal,
    )


def fastest(pools: dict[int, Pool], measured: dict[int, float]) -> Pool:
    """The pool to serve with: the worker count whose burst ran fastest when measured (else
    whose default target is shortest); fewer workers unless more are faster by ``TIE``."""
    counts = sorted(pools)
    if all(w in measured for w in counts):

        def speed(w: int) -> float:
            return measured[w]
    else:

        def speed(w: int) -> float:
            return pools[w].default.target_interval_ms

    best = counts[0]
    for w in counts[1:]:
        if speed(w) < (1 - TIE) * speed(best):
            best = w
    return pools[best]


def engine_profile(engine, spec: ServingSpec, device) -> tuple[Profile, float]:
    """A ``Profile`` of the engine's first worker measured on the engine itself, every stage
    on it: block time by batch size from the forwards it ran (pairs sent one at a time, then a
    free-running burst), and the rest of the burst's wall time per task (worker loop,
    controller, codec) as the task overhead. Returns it and the burst's ms per chunk."""
    sampler, L = spec.sampler(), spec.model_config.num_blocks
    layout = layout_single(sampler.steps, L)
    worker = engine.executor.workers[0]
    run_burst(engine, layout, pairs=8, skip=2)  # first-use costs, caches
    alone, _ = recorded_forwards(worker, lambda: run_sequential(engine, layout, pairs=6))
    bursts: list[float] = []
    burst, wall_ms = recorded_forwards(
        worker,
        lambda: bursts.append(run_burst(engine, layout, pairs=BURST_PAIRS, skip=BURST_SKIP)),
    )
    tasks = sum(size for size, _ in burst)
    overhead_ms = max(wall_ms - sum(ms for _, ms in burst), 0.0) / max(tasks, 1)
    profile = Profile(
        device=device_name(device),
        model=spec.model_config.name,
        steps=sampler.steps,
        window=sampler.window,
        dtype=spec.dtype,
        entries=entries_from_forwards(alone + burst),
        hop_ms=0.0,
        task_overhead_ms=overhead_ms,
        host_cores=len(os.sched_getaffinity(0)) if device.type == "cpu" else 0,
        calibrated_on="inproc engine",
    )
    log.info(
        "1 worker: block %.2f ms alone, %.2f ms per task batched by %d; %.2f ms per task "
        "beside; a burst ran %.2f ms per chunk",
        profile.entries[0].ms_p50,
        profile.entries[-1].ms_p50 / profile.entries[-1].tasks,
        profile.entries[-1].tasks,
        overhead_ms,
        bursts[0],
    )
    return profile, bursts[0]


def shared_processors(engine, pool: Pool, spec: ServingSpec) -> tuple[Pool, float]:
    """``pool`` planned again with the processors its workers effectively have between them
    (the simulation's ``host_cores``: threads of one interpreter share it, so a small model's
    workers run nearly one at a time), found so that the simulated burst on its default
    placement matches the one the engine runs; and that measured burst (ms per chunk)."""
    measured = burst_ms(engine, pool)
    simulation, cost = pool.simulation, pool.cost
    if simulation.host_cores:
        lo, hi = 1.0, float(simulation.host_cores)

        def predicted(cores: float) -> float:
            return burst_ms(None, pool, cost, dataclasses.replace(simulation, host_cores=cores))

        for _ in range(8):  # predicted(cores) falls as cores grow
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if predicted(mid) > measured else (lo, mid)
        simulation = dataclasses.replace(simulation, host_cores=round(lo, 3))
    log.info(
        "%d workers: a burst ran %.2f ms per chunk: they share %.2f processors",
        pool.config.num_devices,
        measured,
        simulation.host_cores,
    )
    repl = plan_pool(
        spec,
        cost,
        simulation,
        workers=pool.config.num_devices,
        usable=pool.config.usable_bytes,
        stage_devices=pool.stage_devices,
    )
    return repl, measured


def burst_scaled(engine, pool: Pool, spec: ServingSpec, profile: Profile) -> Pool:
    """``pool`` planned again with the profile's costs scaled so that the simulator predicts
    the burst the whole engine measures on the pool's default placement."""
    predicted = burst_ms(None, pool)
    measured = burst_ms(engine, pool)
    lo, hi = SCALE_BOUNDS
    if not lo <= measured / predicted <= hi:
        # Far from the profile: a busy host (other jobs took the cores during one of the two
        # measurements) more often than a broken profile. Measured again; what the engine then
        # does is what admission plans with, never a scale it did not measure.
        log.warning(
            "engine burst %.2f ms per chunk against %.2f ms from the profile: measuring again",
            measured,
            predicted,
        )
        measured = burst_ms(engine, pool)
    scale = measured / predicted
    if not lo <= scale <= hi:
        log.warning(
            "engine burst still %.2f ms per chunk against %.2f ms from the profile (x %.2f): "
            "promises follow the burst; if this host was idle, the profile is off (give "
            "placement.profile, a physis-profile JSON)",
            measured,
            predicted,
            scale,
        )
    log.info(
        "%d worker(s): engine burst %.2f ms per chunk measured, %.2f ms predicted from the "
        "profile: costs x %.2f",
        pool.config.num_devices,
        measured,
        predicted,
        scale,
    )
    return plan_pool(
        spec,
        ProfileCostModel(scaled_profile(profile, scale)),
        pool.simulation,
        workers=pool.config.num_devices,
        usable=pool.config.usable_bytes,
        stage_devices=pool.stage_devices,
    )


def burst_ms(
    engine, pool: Pool, cost: CostModel | None = None, simulation: PoolSimulation | None = None
) -> float:
    """Mean interval of a burst of ``BURST_PAIRS`` context + generated chunk pairs, free
    running on the pool's default placement: measured on ``engine``, or (engine None)
    simulated with ``cost`` and ``simulation`` (default: the pool's)."""
    plan = pool.default.plan
    if engine is not None:
        layout = plan_layout(plan)
        if hasattr(engine, "load_blocks"):  # ranks load the weights it needs
            engine.load_blocks(layout)
        run_burst(engine, layout, pairs=8, skip=2)  # first-use costs, caches
        # the faster of two: other jobs on the host only ever add time
        return min(run_burst(engine, layout, pairs=BURST_PAIRS, skip=BURST_SKIP) for _ in "ab")
    simulation = simulation or pool.simulation
    config = dataclasses.replace(
        simulation.config(pool.config.num_devices),
        chunks=BURST_PAIRS,
        warmup_chunks=BURST_SKIP,
        cooldown_chunks=0,
    )
    burst = dataclasses.replace(plan, target_interval_ms=1e-3)  # every pair queued at once
    report = simulate([SimStream(plan=burst, context_chunks=True)], cost or pool.cost, config)
    return report.streams[0].interval_mean_ms
