"""Planning a pool with the simulator: how the simulator runs a pool (``PoolSimulation``),
the pool running a set of placed streams (``simulate_plans``), costs slowed by a factor
(``SlowerCost``: admission's headroom, a measured slowdown), and start-up planning of the
default target (``plan_default_target``: the fastest interval the pool can promise one
stream, and the placement that gets it).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from physis_ros.engine.api import AdmissionRefused
from physis_ros.engine.pool.admission import AdmissionController
from physis_ros.engine.pool.costmodel import CostModel
from physis_ros.engine.pool.plan import StreamPlan
from physis_ros.engine.pool.simulator import SimConfig, SimReport, SimStream, simulate
from physis_ros.engine.pool.terms import PoolConfig, StreamRequest

SIM_CHUNKS = 24
"""Chunks per stream in a promise's simulation (warm-up and cool-down excluded below)."""


@dataclass(frozen=True, kw_only=True)
class PoolSimulation:
    """How the simulator runs this pool (what ``SimConfig`` needs beyond the streams)."""

    host_cores: float = 0.0
    """Processors the workers share (CPU workers on one host); 0: each is its own device."""
    forward_scale: float = 1.0
    """Processor time of a worker's work beside the others relative to alone (gloo ranks)."""
    worker_message_ms: float = 0.0
    """Cost to a worker of each message it sends or receives (gloo ranks)."""
    batching: bool = True
    max_batch: int = 64

    def config(self, num_devices: int) -> SimConfig:
        return SimConfig(
            num_devices=num_devices,
            chunks=SIM_CHUNKS,
            warmup_chunks=6,
            cooldown_chunks=2,
            max_batch=self.max_batch,
            batching=self.batching,
            sink_device=0,
            host_cores=self.host_cores,
            forward_scale=self.forward_scale,
            worker_message_ms=self.worker_message_ms,
            priority="engine",
        )


def simulate_plans(
    plans: list[StreamPlan], cost: CostModel, settings: PoolSimulation, num_devices: int
) -> SimReport:
    """The pool running ``plans`` together with their context chunks, stream i releasing its
    chunks from ``i / n`` of its interval on (streams open at unrelated times: spread evenly
    is the typical case, not the worst)."""
    n = len(plans)
    streams = [
        SimStream(
            plan=p,
            phase_ms=i * p.target_interval_ms / n,
            context_chunks=p.chunks_per_interval > p.rollout,
            rollout=p.rollout,
        )
        for i, p in enumerate(plans)
    ]
    return simulate(streams, cost, settings.config(num_devices))


class SlowerCost:
    """A cost model whose every batched forward takes ``factor`` times as long: the pool that
    admission checks must keep every target even so (the headroom ``max_utilization`` leaves
    for a host that slows down now and then)."""

    def __init__(self, cost: CostModel, factor: float) -> None:
        self.cost = cost
        self.factor = factor
        self.name = f"{cost.name} x{factor:.2f}"
        self.comm_overlaps_compute = cost.comm_overlaps_compute
        self.comm_threads = cost.comm_threads

    def group_ms(self, cfg, sampler, tasks: int) -> float:
        return self.cost.group_ms(cfg, sampler, tasks) * self.factor

    def __getattr__(self, name: str):  # hops, messages, controller work: as they are
        return getattr(self.cost, name)


@dataclass(frozen=True, kw_only=True)
class DefaultPlan:
    """What start-up planning chose: the default target interval and the placement one
    stream gets at it on an empty pool."""

    target_interval_ms: float
    plan: StreamPlan
    report: SimReport

    def describe(self) -> str:
        s = self.report.streams[0]
        return (
            f"default target {self.target_interval_ms:.1f} ms over "
            f"{len(self.plan.devices())} worker(s): {self.plan.describe()} (predicted interval "
            f"{s.interval_p50_ms:.1f} ms, response latency {s.latency_p50_ms:.1f} ms)"
        )


def plan_default_target(
    pool: PoolConfig,
    cost: CostModel,
    settings: PoolSimulation,
    request: StreamRequest,
    *,
    stage_devices: tuple[int, ...] | None = None,
    max_steps: int = 60,
) -> DefaultPlan:
    """The target interval one stream is promised on the empty pool (``request``'s own target
    is ignored): the smallest that admission grants and the simulator confirms, searched
    upwards in steps of 5% from the admission's own bound (``stage_devices``: the placement
    given by hand), with the admission's headroom on top (divided by ``max_utilization``:
    the simulator's smallest is the pool at full load, which jitter would break)."""
    stage_ms = AdmissionController(pool, cost).stage_ms(request.model, request.sampler)
    S = request.sampler.steps * request.model.num_blocks
    # The admission's own bound: the busiest device's stages (spread over every device, or
    # as given) at the highest utilization it allows.
    if stage_devices is None:
        busiest = math.ceil(S / min(S, pool.num_devices))
    else:
        busiest = max(stage_devices.count(d) for d in set(stage_devices))
    target = stage_ms * request.chunks_per_interval * busiest / pool.max_utilization
    why = ""
    headroom = False
    for _ in range(max_steps):
        req = dataclasses.replace(request, target_interval_ms=round(target, 3))
        controller = AdmissionController(pool, cost)
        try:
            plan = controller.admit(req, stage_devices).plan
        except AdmissionRefused as exc:
            why = exc.reason
        else:
            report = simulate_plans([plan], cost, settings, pool.num_devices)
            if report.all_meet_target and headroom:
                return DefaultPlan(
                    target_interval_ms=req.target_interval_ms, plan=plan, report=report
                )
            if report.all_meet_target:  # the pool at full load: add the headroom, check again
                headroom = True
                target /= pool.max_utilization
                continue
            s = report.streams[0]
            why = f"predicted interval {s.interval_p50_ms:.1f} ms, {s.deadline_misses} late chunks"
        target *= 1.05
    raise ValueError(
        f"no target interval up to {target:.1f} ms can be promised for model "
        f"{request.model.name} on {pool.num_devices} worker(s): {why}"
    )
