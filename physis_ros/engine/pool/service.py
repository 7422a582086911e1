"""The pool in the engine core: admission, placement and promises for every stream.

``PoolAdmission`` places the core's streams on a K x L layout of its workers (threads or
ranks; device d = worker d):

- a stream's target interval (a request of 0 gets the pool's default target) and its
  response-latency budget go to the ``AdmissionController``, which places it in the spare
  compute and memory without moving admitted streams (or checks a placement given by hand),
  trading depth and sharing for the budget; it predicts latencies with this pool's simulator
  (the promise's own numbers), so a placement is admitted only if its promised response
  latency is within the stream's budget and no admitted stream's promise is pushed past its
  own budget (a ``latency`` refusal names the placement that came closest);
- the simulator then runs the pool *with* the new stream under the calibrated cost model, every
  forward slowed by the admission's headroom (1 / ``max_utilization``); if any stream would
  miss its target even so, the stream is refused with the predicted interval;
- otherwise the stream opens with the admitted layout and is promised what the simulation
  predicts for it (interval, response latency, the chunks in flight it needs);
- whenever a stream joins or leaves, every other stream's promise is simulated again, and
  changed ones are handed out by ``take_revisions`` for the server to tell its clients;
- the chunks that come out are timed (entered -> left the pipeline, what a promise's response
  latency predicts; a stream's first ``RECALIBRATE_WARMUP_CHUNKS`` are not): when a
  stream's median over its last ``RECALIBRATE_CHUNKS`` is off its promise by more than
  ``RECALIBRATE_TOLERANCE``, the costs the pool predicts with are scaled until the
  simulated pool gives that stream the latency measured (``measured_slowdown``: other
  processes on the host, a warmer or colder device than at start-up), every promise is
  simulated again and revised, and the streams admitted later are checked against the
  scaled costs.

Start-up planning of the default target and the simulator runs: ``pool/planning.py``.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import statistics
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from physis_ros.engine.api import AdmissionRefused, StreamPromise, StreamSpec
from physis_ros.engine.config import ModelConfig, SamplerConfig
from physis_ros.engine.placement import Layout
from physis_ros.engine.pool.admission import AdmissionController
from physis_ros.engine.pool.costmodel import CostModel
from physis_ros.engine.pool.gate import plan_layout
from physis_ros.engine.pool.plan import StreamPlan, contiguous_split
from physis_ros.engine.pool.planning import PoolSimulation, SlowerCost, simulate_plans
from physis_ros.engine.pool.simulator import SimReport
from physis_ros.engine.pool.terms import PoolConfig, StreamRequest

log = logging.getLogger(__name__)

FASTEST_STEP = 1.25
FASTEST_STEPS = 16
"""A stream that asks for interval 0 is offered the default target, then slower ones by
``FASTEST_STEP`` up to ``FASTEST_STEPS`` times (about 35 times the default)."""
REVISION_TOLERANCE = 0.05
"""A stream is told of a new promise when its interval or latency moves by more than this."""
RECALIBRATE_CHUNKS = 32
"""Chunks of one stream whose measured latency is compared with its promise at a time."""
RECALIBRATE_WARMUP_CHUNKS = 8
"""A stream's first chunks are not timed: they carry its start-up (the simulator leaves its
warm-up chunks out of a promise too)."""
RECALIBRATE_TOLERANCE = 0.2
"""Measured median latency off the promise by more than this: the costs are rescaled. Wider
than REVISION_TOLERANCE so that the run-to-run spread of a busy host does not flap."""
SLOWDOWN_BOUNDS = (0.25, 50.0)
"""Measured slowdown kept within these (a stalled host is a fault, not a calibration)."""
FIT_SIMULATIONS = 8
"""Simulations that fit the slowdown to one measured latency (bisection on a log scale)."""


@dataclass
class _Stream:
    pool_id: int
    spec: StreamSpec
    promise: StreamPromise


class PoolAdmission:
    """Admission, placement and revised promises of the engine core's streams (module
    docstring). The core opens a stream through ``open`` and tells it what it closes and
    what came out; nothing here touches the workers."""

    def __init__(
        self,
        pool: PoolConfig,
        cost: CostModel,
        settings: PoolSimulation,
        *,
        model: ModelConfig,
        sampler: SamplerConfig,
        default_target_ms: float,
        chunks_per_interval: int = 2,
        stage_devices: tuple[int, ...] | None = None,
        recalibrate: bool = True,
    ) -> None:
        """``stage_devices``: every stream gets this placement (given by hand), checked.
        ``recalibrate``: scale the costs by the measured latencies (module docstring)."""
        if not default_target_ms > 0:
            raise ValueError(f"default_target_ms must be > 0, got {default_target_ms}")
        self.pool = pool
        self.cost = cost
        self.settings = settings
        self.model = model
        self.sampler = sampler
        self.default_target_ms = default_target_ms
        self.chunks_per_interval = chunks_per_interval
        self.stage_devices = stage_devices
        self.recalibrate = recalibrate
        self.controller = AdmissionController(
            pool, cost, simulated=self._predicted, slot_wait=False
        )
        self.measured_slowdown = 1.0
        """Measured latency / predicted, applied to every forward the pool predicts."""
        self._measured: dict[int, deque[float]] = {}  # stream id -> latencies (ms) not yet used
        self._untimed: dict[int, int] = {}  # stream id -> warm-up chunks still to skip
        self._streams: dict[int, _Stream] = {}
        self._revised: dict[int, StreamPromise] = {}
        self._lock = threading.Lock()

    # ---- admission -----------------------------------------------------------------------
    def open(self, spec: StreamSpec, open_on: Callable[[Layout], StreamPromise]) -> StreamPromise:
        """Admit, simulate the pool with the stream, open it with ``open_on(layout)`` (the
        workers load the blocks it needs and open it there); or raise ``AdmissionRefused``
        naming the resource (and device) that ran out or the predicted interval. A request
        for interval 0 ("as fast as the pool allows") gets the fastest target the pool can
        promise it now: the default target on an empty pool, slower ones (x1.25 each) beside
        other streams."""
        with self._lock:
            budget = spec.response_latency_budget_ms
            rollout = max(spec.horizon or 1, 1) if spec.rollouts else 1
            if spec.target_interval_ms:
                target = spec.target_interval_ms
                admission, report = self._admit(self._request(target, budget, rollout))
            else:
                target, admission, report = self._fastest(budget, rollout)
            plan = admission.plan
            others = dict(self._streams)
            try:
                opened = open_on(plan_layout(plan))
            except BaseException:
                self.controller.close(plan.stream_id)
                raise
            promise = self._promise(opened, report.streams[-1], target)
            self._streams[opened.stream_id] = _Stream(plan.stream_id, spec, promise)
            self._revise(dict(zip(others, report.streams[:-1], strict=True)))
        log.info(
            "stream %d admitted (%s) at %.1f ms: %s; promised latency %.1f ms",
            opened.stream_id,
            admission.candidate,
            target,
            plan.describe(),
            promise.expected_response_latency_ms,
        )
        return promise

    def _request(self, target_ms: float, budget_ms: float = 0.0, rollout: int = 1):
        """A stream's request: ``rollout`` generated chunks per interval (its horizon, when
        every observation generates it again), with the observation when the pool charges
        context chunks."""
        return StreamRequest(
            model=self.model,
            sampler=self.sampler,
            target_interval_ms=round(target_ms, 3),
            latency_budget_ms=budget_ms,
            chunks_per_interval=self.chunks_per_interval - 1 + rollout,
            rollout=rollout,
        )

    def _predicted(self, plans: list[StreamPlan]) -> dict[int, tuple[float, float]]:
        """Stream id -> (interval, response latency) the pool running ``plans`` is promised:
        the admission's latency predictor, in the promise's own terms (``_promise``)."""
        report = simulate_plans(plans, self._now_cost, self.settings, self.pool.num_devices)
        return {
            p.stream_id: (s.interval_p50_ms, s.latency_p50_ms)
            for p, s in zip(plans, report.streams, strict=True)
        }

    def _fastest(self, budget_ms: float = 0.0, rollout: int = 1, steps: int = FASTEST_STEPS):
        """(target, admission, report) of the fastest target admitted now (see open_stream);
        a rollout of h starts from h times the default target."""
        target = self.default_target_ms * rollout
        first: AdmissionRefused | None = None
        for _ in range(steps):
            try:
                admission, report = self._admit(self._request(target, budget_ms, rollout))
            except AdmissionRefused as exc:
                first = first or exc
                if exc.resource == "memory":
                    raise  # no slower target needs less memory
                target *= FASTEST_STEP
                continue
            return admission.plan.target_interval_ms, admission, report
        raise AdmissionRefused(
            f"{first.reason}; no slower target up to {target / FASTEST_STEP:.1f} ms fits "
            "beside the admitted streams either",
            resource=first.resource,
            shortfall=first.shortfall,
        )

    def _admit(self, request: StreamRequest):
        """The admission controller's placement, confirmed by simulating the pool with the
        stream; if the simulation refuses it, contiguous placements over the least busy
        workers (1, 2, ... of them) in turn. (Admission, report) or ``AdmissionRefused``
        with the first candidate's reason."""
        plans = [self.controller.plans[st.pool_id] for st in self._streams.values()]
        candidates: list[tuple[int, ...] | None] = [self.stage_devices]
        if self.stage_devices is None:
            S = self.sampler.steps * self.model.num_blocks
            quiet = sorted(range(self.pool.num_devices), key=self.controller.utilization)
            for g in range(1, min(S, self.pool.num_devices) + 1):
                candidates.append(contiguous_split(S, quiet[:g]))
        first: AdmissionRefused | None = None
        tried: set = set()
        for stage_devices in candidates:
            try:
                admission = self.controller.admit(request, stage_devices)
            except AdmissionRefused as exc:
                first = first or exc
                continue
            plan = admission.plan
            if plan.stage_devices in tried:
                self.controller.close(plan.stream_id)
                continue
            tried.add(plan.stage_devices)
            G = self.pool.num_devices
            check = simulate_plans([*plans, plan], self._headroom, self.settings, G)
            missing = self._missing(check, [*plans, plan])
            if missing is None:  # promised: what the pool is predicted to do, no slower
                return admission, simulate_plans([*plans, plan], self._now_cost, self.settings, G)
            self.controller.close(plan.stream_id)
            first = first or missing
        raise first

    def _missing(self, report: SimReport, plans: list[StreamPlan]) -> AdmissionRefused | None:
        """Why a simulated pool does not keep every target (None: it does)."""
        for s, plan in zip(report.streams, plans, strict=True):
            if s.meets_target:
                continue
            T = plan.target_interval_ms
            busiest = max(report.devices, key=lambda dev: dev.utilization)
            who = "the new stream" if plan is plans[-1] else "an admitted stream"
            busy = f"device {busiest.device} busy {busiest.utilization:.0%}"
            if s.interval_p50_ms > T:
                return AdmissionRefused(
                    f"compute: predicted interval {s.interval_p50_ms:.1f} ms for {who} vs "
                    f"target {T:.1f} ms ({s.deadline_misses} chunks late), {busy}",
                    resource="compute",
                    shortfall=f"{s.interval_p50_ms - T:.1f} ms",
                )
            # On median it keeps up, but with no headroom left its chunks fall behind their
            # slots (a median alone would read "short by 0.0 ms").
            return AdmissionRefused(
                f"compute: {who} would fall behind its {T:.1f} ms slots: {s.deadline_misses} "
                f"of {s.chunks_measured} predicted chunks late (interval median "
                f"{s.interval_p50_ms:.1f} ms, mean {s.interval_mean_ms:.1f} ms), {busy}",
                resource="compute",
                shortfall=f"{s.deadline_misses} late chunks of {s.chunks_measured}",
            )
        return None

    def _promise(self, opened: StreamPromise, s, target: float) -> StreamPromise:
        return dataclasses.replace(
            opened,
            expected_interval_ms=round(max(s.interval_p50_ms, target), 3),
            expected_response_latency_ms=round(s.latency_p50_ms, 3),
            pipeline_depth=max(1, math.ceil(s.latency_p99_ms / target)) + 1,
            target_interval_ms=target,
            revision=opened.revision,
        )

    def _revise(self, reports: dict) -> None:
        """New promises for streams whose predicted interval or latency moved."""
        for sid, s in reports.items():
            st = self._streams[sid]
            new = self._promise(st.promise, s, st.promise.target_interval_ms)
            old = st.promise
            moved = any(
                abs(getattr(new, f) - getattr(old, f)) > REVISION_TOLERANCE * getattr(old, f)
                for f in ("expected_interval_ms", "expected_response_latency_ms")
            )
            if moved or new.pipeline_depth != old.pipeline_depth:
                st.promise = dataclasses.replace(new, revision=old.revision + 1)
                self._revised[sid] = st.promise

    def take_revisions(self) -> list[StreamPromise]:
        """Promises revised since the last call (one per stream, the newest)."""
        with self._lock:
            out, self._revised = list(self._revised.values()), {}
        return out

    def promise(self, stream_id: int) -> StreamPromise:
        with self._lock:
            return self._streams[stream_id].promise

    def close(self, stream_id: int) -> None:
        """The core closed the stream: its share of the pool is free, the others' promises
        are simulated again."""
        with self._lock:
            st = self._streams.pop(stream_id, None)
            self._revised.pop(stream_id, None)
            if st is None:
                return
            self._measured.pop(stream_id, None)
            self._untimed.pop(stream_id, None)
            self.controller.close(st.pool_id)
            self._simulate_again()

    def _simulate_again(self) -> None:
        """Every open stream's promise simulated again (under the lock), revised if moved."""
        if self._streams:
            plans = [self.controller.plans[s.pool_id] for s in self._streams.values()]
            report = simulate_plans(plans, self._now_cost, self.settings, self.pool.num_devices)
            self._revise(dict(zip(self._streams, report.streams, strict=True)))

    # ---- promises kept honest by what is measured -------------------------------------------
    @property
    def _now_cost(self):
        """The costs promises are predicted with: the calibration, scaled as measured."""
        if self.measured_slowdown == 1.0:
            return self.cost
        return SlowerCost(self.cost, self.measured_slowdown)

    @property
    def _headroom(self):
        """The slower costs admission checks every target with."""
        return SlowerCost(self.cost, self.measured_slowdown / self.pool.max_utilization)

    def _measure(self, outputs) -> None:
        """Times the finished chunks; rescales the costs when a stream's median is off."""
        with self._lock:
            for out in outputs:
                st = self._streams.get(out.stream_id)
                if st is None or out.preview_steps or not (out.entered_s and out.left_s):
                    continue
                if st.spec.rollouts and out.horizon != 1:
                    continue  # a promise's latency is the first chunk of each rollout's
                skip = self._untimed.setdefault(out.stream_id, RECALIBRATE_WARMUP_CHUNKS)
                if skip:
                    self._untimed[out.stream_id] = skip - 1
                    continue
                times = self._measured.setdefault(out.stream_id, deque())
                times.append((out.left_s - out.entered_s) * 1e3)
                if len(times) < RECALIBRATE_CHUNKS:
                    continue
                measured_ms = statistics.median(times)
                times.clear()
                promised_ms = st.promise.expected_response_latency_ms
                if promised_ms <= 0:
                    continue
                ratio = measured_ms / promised_ms
                if abs(ratio - 1) <= RECALIBRATE_TOLERANCE:
                    continue
                before = self.measured_slowdown
                self.measured_slowdown = self._fit_slowdown(out.stream_id, measured_ms, ratio)
                if self.measured_slowdown == before:
                    continue
                log.info(
                    "stream %d: measured latency %.1f ms (median of %d chunks) vs promised "
                    "%.1f ms; the pool's costs are now x%.2f of the calibration (was x%.2f); "
                    "promises simulated again",
                    out.stream_id,
                    measured_ms,
                    RECALIBRATE_CHUNKS,
                    promised_ms,
                    self.measured_slowdown,
                    before,
                )
                self._simulate_again()

    def _fit_slowdown(self, stream_id: int, measured_ms: float, ratio: float) -> float:
        """The cost scale at which the simulated pool gives ``stream_id`` the latency
        measured. Scaling by the measured ratio alone overshoots: near saturation latency
        grows faster than the costs (queueing), and the promises then swung between too
        slow and too fast (x1.32, then x0.78, with three rollout streams). Bisection on a log
        scale between the present scale and the ratio's guess, widened while the guess does
        not reach the measurement."""
        low, high = SLOWDOWN_BOUNDS
        plans = [self.controller.plans[s.pool_id] for s in self._streams.values()]
        index = list(self._streams).index(stream_id)

        def latency_ms(scale: float) -> float:
            report = simulate_plans(
                plans, SlowerCost(self.cost, scale), self.settings, self.pool.num_devices
            )
            return report.streams[index].latency_p50_ms

        near = self.measured_slowdown
        far = min(high, max(low, near * ratio))
        for _ in range(3):  # the guess must lie beyond the measurement, seen from ``near``
            if far in (low, high) or (latency_ms(far) >= measured_ms) == (ratio > 1):
                break
            far = min(high, max(low, far * ratio))
        for _ in range(FIT_SIMULATIONS):
            mid = math.sqrt(near * far)
            if (latency_ms(mid) < measured_ms) == (ratio > 1):
                near = mid
            else:
                far = mid
        return math.sqrt(near * far)

    def measure(self, outputs) -> None:
        """What came out of the core (recalibrating when the pool does)."""
        if outputs and self.recalibrate:
            self._measure(outputs)

    def info(self) -> dict[str, str]:
        """What GetServerInfo reports: per device the committed utilization and memory."""
        c = self.controller
        with self._lock:
            open_now = len(self._streams)
        out = {
            "open_streams": str(open_now),
            "workers": str(self.pool.num_devices),
            "policy": self.pool.policy,
            "default_target_ms": f"{self.default_target_ms:.1f}",
            "cost_model": self.cost.name,
            "measured_slowdown": f"{self.measured_slowdown:.2f}",
        }
        for d in range(self.pool.num_devices):
            out[f"device{d}"] = (
                f"utilization {c.utilization(d):.0%}, memory "
                f"{c.memory_used(d) / 2**30:.3f} of {self.pool.usable_bytes / 2**30:.3f} GiB"
            )
        return out
