"""The simulator against the real runtime on the local machine (CPU ranks over gloo).

``calibrate_on`` measures, on a live torch.distributed job, what the simulator needs beyond
the per-block times: the worker loop's cost per task and per batched forward and the
controller's cost per finished chunk (every stage on rank 0, with and without batching); with
two ranks or more, a hop's latency (ping-pong) and, by accounting every thread of rank 0
in two layouts on all the job's ranks (stages dealt round robin, whole steps dealt round
robin), the processor time its send and receive threads spend per message and what the
worker's own work costs beside the other ranks (a scale, and a cost per message).
``realcheck`` runs free-running ``tiny`` streams (every chunk queued at once, stages split
evenly over the ranks) for each (ranks, streams) case, calibrating each job in rounds
between its cases, and simulates the same cases with those calibrations and the host's core
count; it reports predicted, measured and relative error per case. ``calibrate_gloo``
(``tools.gloo_calibration``, ``physis-profile --runtime gloo``) is the same calibration on a
two-rank job, for profiles used elsewhere.

Other jobs on the host (other users' tests) take processor time the simulation does not have,
so calibration and every measured run record the other jobs' load while they ran, and only
quiet runs count (see ``realcheck``). And a shared host's speed is not steady: runs of the
same case back to back can differ nearly twofold with no other job on the host (a neighbour
under a VM, on the scale of tens of milliseconds to seconds), and a block-forward probe just
before or after a run does not predict it. So one run, or one calibration, is a sample of a
wide distribution, and a calibration done once before the cases compares different stretches
of time: each job calibrates itself in rounds between its runs, so that the calibrations and
the runs sample the same minutes, and several jobs run, because a job's processes keep how
the kernel placed them (within one job the calibrations and the runs err in the same
direction; a fresh job draws again).

Calibration layouts are ones no checked case uses, except that with one rank "every stage on
rank 0" is the one-rank case itself: that case repeats a calibration run; every other case is
a prediction. ``physis-sim --experiment realcheck`` prints the result as JSON.
"""

from __future__ import annotations

import itertools
import os
import statistics
import time
from dataclasses import asdict, dataclass, replace

import torch

from physis_ros.engine.build import build_model
from physis_ros.engine.config import SamplerConfig, get_preset
from physis_ros.engine.placement import layout_even
from physis_ros.engine.pool.costmodel import Profile, ProfileCostModel
from physis_ros.engine.pool.plan import StreamPlan
from physis_ros.engine.pool.simulator import SimConfig, SimStream, simulate
from physis_ros.engine.ranks.calibrate import (
    WARM_CHUNKS,
    ForeignLoad,
    K,
    W,
    WorkerSample,
    _all_tasks_cpu_ms,
    calibrate_on,
    fit_worker_costs,
    host_cores,
    mean_block_entries,
    run_free,
)
from physis_ros.engine.ranks.executor import ranks_engine
from physis_ros.engine.stage import BlockTimer
from physis_ros.tools.block_profile import measure
from physis_ros.tools.gloo_calibration import (
    QUIET_CORES,
    runtime_config,
    wait_for_quiet,
    warm_up,
)
from physis_ros.tools.profile_cli import build_parser

BATCHES = [1, 2, 3, 4, 6, 8, 12]
"""Batch sizes the checked cases form (up to 3 streams x 4 steps on one rank)."""


def intervals_ms(left_s: list[float], skip: int) -> list[float]:
    return [(b - a) * 1e3 for a, b in itertools.pairwise(left_s[skip:])]


def profile_gloo(
    model: str = "tiny",
    steps: int = K,
    window: int = W,
    repeats: int = 20,
    *,
    batches: str = "1,2,3,4,6,8,12",
    rounds: int = 3,
    gloo_repeats: int = 5,
):
    """A ``physis-profile --runtime gloo`` profile of this CPU (one torch thread per rank).
    The default batch sizes are every size the checked cases form (up to 3 streams x 4 steps
    on one rank), each the fastest of ``rounds`` round-robin medians."""
    torch.set_num_threads(1)
    argv = ["--model", model, "--steps", str(steps), "--window", str(window), "--runtime", "gloo"]
    argv += ["--batches", batches, "--repeats", str(repeats), "--rounds", str(rounds)]
    argv += ["--gloo-repeats", str(gloo_repeats)]
    return measure(build_parser().parse_args(argv))


POOLED = ("send_cpu_ms", "recv_cpu_ms", "hop_ms")
"""Calibrated message costs that ``pool_message_costs`` takes as the median over all
calibrations of one number of ranks (every round of every job)."""


def pool_message_costs(profiles: list, samples: list[list[WorkerSample]]) -> list:
    """The calibrations with their message costs replaced by the median over all of them and
    the worker's scale and cost per message by one fit over all their ``samples``
    (``fit_worker_costs``). Each is a ratio or a per-message time from runs of its own, so
    pooling them averages out one round's unlucky run (a rank work scale from one run can
    be far off); the block times and loop overheads stay per round, since the
    overheads were derived from that round's block times."""
    pooled = {key: statistics.median(getattr(p, key) for p in profiles) for key in POOLED}
    if any(samples):
        scale, per_message_ms = fit_worker_costs([s for s in samples if s])
        pooled.update(rank_work_scale=scale, worker_message_ms=per_message_ms)
    return [replace(p, **pooled) for p in profiles]


def simulate_free(
    profile,
    world: int,
    layouts: list,
    chunks: int,
    *,
    skip: int,
    cores: float,
    foreign: float = 0.0,
):
    """Mean interval per stream that the simulator predicts for ``run_free``."""
    cfg = get_preset(profile.model)
    sampler = SamplerConfig(steps=profile.steps, window=profile.window)
    streams = [
        SimStream(
            plan=StreamPlan(
                stream_id=i,
                model=cfg,
                sampler=sampler,
                target_interval_ms=0.0,
                stage_devices=tuple(r for row in lay for r in row),
            ),
            max_inflight=chunks,
        )
        for i, lay in enumerate(layouts)
    ]
    rep = simulate(
        streams,
        ProfileCostModel(profile),
        SimConfig(
            num_devices=world,
            chunks=chunks,
            warmup_chunks=skip,
            cooldown_chunks=0,
            max_batch=10_000,
            priority="engine",
            sink_device=0,
            host_cores=cores,
            foreign_load=foreign,
            # A rank's own work costs more processor time beside other ranks (calibrated).
            forward_scale=profile.rank_work_scale if world > 1 else 1.0,
            worker_message_ms=profile.worker_message_ms if world > 1 else 0.0,
        ),
    )
    return [s.interval_mean_ms for s in rep.streams]


def realcheck(
    ranks: tuple[int, ...] = (1, 2, 3, 4),
    streams: tuple[int, ...] = (1, 2, 3),
    *,
    model: str = "tiny",
    chunks: int = 120,
    skip: int = 8,
    jobs: int = 3,
    rounds: int = 5,
    runs_per_round: int = 2,
    profile=None,
    quiet_wait_s: float = 10.0,
    max_foreign_cores: float = QUIET_CORES,
) -> dict:
    """Calibrate and measure every case in interleaved rounds, then predict.

    Each number of ranks gets ``jobs`` jobs that calibrate themselves (``calibrate_on``: block
    times in this process, then the single-rank, ping-pong, strided and whole-step runs on the
    job's own ranks) and run every case ``runs_per_round`` times, in ``rounds`` rounds each
    (the module docstring says why). A case's prediction is the median of the predictions of
    the calibrations (``_compare``; message costs and the worker's scale and cost per message
    pooled, ``pool_message_costs``), its measured interval the median of its runs. A given
    ``profile`` is used instead of calibrating.

    Other jobs on the host take processor time the simulation does not have (a multi-rank
    case needs both cores), so every run's foreign load is measured while it runs (the
    host's busy time less our processes'); a run counts as quiet below ``max_foreign_cores``
    and is retried when it is not (up to 3 tries, each retry waiting up to ``quiet_wait_s``
    for a quiet host; no other run waits, see ``WARM_CHUNKS``). A case with no quiet run is
    measured on all of its runs and marked not quiet."""
    torch.set_num_threads(1)  # rank 0 lives in this process
    t_start = time.perf_counter()
    load_before = os.getloadavg()[0]
    cores = host_cores()
    block_model = build_model(get_preset(model), device="cpu")
    timers = {b: BlockTimer(block_model, [W] * b, window=W) for b in BATCHES}
    job = {
        "model": model,
        "chunks": chunks,
        "skip": skip,
        "max_foreign_cores": max_foreign_cores,
        "quiet_wait_s": quiet_wait_s,
        "timers": timers,
    }
    cases, profiles = [], {}
    for world in ranks:
        # (profile, other jobs' cores while it ran, worker samples); runs: per stream count
        calibrations: list = []
        runs: dict[int, list[tuple[float, float]]] = {n: [] for n in streams}
        calibrating = calibrations if profile is None else None
        for _ in range(jobs):
            GlooJob(world=world, calibrations=calibrating, runs=runs, **job).run(
                rounds, runs_per_round
            )
        job_profiles = [profile]
        if profile is None:
            job_profiles, profiles[world] = _pooled(calibrations, max_foreign_cores)
        for n, case_runs in runs.items():
            cases.append(
                _compare(
                    job_profiles,
                    world,
                    n,
                    case_runs,
                    chunks=chunks,
                    skip=skip,
                    cores=cores,
                    max_foreign_cores=max_foreign_cores,
                )
            )
    return {
        "experiment": "realcheck",
        "cases": cases,
        **_errors(cases),
        "host_cores": cores,
        "loadavg_1min_before_after": [round(load_before, 2), round(os.getloadavg()[0], 2)],
        "runtime_s": round(time.perf_counter() - t_start, 1),
        "profiles_by_ranks": profiles if profile is None else {"given": profile.to_json()},
        "method": _method(jobs, rounds, runs_per_round, chunks, skip, max_foreign_cores, cores),
    }


def _errors(cases: list[dict]) -> dict:
    worst = max(abs(c["error"]) for c in cases)
    return {
        "max_abs_error": worst,
        "within_15_percent": worst <= 0.15,
        "cases_without_a_quiet_run": [(c["ranks"], c["streams"]) for c in cases if not c["quiet"]],
        "max_abs_error_with_measured_load": max(abs(c["error_with_measured_load"]) for c in cases),
    }


def _pooled(calibrations: list, max_foreign_cores: float) -> tuple[list, dict]:
    """The calibrations of one number of ranks to predict with (the quiet ones, else all;
    ``pool_message_costs``), and their record for the report."""
    quiet = [c for c in calibrations if c[1] < max_foreign_cores]
    used = quiet or calibrations
    job_profiles = pool_message_costs([p for p, _, _ in used], [s for _, _, s in used])
    record = {
        "calibrations": [p.to_json() for p in job_profiles],
        "calibrations_quiet": len(quiet),
        "calibration_foreign_cores": [round(f, 2) for _, f, _ in calibrations],
        "worker_samples": [[asdict(x) for x in s] for _, _, s in calibrations],
    }
    return job_profiles, record


def _method(  # noqa: PLR0917 - the report's own settings, one sentence
    jobs: int,
    rounds: int,
    runs_per_round: int,
    chunks: int,
    skip: int,
    max_foreign_cores: float,
    cores: int,
) -> str:
    return (
        f"per number of ranks, {jobs} gloo jobs; {rounds} rounds in each, a calibration "
        "(block times: shape from a round-robin probe, level from the worker's forwards; "
        "all stages on rank 0 without and with batching; with 2+ ranks a ping-pong and "
        "two runs on all ranks, the stages and whole steps dealt round robin) then "
        f"{runs_per_round} runs of "
        "every case, each after an unmeasured warm-up: "
        f"free-running streams (all {chunks} chunks queued), stages split evenly over the "
        f"ranks (layout_even), mean interval after {skip} chunks; measured: the median "
        f"of the runs with other jobs below {max_foreign_cores} cores "
        "(measured during each run); prediction: the median over the calibrations of "
        "physis-sim with that calibration (message costs: medians over the "
        "calibrations; the worker's scale and cost per message: one fit over them), "
        "the worker's pick rule, processor sharing of "
        f"{cores} cores among busy ranks and message threads; '_with_measured_load': the "
        "same, with the other jobs' load (median over the case's runs, in processors) "
        "sharing those cores"
    )


@dataclass(kw_only=True)
class GlooJob:
    """One gloo job of ``world`` ranks in ``realcheck``: rounds of one calibration (unless
    ``calibrations`` is None) and ``runs_per_round`` runs of every case, appended to
    ``calibrations`` and ``runs``."""

    world: int
    model: str
    chunks: int
    skip: int
    max_foreign_cores: float
    quiet_wait_s: float
    timers: dict
    calibrations: list | None
    runs: dict[int, list[tuple[float, float]]]

    def run(self, rounds: int, runs_per_round: int) -> None:
        older = set(_all_tasks_cpu_ms())
        with ranks_engine(runtime_config(self.model), world_size=self.world) as engine:
            warm_up(engine)
            pids = [os.getpid()] + [proc.pid for proc in engine.executor.procs]
            for _ in range(rounds):
                if self.calibrations is not None:
                    last = self.calibrations[-1:]
                    if last and last[0][1] >= self.max_foreign_cores:
                        wait_for_quiet(self.quiet_wait_s)
                    self.calibrations.append(self.calibrate(engine, older))
                for n in [*self.runs] * runs_per_round:
                    self.runs[n].append(self._measure(engine, pids, n))

    def calibrate(self, engine, older: set[int]) -> tuple:
        """One calibration on ``engine`` (``calibrate_on``; ``older``: threads that existed
        before the job): (its profile, other jobs' cores meanwhile, the worker samples)."""
        costs, entries, foreign, samples = calibrate_on(
            engine, mean_block_entries(self.timers), chunks=self.chunks, older=older
        )
        profile = Profile(
            device="cpu x1 threads",
            model=self.model,
            steps=K,
            window=W,
            dtype="float32",
            entries=tuple(entries),
            **costs,
            comm_threads=True,
            host_cores=host_cores(),
            calibrated_on="gloo",
        )
        return profile, foreign, samples

    def _measure(self, engine, pids, n: int) -> tuple[float, float]:
        """Mean interval of ``n`` free-running streams and other jobs' load meanwhile; a run
        other jobs disturbed is retried (twice at most) after waiting for a quiet host."""
        layouts = [layout_even(K, engine.cfg.num_blocks, self.world)] * n
        for attempt in range(3):
            if attempt:
                wait_for_quiet(self.quiet_wait_s)
            run_free(engine, layouts, WARM_CHUNKS)
            meter = ForeignLoad(pids)
            lefts = run_free(engine, layouts, self.chunks)
            interval = statistics.mean(statistics.mean(intervals_ms(x, self.skip)) for x in lefts)
            foreign = meter.cores()
            if foreign < self.max_foreign_cores:
                break
        return interval, foreign


def _compare(
    profiles: list,
    world: int,
    n: int,
    case_runs,
    *,
    chunks: int,
    skip: int,
    cores: int,
    max_foreign_cores: float,
) -> dict:
    """One case's measured runs against the simulator's prediction: the median of the
    predictions of the calibrations for its number of ranks, each used whole (its loop
    overheads were derived from its own block times, so mixing numbers of different
    calibrations would not add up to any run's time)."""
    layouts = [layout_even(K, get_preset(profiles[0].model).num_blocks, world)] * n
    quiet = [m for m, f in case_runs if f < max_foreign_cores] or [m for m, _ in case_runs]
    foreign = statistics.median(f for _, f in case_runs)

    def predict(other_cores: float) -> list[float]:
        return [
            statistics.mean(
                simulate_free(
                    p, world, layouts, chunks, skip=skip, cores=cores, foreign=other_cores
                )
            )
            for p in profiles
        ]

    by_calibration = predict(0.0)
    pred = statistics.median(by_calibration)
    pred_load = statistics.median(predict(foreign))
    real = statistics.median(quiet)
    return {
        "ranks": world,
        "streams": n,
        "measured_interval_ms": round(real, 3),
        "quiet": any(f < max_foreign_cores for _, f in case_runs),
        "runs": [{"interval_ms": round(m, 3), "foreign_cores": round(f, 2)} for m, f in case_runs],
        "predicted_interval_ms": round(pred, 3),
        "predicted_by_calibration_ms": [round(v, 3) for v in by_calibration],
        "error": round(pred / real - 1, 4),
        "predicted_with_measured_load_ms": round(pred_load, 3),
        "error_with_measured_load": round(pred_load / real - 1, 4),
    }
