"""A latency budget on the real runtime (CPU ranks over gloo): admitted, placed shallower, and
measured against its promise.

Two gloo ranks on the local host, the controller on rank 0: every chunk enters and leaves the
pipeline there. On these ranks a message costs a fraction of a millisecond of the sender's
and the receiver's processor time and the ranks batch the tasks of different streams, so what
a chunk's path costs is its hops, not queueing: a stream on rank 0 alone passes one rank, a
stream on rank 1 passes rank 0 -> rank 1 -> rank 0 (two hops).

Stream A took rank 0 and stream B rank 1 (B did not fit next to A), then A left: rank 0 is
free and rank 1 has room. Stream C without a budget is packed into the spare compute of the
rank in use, rank 1, beside B (the shared policy fills used devices first); with a budget
between that placement's predicted response latency and rank 0's, admission puts C on rank 0
alone: a shorter path, one rank instead of two. The shares are the first on a grid that give
these placements and at least ``MIN_GAIN`` between the two promises (``_shares``).

Admission predicts with the pool simulator calibrated on this job the way ``realcheck`` does
(block times, loop, controller and message costs, the worker's extra time beside other ranks,
processor sharing of the host's cores: ``AdmissionController(simulated=...)``): the promise
is the median over the job's calibrations. Then B and C run on the ranks, each paced at its
target interval, and C's measured interval, pipeline latency (chunk in to chunk out) and
response latency (their sum) are compared with the promise; the same for C placed without a
budget, to show what the budget bought. ``physis-sim --experiment latencycheck`` prints the
JSON; the opt-in test is in test/pool/test_pool_real.py.
"""

from __future__ import annotations

import itertools
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from physis_ros.engine.api import AdmissionRefused, StreamSpec
from physis_ros.engine.build import build_model
from physis_ros.engine.config import ModelConfig, SamplerConfig, get_preset
from physis_ros.engine.core import EngineCore
from physis_ros.engine.pool.admission import AdmissionController
from physis_ros.engine.pool.costmodel import GIB, ProfileCostModel
from physis_ros.engine.pool.gate import AdmittedEngine
from physis_ros.engine.pool.memory import MemoryModel
from physis_ros.engine.pool.simulator import SimConfig, SimStream, simulate
from physis_ros.engine.pool.terms import PoolConfig, StreamRequest
from physis_ros.engine.ranks.calibrate import (
    WARM_CHUNKS,
    ForeignLoad,
    K,
    W,
    _all_tasks_cpu_ms,
    host_cores,
)
from physis_ros.engine.ranks.executor import ranks_engine
from physis_ros.engine.stage import BlockTimer
from physis_ros.tools.experiments.realcheck import BATCHES, GlooJob, pool_message_costs
from physis_ros.tools.gloo_calibration import (
    QUIET_CORES,
    host_busy,
    runtime_config,
    wait_for_quiet,
    warm_up,
)

MAX_UTILIZATION = 0.9
WORLD = 2
SHARES = [(ab, c) for ab in (0.5, 0.55, 0.6) for c in (0.3, 0.25, 0.2)]
"""(A's and B's, C's) fraction of a rank per interval, tried in order by ``_shares``."""
MIN_GAIN = 0.03
"""Shares are taken at the first that gives C on rank 0 alone this much less predicted
response latency than beside B (else those with the most)."""


def _admit_scenario(scenario: tuple, ab: float, c: float, budget_ms: float, **kw):
    """A and B admitted, A closed, then C (``budget_ms``): (the controller, B's and C's
    admissions). ``scenario``: (pool, cost, model config, sampler); ``kw`` goes to the
    ``AdmissionController``."""
    pool, cost, cfg, sampler = scenario
    work_ms = K * cfg.num_blocks * cost.group_ms(cfg, sampler, 1)
    ctl = AdmissionController(pool, cost, **kw)

    def request(share: float, budget: float = 0.0) -> StreamRequest:
        return StreamRequest(
            model=cfg, sampler=sampler, target_interval_ms=work_ms / share, latency_budget_ms=budget
        )

    a, b = ctl.admit(request(ab)), ctl.admit(request(ab))
    ctl.close(a.plan.stream_id)
    return ctl, b, ctl.admit(request(c, budget_ms))


def _shares(pool, cost, cfg, sampler, predict) -> tuple[float, float, float]:
    """(share of A and B, share of C, predicted gain): of the shares that put A on rank 0,
    B on rank 1 and C, without a budget, beside B on rank 1, those where ``predict`` gives C
    on rank 0 the largest relative cut in response latency (the first reaching ``MIN_GAIN``)."""
    scenario = (pool, cost, cfg, sampler)
    best: tuple[float, float, float] | None = None
    for ab, c in SHARES:
        try:
            _, b, deep = _admit_scenario(scenario, ab, c, 0.0)
            if (b.plan.devices(), deep.plan.devices()) != ([1], [1]):
                continue
            _, _, deep = _admit_scenario(scenario, ab, c, 0.0, simulated=predict)
            # Just under it, the budget leaves only a placement with a shorter path, if any.
            budget = deep.expected_response_latency_ms * 0.9999
            _, _, shallow = _admit_scenario(scenario, ab, c, budget, simulated=predict)
        except AdmissionRefused:
            continue
        if shallow.plan.devices() != [0]:
            continue
        gain = 1 - shallow.expected_response_latency_ms / deep.expected_response_latency_ms
        if best is None or gain > best[2]:
            best = (ab, c, gain)
        if gain >= MIN_GAIN:
            break
    if best is None:
        raise RuntimeError(
            f"no shares in {SHARES} give C a shorter path with a budget under these "
            "calibrations (rank 0 alone predicted no faster than beside B on rank 1)"
        )
    return best


def _predictor(profiles: list, cores: int, chunks: int, skip: int, foreign: float = 0.0):
    """plans -> {stream: (median interval, median pipeline latency)}: the pool simulator with
    each calibration (``realcheck.simulate_free``'s configuration, streams paced at their
    targets, released together), the median over calibrations."""

    def predict(plans: list) -> dict[int, tuple[float, float]]:
        runs = []
        for profile in profiles:
            report = simulate(
                [SimStream(plan=p) for p in plans],
                ProfileCostModel(profile),
                SimConfig(
                    num_devices=WORLD,
                    chunks=chunks,
                    warmup_chunks=skip,
                    cooldown_chunks=2,
                    max_batch=10_000,
                    priority="engine",
                    sink_device=0,
                    host_cores=cores,
                    foreign_load=foreign,
                    forward_scale=profile.rank_work_scale,
                    worker_message_ms=profile.worker_message_ms,
                ),
            )
            runs.append(
                {s.stream_id: (s.interval_p50_ms, s.latency_p50_ms) for s in report.streams}
            )
        return {
            sid: (
                statistics.median(r[sid][0] for r in runs),
                statistics.median(r[sid][1] for r in runs),
            )
            for sid in runs[0]
        }

    return predict


def _drive(engine, opened: dict[str, tuple[int, float]], chunks: int, timeout_s: float = 180.0):
    """Every stream ``name -> (engine stream id, target ms)`` gets a chunk every target
    interval from the same start; (left_s, created_s) of each chunk, per stream name."""
    start = time.monotonic()
    submitted = dict.fromkeys(opened, 0)
    names = {sid: name for name, (sid, _) in opened.items()}
    out: dict[str, list[tuple[float, float]]] = {name: [] for name in opened}
    deadline = start + timeout_s
    while sum(map(len, out.values())) < chunks * len(opened):
        now = time.monotonic()
        if now > deadline:
            raise TimeoutError(f"{sum(map(len, out.values()))} chunks finished in time")
        due = []
        for name, (sid, target_ms) in opened.items():
            while submitted[name] < chunks and now >= start + submitted[name] * target_ms / 1e3:
                engine.submit_generate(sid)
                submitted[name] += 1
            if submitted[name] < chunks:
                due.append(start + submitted[name] * target_ms / 1e3 - now)
        for res in engine.poll_results(min([0.05, *due]) if due else 0.05):
            out[names[res.stream_id]].append((res.left_s, res.created_s))
    return out


def _measured(runs: list[list[tuple[float, float]]], skip: int) -> dict:
    """Median interval, pipeline latency and their sum over runs (each its own median)."""
    intervals, latencies = [], []
    for run in runs:
        kept = sorted(run)[skip:]
        left = [a for a, _ in kept]
        intervals.append(statistics.median((b - a) * 1e3 for a, b in itertools.pairwise(left)))
        latencies.append(statistics.median((a - c) * 1e3 for a, c in kept))
    interval, latency = statistics.median(intervals), statistics.median(latencies)
    return {
        "interval_ms": round(interval, 3),
        "pipeline_latency_ms": round(latency, 3),
        "response_latency_ms": round(interval + latency, 3),
        "runs": [
            {"interval_ms": round(i, 3), "pipeline_latency_ms": round(lat, 3)}
            for i, lat in zip(intervals, latencies, strict=True)
        ],
    }


def _errors(promise: dict, measured: dict) -> dict:
    return {
        key: round(promise[key] / measured[key] - 1, 4)
        for key in ("interval_ms", "pipeline_latency_ms", "response_latency_ms")
    }


def _summary(runs: list, skip: int, max_foreign: float, predict_with_load) -> dict:
    """C's promise (the same admission every run), what it measured over the quiet runs,
    and the prediction with the other jobs' load measured meanwhile."""
    opened, _, _ = runs[0]
    admission = opened["C"][1]
    promise = {
        "interval_ms": round(admission.expected_interval_ms, 3),
        "pipeline_latency_ms": round(admission.pipeline_latency_ms, 3),
        "response_latency_ms": round(admission.expected_response_latency_ms, 3),
    }
    quiet = [r for r in runs if r[2] < max_foreign]
    got = _measured([c for _, c, _ in quiet or runs], skip)
    foreign = statistics.median(f for _, _, f in runs)
    plans = [opened[n][1].plan for n in ("B", "C")]
    interval, latency = predict_with_load(foreign)(plans)[admission.plan.stream_id]
    with_load = {
        "interval_ms": round(interval, 3),
        "pipeline_latency_ms": round(latency, 3),
        "response_latency_ms": round(interval + latency, 3),
    }
    return {
        "placement": admission.plan.describe(),
        "ranks": admission.plan.devices(),
        "ranks_on_path": sorted({0, *admission.plan.devices()}),
        "candidate": admission.candidate,
        "latency_budget_ms": admission.latency_budget_ms,
        "promise": promise,
        "measured": got,
        "error": _errors(promise, got),
        "quiet": bool(quiet),
        "foreign_cores": [round(f, 2) for _, _, f in runs],
        "predicted_with_measured_load": with_load,
        "error_with_measured_load": _errors(with_load, got),
        "beside": {"B": opened["B"][1].plan.describe()},
    }


@dataclass(kw_only=True)
class _Scenario:
    """The job, the pool and the calibrated costs that streams A, B and C are admitted on:
    A and B at ``target_ab_ms``, C at ``target_c_ms``."""

    engine: EngineCore
    pool: PoolConfig
    cost: ProfileCostModel
    predict: Callable[[list], dict[int, tuple[float, float]]]
    cfg: ModelConfig
    sampler: SamplerConfig
    target_ab_ms: float
    target_c_ms: float

    def admit_all(self, budget_ms: float):
        """A and B admitted and opened, A closed (it left), C admitted with ``budget_ms`` and
        opened: the gate and {name: (engine stream id, admission)}."""
        gate = AdmittedEngine(
            self.engine,
            AdmissionController(self.pool, self.cost, simulated=self.predict),
            self.cfg,
            self.sampler,
        )
        opened = {}
        for i, (name, target, budget) in enumerate(
            (
                ("A", self.target_ab_ms, 0.0),
                ("B", self.target_ab_ms, 0.0),
                ("C", self.target_c_ms, budget_ms),
            )
        ):
            if name == "C":
                gate.close_stream(opened.pop("A")[0])
            spec = StreamSpec(seed=i, target_interval_ms=target, response_latency_budget_ms=budget)
            promise, admission = gate.open_stream(spec, max_in_flight=0)
            opened[name] = (promise.stream_id, admission)
        return gate, opened

    def probe(self, budget_ms: float):
        """C's admission with ``budget_ms``, then all closed again."""
        gate, opened = self.admit_all(budget_ms)
        for sid, _ in opened.values():
            gate.close_stream(sid)
        return opened["C"][1]

    def one_run(self, budget_ms: float, chunks: int):
        """Admit, run B and C, close them: (the admissions, C's chunks, the other jobs' load
        meanwhile)."""
        pids = [os.getpid()] + [proc.pid for proc in self.engine.executor.procs]
        gate, opened = self.admit_all(budget_ms)
        try:
            streams = {n: (sid, a.expected_interval_ms) for n, (sid, a) in opened.items()}
            _drive(self.engine, streams, WARM_CHUNKS)  # unmeasured, as every realcheck run
            meter = ForeignLoad(pids)
            out = _drive(self.engine, streams, chunks)
            return opened, out["C"], meter.cores()
        finally:
            for sid, _ in opened.values():
                gate.close_stream(sid)

    def alternate(
        self, budget: float, runs: int, chunks: int, max_foreign_cores: float, quiet_wait_s: float
    ) -> tuple[dict[str, list], str | None]:
        """``runs`` runs of C without and with ``budget``, alternating (the same minutes of
        the host), a disturbed run retried up to twice: the runs per key, and the refusal's
        reason if admission refused C."""
        done_runs: dict[str, list] = {"without_budget": [], "with_budget": []}
        for _ in range(runs):
            for key, budget_ms in (("without_budget", 0.0), ("with_budget", budget)):
                for attempt in range(3):
                    if attempt:
                        wait_for_quiet(quiet_wait_s)
                    try:
                        opened, chunks_c, foreign = self.one_run(budget_ms, chunks)
                    except AdmissionRefused as refusal:
                        return done_runs, refusal.reason
                    if foreign < max_foreign_cores:
                        break
                done_runs[key].append((opened, chunks_c, foreign))
        return done_runs, None


def _calibration_job(model: str, skip: int) -> GlooJob:
    """realcheck's job settings, to calibrate ``WORLD`` ranks with (no cases of its own)."""
    block_model = build_model(get_preset(model), device="cpu")
    return GlooJob(
        world=WORLD,
        model=model,
        chunks=120,
        skip=skip,
        max_foreign_cores=QUIET_CORES,
        quiet_wait_s=5.0,
        timers={b: BlockTimer(block_model, [W] * b, window=W) for b in BATCHES},
        calibrations=[],
        runs={},
    )


def latencycheck(
    *,
    model: str = "tiny",
    calibrations: int = 3,
    chunks: int = 80,
    runs: int = 3,
    skip: int = 8,
    max_foreign_cores: float = 0.3,
    quiet_wait_s: float = 20.0,
) -> dict:
    """Calibrate, admit C beside B with and without a budget, run, compare (module doc)."""
    torch.set_num_threads(1)  # rank 0 lives in this process
    t_start = time.perf_counter()
    cores = host_cores()
    cfg, sampler = get_preset(model), SamplerConfig(steps=K, window=W)
    job = _calibration_job(model, skip)
    older = set(_all_tasks_cpu_ms())  # this process's threads before the job's ranks start
    with ranks_engine(runtime_config(model), world_size=WORLD) as engine:
        warm_up(engine)
        done = [job.calibrate(engine, older) for _ in range(calibrations)]
        profiles = pool_message_costs([p for p, _, _ in done], [s for _, _, s in done])
        cost = ProfileCostModel(profiles[len(profiles) // 2])
        # Admission predicts for the host without other jobs (as realcheck does: only runs
        # they left alone count); their load at admission is recorded.
        foreign_now = host_busy(1.0) * cores
        predict = _predictor(profiles, cores, chunks, skip)
        pool = PoolConfig(
            num_devices=WORLD,
            usable_bytes=1 * GIB,
            policy="shared",
            max_utilization=MAX_UTILIZATION,
            memory=MemoryModel(dtype_bytes=4),
            controller_device=0,
        )
        share_ab, share_c, gain = _shares(pool, cost, cfg, sampler, predict)
        work_ms = K * cfg.num_blocks * cost.group_ms(cfg, sampler, 1)
        t_ab, t_c = work_ms / share_ab, work_ms / share_c
        scenario = _Scenario(
            engine=engine,
            pool=pool,
            cost=cost,
            predict=predict,
            cfg=cfg,
            sampler=sampler,
            target_ab_ms=t_ab,
            target_c_ms=t_c,
        )
        deep_ms = scenario.probe(0.0).expected_response_latency_ms  # C without a budget
        # Just under it, admission must find a shallower placement; the budget asked in the
        # runs is halfway between the two promises.
        try:
            shallow_ms = scenario.probe(deep_ms * 0.999).expected_response_latency_ms
        except AdmissionRefused:
            shallow_ms = deep_ms * 0.999
        budget = round((deep_ms + shallow_ms) / 2, 3)
        done_runs, refused = scenario.alternate(
            budget, runs, chunks, max_foreign_cores, quiet_wait_s
        )

        def with_load(foreign: float):
            return _predictor(profiles, cores, chunks, skip, foreign)

        result = {
            key: _summary(r, skip, max_foreign_cores, with_load)
            for key, r in done_runs.items()
            if r
        }
    common = {
        "experiment": "latencycheck",
        "targets_ms": {"A": round(t_ab, 3), "B": round(t_ab, 3), "C": round(t_c, 3)},
        "host_cores": cores,
        "foreign_cores_at_admission": round(foreign_now, 2),
        "predicted_gain": round(gain, 4),
        "runtime_s": round(time.perf_counter() - t_start, 1),
        "profiles": [p.to_json() for p in profiles],
        "method": _method(calibrations, share_ab, share_c, runs, chunks, skip, max_foreign_cores),
    }
    return _verdict(common, result, refused, budget)


def _method(  # noqa: PLR0917 - the report's own settings, one sentence
    calibrations: int,
    share_ab: float,
    share_c: float,
    runs: int,
    chunks: int,
    skip: int,
    max_foreign_cores: float,
) -> str:
    return (
        f"{WORLD} gloo ranks, controller on rank 0; {calibrations} calibrations on the job "
        f"(realcheck's); A and B each take {share_ab:.0%} of a rank per interval (A on "
        f"rank 0, B on rank 1, then A closed), C {share_c:.0%}; admission (shared, "
        f"{MAX_UTILIZATION:.0%} utilization at most) "
        "predicts with the simulator under each calibration (median), for a host without "
        "other jobs; C asks for a budget halfway between its promises "
        "without a budget and just under that. The two placements "
        f"alternate, {runs} runs each of {chunks} chunks per stream after a warm-up, "
        "every stream paced at its target from the same start; a run other jobs "
        f"disturbed (over {max_foreign_cores} cores) is retried after waiting for a quiet "
        "host (3 tries); measured: medians over the quiet runs (all when none was) of "
        f"each run's median after {skip} chunks (interval, pipeline latency = chunk in "
        "to out), response latency = their sum; error = promise / measured - 1; "
        "'_with_measured_load': the simulator also given the other jobs' load"
    )


def _verdict(common: dict, result: dict, refused: str | None, budget: float) -> dict:
    """The report: C with and without the budget, and whether the budget's promise held."""
    if refused is not None:
        return {
            **common,
            **result,
            "with_budget": {"refused": refused, "latency_budget_ms": budget},
            "within_15_percent": False,
        }
    shallow, deep = result["with_budget"], result["without_budget"]
    # The promise to the client is (interval, response latency); the pipeline latency's own
    # error is reported beside them.
    worst = max(abs(shallow["error"][k]) for k in ("interval_ms", "response_latency_ms"))
    return {
        **common,
        "with_budget": shallow,
        "without_budget": deep,
        "shallower": len(shallow["ranks_on_path"]) < len(deep["ranks_on_path"]),
        "max_abs_error_with_budget": worst,
        "within_15_percent": worst <= 0.15,
        "quiet": shallow["quiet"] and deep["quiet"],
    }
