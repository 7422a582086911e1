"""Admission control for a pool of devices shared by many streams (runs on rank 0).

A new stream is admitted only if its K*L stages can be placed in the pool's *spare* memory
and compute without moving admitted streams, such that every device keeps its work per
interval under ``max_utilization`` of every stream's target interval, and, when the stream
states a response-latency budget, the placement's predicted response latency (``latency``)
is within it and no admitted stream is pushed past its own budget. Otherwise
``AdmissionRefused`` names the resource that ran out (``memory``, ``compute``, ``latency``)
and by how much.

Policies:
- ``static``: each stream gets an exclusive group of empty devices, the smallest that
  meets its target alone (the baseline).
- ``shared``: streams of the same model share devices (weights loaded once per device,
  ready tasks of a block batched across streams). Candidates, in order: (1) pack into the
  spare capacity of devices already in use; (2) the static candidate, a fresh exclusive group
  of the static size; (3) pack into any spare capacity. A static partition is one of the
  placements this search can produce, so shared never admits fewer streams than static: it
  takes empty devices only in static-sized groups until fewer than a group remain.
  With a latency budget, depth and sharing are traded for latency: a packing over used
  devices (deep, and queued behind their streams) that misses the budget gives way to the
  shallowest packing over the used devices with the most spare compute that meets it
  (``packed-shallow``), else to an exclusive group.

A request with target interval 0 asks for the fastest placement within its budget: an
exclusive group of free devices, as deep as helps (``fastest``; depth against latency, as
``planner`` describes), promised the interval that depth gives.

Compute per device is charged unbatched by default (one ``group_ms(1)`` per stage per
interval): a conservative bound, since batching only makes work cheaper; or per task of a
batch of ``PoolConfig.charged_batch``; the simulator then checks. The pool, the request and
the promise are in ``terms``; the packing into spare capacity in ``packing``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace

from physis_ros.engine.api import AdmissionRefused
from physis_ros.engine.config import ModelConfig, SamplerConfig
from physis_ros.engine.pool.costmodel import GIB, CostModel
from physis_ros.engine.pool.latency import BudgetBreak, budget_bound, budget_breaks, queued_ms
from physis_ros.engine.pool.packing import Failure, SparePacker
from physis_ros.engine.pool.plan import StreamPlan, contiguous_split
from physis_ros.engine.pool.terms import Admission, PoolConfig, StreamRequest


class AdmissionController(SparePacker):
    """Admits and closes streams on a pool; owns the pool's committed compute and memory."""

    def __init__(
        self,
        pool: PoolConfig,
        cost: CostModel,
        *,
        simulated: Callable[[list[StreamPlan]], dict[int, tuple[float, float]]] | None = None,
        slot_wait: bool = True,
    ) -> None:
        """``simulated``: a predictor that runs a set of plans (stream id -> (median interval,
        median pipeline latency), e.g. the pool simulator calibrated on the real runtime, as
        ``tools.experiments.latencycheck`` does); when given, latency predictions and budget
        checks use it instead of the closed form (``latency``): for small pools, where a
        simulation per candidate is cheap and processor sharing on one host is not in the
        closed form.
        ``slot_wait``: response latency counts one interval of waiting for the stream's next
        slot (``latency``); False where it is counted from the observation entering the
        pipeline, as the server promises and measures it (the newest observation goes in
        right before each generate request)."""
        self.pool = pool
        self.cost = cost
        self.simulated = simulated
        self.slot_wait = slot_wait
        G = pool.num_devices
        self.plans: dict[int, StreamPlan] = {}
        self._util = [0.0] * G
        self._on_device: list[dict[int, StreamPlan]] = [{} for _ in range(G)]
        self._mem_used = [0] * G
        self._next_id = 0
        self._budgets: dict[int, float] = {}
        """Admitted stream -> its latency budget (streams that asked for one)."""
        self._exclusive: set[int] = set()
        """Devices of streams placed ``fastest`` (no other stream is packed there)."""
        self._stage_ms_cache: dict[tuple[str, int, int], float] = {}
        self._held_cache: dict[int, tuple[set[tuple[str, int]], set[str], int]] = {}

    # ---- queries -------------------------------------------------------------------------
    def stage_ms(self, cfg: ModelConfig, sampler: SamplerConfig) -> float:
        key = (cfg.name, sampler.steps, sampler.window)
        if key not in self._stage_ms_cache:
            b = self.pool.charged_batch
            self._stage_ms_cache[key] = self.cost.group_ms(cfg, sampler, b) / b
        return self._stage_ms_cache[key]

    def _comm_ms(self, cfg: ModelConfig) -> tuple[float, float]:
        """Work one remote hop costs its sender and its receiver."""
        return self.cost.send_cpu_ms(cfg), self.cost.recv_cpu_ms(cfg)

    def utilization(self, device: int) -> float:
        return self._util[device]

    def memory_used(self, device: int) -> int:
        return self._mem_used[device]

    def device_load_ms(self, plan: StreamPlan) -> dict[int, float]:
        """Work per target interval that ``plan`` puts on each of its devices (unbatched)."""
        per_chunk = self._chunk_load_ms(plan)
        return {d: ms * plan.chunks_per_interval for d, ms in per_chunk.items()}

    def _chunk_load_ms(self, plan: StreamPlan) -> dict[int, float]:
        """Work per chunk that ``plan`` puts on each of its devices (unbatched)."""
        s_ms = self.stage_ms(plan.model, plan.sampler)
        load: dict[int, float] = {}
        for d in plan.stage_devices:
            load[d] = load.get(d, 0.0) + s_ms
        send_ms, recv_ms = self._comm_ms(plan.model)
        for _, src, dst in plan.hops():
            load[src] += send_ms
            load[dst] += recv_ms
        ctl = self.pool.controller_device
        if ctl is not None:
            extra = {ctl: self.cost.chunk_overhead_ms(plan.model)}
            first, last = plan.stage_devices[0], plan.stage_devices[-1]
            if first != ctl:  # the chunk enters from the controller
                extra[ctl] += send_ms
                extra[first] = extra.get(first, 0.0) + recv_ms
            if last != ctl:  # and leaves to it
                extra[last] = extra.get(last, 0.0) + send_ms
                extra[ctl] += recv_ms
            for d, ms in extra.items():
                if ms > 0:
                    load[d] = load.get(d, 0.0) + ms
        return load

    def no_contention_latency_ms(self, plan: StreamPlan) -> float:
        """Every stage and hop, and the hops in from and out to the controller device."""
        s_ms = self.stage_ms(plan.model, plan.sampler)
        pairs = [(a, b) for _, a, b in plan.hops()]
        ctl = self.pool.controller_device
        if ctl is not None:
            pairs += [(ctl, plan.stage_devices[0]), (plan.stage_devices[-1], ctl)]
        hops = sum(self.cost.hop_ms(plan.model, a, b) for a, b in pairs if a != b)
        return plan.num_stages * s_ms + hops

    def pipeline_latency_ms(self, plan: StreamPlan) -> float:
        """Predicted pipeline latency of ``plan`` (admitted or a candidate) in the pool as it
        is now: no-contention latency plus the work queued ahead (``latency``), or what the
        ``simulated`` predictor gives."""
        if self.simulated is not None:
            others = [p for sid, p in self.plans.items() if sid != plan.stream_id]
            return self.simulated([*others, plan])[plan.stream_id][1]
        T = plan.target_interval_ms
        own = {}
        if plan.stream_id in self.plans:
            own = {d: ms / T for d, ms in self.device_load_ms(plan).items()}
        queued = queued_ms(plan, lambda d: self._util[d] - own.get(d, 0.0))
        return self.no_contention_latency_ms(plan) + queued

    def response_latency_ms(self, stream_id: int) -> float:
        """An admitted stream's predicted response latency now (it moves as streams that share
        its devices come and go; never past its budget)."""
        plan = self.plans[stream_id]
        return self.response_ms(plan.target_interval_ms, self.pipeline_latency_ms(plan))

    def response_ms(self, interval_ms: float, pipeline_ms: float) -> float:
        """Response latency of a chunk with ``pipeline_ms`` of pipeline latency (``slot_wait``)."""
        return (interval_ms if self.slot_wait else 0.0) + pipeline_ms

    # ---- admission -----------------------------------------------------------------------
    def admit(self, req: StreamRequest, stage_devices: tuple[int, ...] | None = None) -> Admission:
        """Place the stream or raise ``AdmissionRefused``; admitted streams never move.

        ``stage_devices``: a placement given by hand (device of stage i = k * L + l); it is
        checked against the spare compute and memory instead of searched for."""
        sid = self._next_id
        if stage_devices is not None:
            plan, failure, candidate = self._given(sid, req, tuple(stage_devices))
        elif req.target_interval_ms == 0:
            plan, failure = self._fastest(sid, req)
            candidate = "fastest"
        else:
            plan, failure, candidate = self._place(sid, req)
        if plan is None:
            assert failure is not None
            raise AdmissionRefused(
                failure.reason, resource=failure.resource, shortfall=failure.shortfall
            )
        self._commit(plan)
        if candidate == "fastest":
            self._exclusive.update(plan.stage_devices)
        if req.latency_budget_ms:
            self._budgets[sid] = req.latency_budget_ms
        self._next_id += 1
        latency = self.pipeline_latency_ms(plan)
        interval = plan.target_interval_ms
        return Admission(
            plan=plan,
            candidate=candidate,
            expected_interval_ms=interval,
            no_contention_latency_ms=self.no_contention_latency_ms(plan),
            pipeline_latency_ms=latency,
            expected_response_latency_ms=self.response_ms(interval, latency),
            latency_budget_ms=req.latency_budget_ms,
            pipeline_depth=max(1, math.ceil(latency / interval)),
        )

    def _place(self, sid: int, req: StreamRequest):
        """(plan, failure, candidate): the first candidate of the policy that fits memory and
        compute and meets the latency budgets; else the reason (a latency reason first, for
        the placement that came closest: the interval could be met, the budget not)."""
        if self.pool.policy == "static":
            tries = [("static", lambda: self._fresh_group(sid, req))]
        else:
            used = [d for d in self._open_devices() if self._on_device[d]]
            tries = []
            if used:
                tries.append(("packed-used", lambda: self._pack(sid, req, used)))
                if req.latency_budget_ms:
                    tries.append(("packed-shallow", lambda: self._shallow(sid, req, used)))
            tries.append(("fresh-group", lambda: self._fresh_group(sid, req)))
            tries.append(("packed-any", lambda: self._pack(sid, req, self._open_devices())))
        failure = late = None
        for name, make in tries:
            plan, why = make()
            if plan is None:
                failure = why
                continue
            why = self._latency_failure(plan, req)
            if why is None:
                return plan, None, name
            if late is None or float(why.shortfall.split()[0]) < float(late.shortfall.split()[0]):
                late = why  # the reason names the placement that came closest
        return None, late or failure, ""

    def _given(self, sid: int, req: StreamRequest, stage_devices: tuple[int, ...]):
        """(plan, failure, "given"): a placement given by hand, checked against the spare
        compute and memory and the latency budgets (target 0 is not a target to check)."""
        if req.target_interval_ms == 0:
            raise ValueError("a placement given by hand needs a target interval > 0")
        plan = self._plan(sid, req, stage_devices)
        failure = self._check_fits(plan) or self._latency_failure(plan, req)
        return (None if failure else plan), failure, "given"

    def _latency_failure(self, plan: StreamPlan, req: StreamRequest) -> Failure | None:
        """Why ``plan`` misses the request's budget or pushes an admitted stream past its
        own; None when it does neither."""
        T = plan.target_interval_ms
        simulated = None
        if self.simulated is not None and (req.latency_budget_ms or self._budgets):
            simulated = self.simulated([*self.plans.values(), plan])
        if req.latency_budget_ms:
            if simulated is not None:
                response = self.response_ms(T, simulated[plan.stream_id][1])
            else:
                response = self.response_ms(T, self.pipeline_latency_ms(plan))
            if response > req.latency_budget_ms:
                return Failure(
                    resource="latency",
                    reason=(
                        f"latency: response latency {response:.1f} ms > budget "
                        f"{req.latency_budget_ms:.1f} ms on every placement that meets the "
                        f"interval {T:.1f} ms (best: {plan.describe()})"
                    ),
                    shortfall=f"{response - req.latency_budget_ms:.1f} ms",
                )
        if simulated is not None:
            response = {
                j: self.response_ms(self.plans[j].target_interval_ms, simulated[j][1])
                for j in self._budgets
            }
            breaks = [
                BudgetBreak(j, response[j], budget)
                for j, budget in self._budgets.items()
                if response[j] > budget
            ]
        else:
            added = {d: ms / T for d, ms in self.device_load_ms(plan).items()}
            budgeted = [
                (self.plans[j], self.response_latency_ms(j), budget)
                for j, budget in self._budgets.items()
            ]
            breaks = budget_breaks(added, budgeted)
        for broken in breaks:
            return Failure(
                resource="latency",
                reason=(
                    f"latency: admitted stream {broken.stream_id}'s response latency would "
                    f"rise to {broken.response_latency_ms:.1f} ms > its budget "
                    f"{broken.budget_ms:.1f} ms"
                ),
                shortfall=f"{broken.response_latency_ms - broken.budget_ms:.1f} ms",
            )
        return None

    def _shallow(self, sid: int, req: StreamRequest, used: list[int]):
        """The packing over the fewest used devices (those with the most spare compute first)
        that meets the latency budgets: fewer hops, fewer queues to wait in."""
        T = req.target_interval_ms
        by_spare = sorted(used, key=lambda d: -self._budget_ms(d, T))
        failure = None
        for k in range(1, len(by_spare) + 1):
            plan, failure = self._pack(sid, req, by_spare[:k])
            if plan is not None and self._latency_failure(plan, req) is None:
                return plan, failure
        return None, failure

    def _open_devices(self) -> list[int]:
        """Devices a stream may be packed on (not held exclusively by a ``fastest`` one)."""
        return [d for d in range(self.pool.num_devices) if d not in self._exclusive]

    def _fastest(self, sid: int, req: StreamRequest) -> tuple[StreamPlan | None, Failure]:
        """Target interval 0: the shortest interval an exclusive group of free devices gives
        within the latency budget (depth 1.. as many free devices as there are stages)."""
        budget = budget_bound(req.latency_budget_ms)
        free = [d for d in self._open_devices() if not self._on_device[d]]
        S = req.sampler.steps * req.model.num_blocks
        best: tuple[float, StreamPlan] | None = None
        late: tuple[float, float, int] | None = None  # (response, interval, depth) least late
        short: float | None = None
        for depth in range(1, min(len(free), S) + 1):
            probe = self._plan(sid, req, contiguous_split(S, free[:depth]))
            need = max(self.pool.memory.device_usage([probe], d).total for d in probe.devices())
            if need > self.pool.usable_bytes:
                short = need if short is None else min(short, need)
                continue
            interval, latency = self.predict(probe)
            response = self.response_ms(interval, latency)
            if response > budget:
                if late is None or response < late[0]:
                    late = (response, interval, depth)
                continue
            if best is None or interval < best[0] * (1 - 1e-9):
                best = (interval, replace(probe, target_interval_ms=interval))
        if best is not None:
            return best[1], Failure("", "", "")
        if late is not None:
            response, interval, depth = late
            return None, Failure(
                resource="latency",
                reason=(
                    f"latency: response latency {response:.1f} ms > budget {budget:.1f} ms at "
                    f"every depth on the {len(free)} free device(s) (best: depth {depth}, "
                    f"interval {interval:.1f} ms)"
                ),
                shortfall=f"{response - budget:.1f} ms",
            )
        if short is not None:
            gap = (short - self.pool.usable_bytes) / GIB
            return None, Failure(
                resource="memory",
                reason=f"memory: the stream needs {short / GIB:.2f} GiB on a device of the "
                f"{len(free)} free device(s), short by {gap:.2f} GiB",
                shortfall=f"{gap:.2f} GiB",
            )
        return None, Failure(
            resource="compute",
            reason="compute: no free device for a stream as fast as free devices allow",
            shortfall="1 devices",
        )

    def predict(self, plan: StreamPlan) -> tuple[float, float]:
        """(interval, pipeline latency) of ``plan`` running alone as fast as it goes: the
        busiest device's work per chunk (and its link's, where sends overlap compute), and
        the no-contention latency. A caller with a better predictor (the simulator,
        calibrated on the real runtime) replaces this method."""
        load = self.device_load_ms(plan)
        interval = max(load.values())
        if self.cost.comm_overlaps_compute:
            hops = [self.cost.hop_ms(plan.model, a, b) for _, a, b in plan.hops()]
            interval = max([interval, *hops])
        return interval, self.no_contention_latency_ms(plan)

    def close(self, stream_id: int) -> None:
        """Free the stream's compute and memory (weights go when no stream uses them)."""
        try:
            plan = self.plans.pop(stream_id)
        except KeyError:
            raise ValueError(f"stream {stream_id} is not admitted") from None
        self._budgets.pop(stream_id, None)
        self._exclusive.difference_update(plan.stage_devices)
        for d, ms in self.device_load_ms(plan).items():
            self._util[d] = max(0.0, self._util[d] - ms / plan.target_interval_ms)
            del self._on_device[d][stream_id]
            self._held_cache.pop(d, None)
            if not self._on_device[d]:
                self._util[d] = 0.0  # drop float residue on an empty device
            self._mem_used[d] = self.pool.memory.device_usage(self._on_device[d].values(), d).total

    def _commit(self, plan: StreamPlan) -> None:
        self.plans[plan.stream_id] = plan
        for d, ms in self.device_load_ms(plan).items():
            self._util[d] += ms / plan.target_interval_ms
            self._on_device[d][plan.stream_id] = plan
            self._held_cache.pop(d, None)
            usage = self.pool.memory.device_usage(self._on_device[d].values(), d)
            if usage.total > self.pool.usable_bytes:
                raise RuntimeError(f"internal: device {d} overcommitted by the packer")
            self._mem_used[d] = usage.total

    # ---- candidates ----------------------------------------------------------------------
    def _plan(self, sid: int, req: StreamRequest, stage_devices: tuple[int, ...]) -> StreamPlan:
        return StreamPlan(
            stream_id=sid,
            model=req.model,
            sampler=req.sampler,
            target_interval_ms=req.target_interval_ms,
            stage_devices=stage_devices,
            chunks_per_interval=req.chunks_per_interval,
            rollout=req.rollout,
        )
