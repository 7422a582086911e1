"""Admission control for a pool of devices shared by many streams (runs on rank 0).

A new stream is admitted only if its K*L stages can be placed in the pool's *spare* memory
and compute without moving admitted streams, such that every device keeps its work per
interval under ``max_utilization`` of every stream's target interval. Otherwise
``AdmissionRefused`` names the resource that ran out and by how much.

Policies:
- ``static``: each stream gets an exclusive group of empty devices, the smallest that
  meets its target alone (the baseline).
- ``shared``: streams of the same model share devices (weights loaded once per device,
  ready tasks of a block batched across streams). Candidates, in order: (1) pack into the
  spare capacity of devices already in use; (2) the static candidate, a fresh exclusive group
  of the static size; (3) pack into any spare capacity. A static partition is one of the
  placements this search can produce, so shared never admits fewer streams than static: it
  takes empty devices only in static-sized groups until fewer than a group remain.

Compute per device is charged unbatched by default (one ``group_ms(1)`` per stage per
interval): a conservative bound, since batching only makes work cheaper; or per task of a
batch of ``PoolConfig.charged_batch``; the simulator then checks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from physis_ros.engine.api import AdmissionRefused
from physis_ros.engine.config import ModelConfig, SamplerConfig
from physis_ros.engine.pool.costmodel import GIB, CostModel
from physis_ros.engine.pool.memory import MemoryModel, StageCharge
from physis_ros.engine.pool.plan import StreamPlan, block_split, contiguous_split

POLICIES = ("shared", "static")


@dataclass(frozen=True, kw_only=True)
class PoolConfig:
    num_devices: int
    """G: devices in the pool."""
    usable_bytes: float
    """Memory per device that streams may use (capacity minus runtime reserve)."""
    policy: str = "shared"
    """``shared`` or ``static``."""
    max_utilization: float = 0.9
    """Most of each interval a device may be busy with admitted work (headroom for jitter)."""
    memory: MemoryModel = field(default_factory=MemoryModel)
    charged_batch: int = 1
    """Tasks per batched forward the compute charge counts on: a stage is charged
    ``group_ms(b) / b`` per chunk. 1 charges every stage unbatched, a bound (batching only
    makes work cheaper); more counts on the batching a pipelined stream gets (a block's
    stages at different steps run together), which the simulator then has to confirm."""
    controller_device: int | None = None
    """Device whose worker shares its processor with the controller (rank 0 of a CPU job):
    every stream's entry and exit hops and its per-chunk controller work are charged there,
    as far as the cost model says messages cost compute. None: not charged (GPU pools, where
    the controller and the transport run beside the devices' compute)."""

    def __post_init__(self) -> None:
        if self.num_devices < 1:
            raise ValueError(f"num_devices must be >= 1, got {self.num_devices}")
        if self.controller_device is not None and not (
            0 <= self.controller_device < self.num_devices
        ):
            raise ValueError(
                f"controller_device {self.controller_device} outside 0..{self.num_devices - 1}"
            )
        if not self.usable_bytes > 0:
            raise ValueError(f"usable_bytes must be > 0, got {self.usable_bytes}")
        if self.policy not in POLICIES:
            raise ValueError(f"policy {self.policy!r} is not one of {POLICIES}")
        if not 0 < self.max_utilization <= 1:
            raise ValueError(f"max_utilization must be in (0, 1], got {self.max_utilization}")
        if self.charged_batch < 1:
            raise ValueError(f"charged_batch must be >= 1, got {self.charged_batch}")


@dataclass(frozen=True, kw_only=True)
class StreamRequest:
    model: ModelConfig
    sampler: SamplerConfig
    target_interval_ms: float
    chunks_per_interval: int = 1
    """Chunks through every stage per interval (2: each generated chunk comes with a context
    chunk, the observation it is conditioned on)."""

    def __post_init__(self) -> None:
        if self.chunks_per_interval < 1:
            raise ValueError(f"chunks_per_interval must be >= 1, got {self.chunks_per_interval}")
        if not self.target_interval_ms > 0:
            raise ValueError(
                f"admission needs a target_interval_ms > 0, got {self.target_interval_ms}"
            )


@dataclass(frozen=True, kw_only=True)
class Admission:
    """The promise made to an admitted stream."""

    plan: StreamPlan
    candidate: str
    """Which search candidate placed it: packed-used, fresh-group, packed-any, static."""
    expected_interval_ms: float
    no_contention_latency_ms: float
    """One chunk through every stage and hop with no other work queued."""
    expected_response_latency_ms: float
    """No-contention latency plus one target interval of queueing behind other streams."""
    pipeline_depth: int
    """Chunks in flight at once in steady state."""


@dataclass
class _Failure:
    resource: str
    reason: str
    shortfall: str


class AdmissionController:
    """Admits and closes streams on a pool; owns the pool's committed compute and memory."""

    def __init__(self, pool: PoolConfig, cost: CostModel) -> None:
        self.pool = pool
        self.cost = cost
        G = pool.num_devices
        self.plans: dict[int, StreamPlan] = {}
        self._util = [0.0] * G
        self._on_device: list[dict[int, StreamPlan]] = [{} for _ in range(G)]
        self._mem_used = [0] * G
        self._next_id = 0
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
        s_ms = self.stage_ms(plan.model, plan.sampler)
        hops = sum(self.cost.hop_ms(plan.model, a, b) for _, a, b in plan.hops())
        return plan.num_stages * s_ms + hops

    # ---- admission -----------------------------------------------------------------------
    def admit(self, req: StreamRequest, stage_devices: tuple[int, ...] | None = None) -> Admission:
        """Place the stream or raise ``AdmissionRefused``; admitted streams never move.

        ``stage_devices``: a placement given by hand (device of stage i = k * L + l); it is
        checked against the spare compute and memory instead of searched for."""
        sid = self._next_id
        if stage_devices is not None:
            plan = self._plan(sid, req, tuple(stage_devices))
            failure = self._check_fits(plan)
            candidate = "given"
            if failure is not None:
                plan = None
        elif self.pool.policy == "static":
            plan, failure = self._fresh_group(sid, req)
            candidate = "static"
        else:
            plan, failure, candidate = None, None, ""
            used = [d for d in range(self.pool.num_devices) if self._on_device[d]]
            if used:
                plan, failure = self._pack(sid, req, used)
                candidate = "packed-used"
            if plan is None:
                plan, fresh_failure = self._fresh_group(sid, req)
                candidate = "fresh-group"
                failure = failure or fresh_failure
            if plan is None:
                plan, any_failure = self._pack(sid, req, list(range(self.pool.num_devices)))
                candidate = "packed-any"
                failure = any_failure
        if plan is None:
            assert failure is not None
            raise AdmissionRefused(
                failure.reason, resource=failure.resource, shortfall=failure.shortfall
            )
        self._commit(plan)
        self._next_id += 1
        latency = self.no_contention_latency_ms(plan)
        T = req.target_interval_ms
        return Admission(
            plan=plan,
            candidate=candidate,
            expected_interval_ms=T,
            no_contention_latency_ms=latency,
            expected_response_latency_ms=latency + T,
            pipeline_depth=max(1, math.ceil(latency / T)),
        )

    def close(self, stream_id: int) -> None:
        """Free the stream's compute and memory (weights go when no stream uses them)."""
        try:
            plan = self.plans.pop(stream_id)
        except KeyError:
            raise ValueError(f"stream {stream_id} is not admitted") from None
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
    def _budget_ms(self, d: int, T: float) -> float:
        return max(0.0, (self.pool.max_utilization - self._util[d]) * T)

    def _fresh_group(self, sid: int, req: StreamRequest) -> tuple[StreamPlan | None, _Failure]:
        """The smallest group of empty devices that meets the target alone."""
        empty = [d for d in range(self.pool.num_devices) if not self._on_device[d]]
        g_need, layout_or_failure = self.static_group(req)
        if g_need is None:
            return None, layout_or_failure
        if len(empty) < g_need:
            T = req.target_interval_ms
            if empty:
                best = self._alone_interval_ms(req, len(empty)) / self.pool.max_utilization
                shown = f"interval {best:.1f} ms > target {T:.1f} ms on the {len(empty)} free"
            else:
                shown = f"no free device for an exclusive group (target {T:.1f} ms); 0 free"
            return None, _Failure(
                resource="compute",
                reason=f"compute: {shown} device(s), an exclusive group needs {g_need}",
                shortfall=f"{g_need - len(empty)} devices",
            )
        layout = layout_or_failure
        devices = empty[:g_need]
        S = req.sampler.steps * req.model.num_blocks
        stage_devices = tuple(devices[i] for i in layout)
        assert len(stage_devices) == S
        return self._plan(sid, req, stage_devices), _Failure("", "", "")

    def _alone_interval_ms(self, req: StreamRequest, g: int) -> float:
        if g == 0:
            return math.inf
        S = req.sampler.steps * req.model.num_blocks
        per_chunk = math.ceil(S / g) * self.stage_ms(req.model, req.sampler)
        return per_chunk * req.chunks_per_interval

    def static_group(self, req: StreamRequest):
        """(g, layout) of the smallest exclusive group meeting the target alone, or
        (None, failure). ``layout[i]`` is the group-local device of stage i."""
        cfg, sampler, T = req.model, req.sampler, req.target_interval_ms
        K, L, S = sampler.steps, cfg.num_blocks, sampler.steps * cfg.num_blocks
        mem = self.pool.memory
        worst_mem: tuple[int, int] | None = None
        for g in range(1, min(S, self.pool.num_devices) + 1):
            for layout in (contiguous_split(S, list(range(g))), block_split(K, L, list(range(g)))):
                plan = self._plan(-1, req, layout)
                load = self.device_load_ms(plan)
                if max(load.values()) > self.pool.max_utilization * T:
                    continue
                usage = max(mem.device_usage([plan], d).total for d in range(g))
                if usage <= self.pool.usable_bytes:
                    return g, layout
                if worst_mem is None or usage < worst_mem[1]:
                    worst_mem = (g, usage)
        if worst_mem is not None:
            short = (worst_mem[1] - self.pool.usable_bytes) / GIB
            return None, _Failure(
                resource="memory",
                reason=(
                    f"memory on device 0 short by {short:.2f} GiB: the stream alone needs "
                    f"{worst_mem[1] / GIB:.2f} GiB per device on {worst_mem[0]} devices"
                ),
                shortfall=f"{short:.2f} GiB",
            )
        best = self._alone_interval_ms(req, min(S, self.pool.num_devices))
        best /= self.pool.max_utilization
        return None, _Failure(
            resource="compute",
            reason=(
                f"compute: interval {best:.1f} ms > target {T:.1f} ms even alone on all "
                f"{self.pool.num_devices} devices (at {self.pool.max_utilization:.0%} utilization)"
            ),
            shortfall=f"{best - T:.1f} ms",
        )

    def _plan(self, sid: int, req: StreamRequest, stage_devices: tuple[int, ...]) -> StreamPlan:
        return StreamPlan(
            stream_id=sid,
            model=req.model,
            sampler=req.sampler,
            target_interval_ms=req.target_interval_ms,
            stage_devices=stage_devices,
            chunks_per_interval=req.chunks_per_interval,
        )

    def _check_fits(self, plan: StreamPlan) -> _Failure | None:
        """Why a given placement does not fit the spare compute and memory (None: it fits)."""
        if max(plan.stage_devices) >= self.pool.num_devices:
            raise ValueError(
                f"placement names device {max(plan.stage_devices)}; the pool has "
                f"{self.pool.num_devices}"
            )
        T = plan.target_interval_ms
        for d, ms in sorted(self.device_load_ms(plan).items()):
            spare = self._budget_ms(d, T)
            if ms > spare + 1e-9:
                return _Failure(
                    resource="compute",
                    reason=(
                        f"compute: device {d} would be busy {ms:.1f} ms per interval with "
                        f"{spare:.1f} ms spare (target {T:.1f} ms, at "
                        f"{self.pool.max_utilization:.0%} utilization)"
                    ),
                    shortfall=f"{ms - spare:.1f} ms",
                )
        for d in plan.devices():
            usage = self.pool.memory.device_usage([*self._on_device[d].values(), plan], d)
            if usage.total > self.pool.usable_bytes:
                short = (usage.total - self.pool.usable_bytes) / GIB
                return _Failure(
                    resource="memory",
                    reason=(
                        f"memory on device {d} short by {short:.3f} GiB: it would hold "
                        f"{usage.total / GIB:.3f} GiB of {self.pool.usable_bytes / GIB:.3f} GiB"
                    ),
                    shortfall=f"{short:.3f} GiB",
                )
        return None

    def _pack(
        self, sid: int, req: StreamRequest, candidates: list[int]
    ) -> tuple[StreamPlan | None, _Failure]:
        """Greedy placement of stages in pipeline order into spare compute and memory.

        Stays on the current device while it has room (fewest hops); otherwise moves to the
        candidate that already holds the block's weights and has the most spare compute.
        """
        cfg, sampler, T = req.model, req.sampler, req.target_interval_ms
        L, S = cfg.num_blocks, sampler.steps * cfg.num_blocks
        # A stage's work per interval: one forward per chunk that passes it.
        s_ms = self.stage_ms(cfg, sampler) * req.chunks_per_interval
        mem = self.pool.memory
        # One hop in and one out are reserved on every device when messages cost compute.
        reserve = sum(self._comm_ms(cfg)) * req.chunks_per_interval if len(candidates) > 1 else 0.0
        budget = {d: self._budget_ms(d, T) - reserve for d in candidates}
        free = {d: self.pool.usable_bytes - self._mem_used[d] for d in candidates}
        charges: dict[int, StageCharge] = {}
        for d in candidates:
            blocks, edges, ws = self._held(d)
            charges[d] = StageCharge(
                mem=mem,
                cfg=cfg,
                sampler=sampler,
                held_blocks=blocks,
                held_edges=edges,
                workspace_now=ws,
            )
        total_spare = sum(max(0.0, b) for b in budget.values())
        if total_spare < S * s_ms:
            interval = S * s_ms / max(total_spare / T, 1e-12)
            return None, _Failure(
                resource="compute",
                reason=(
                    f"compute: interval {interval:.1f} ms > target {T:.1f} ms with the spare "
                    f"compute of {len(candidates)} device(s) ({total_spare:.1f} ms per "
                    f"interval free, the stream needs {S * s_ms:.1f} ms)"
                ),
                shortfall=f"{interval - T:.1f} ms",
            )
        stage_devices: list[int] = []
        cur: int | None = None
        for i in range(S):
            if cur is not None and budget[cur] >= s_ms and charges[cur].cost(i, False) <= free[cur]:
                d = cur
            else:
                block = i % L
                fits, short = [], []
                for d in candidates:
                    if budget[d] < s_ms:  # cur lands here only when its memory is short
                        continue
                    need = charges[d].cost(i, i > 0 and d != cur)
                    (fits if need <= free[d] else short).append((d, need))
                if not fits:
                    return None, self._stuck(
                        i,
                        L,
                        s_ms,
                        S,
                        T,
                        short=short,
                        budget=budget,
                        free=free,
                        charges=charges,
                        cur=cur,
                    )
                d, _ = max(fits, key=lambda dn: (charges[dn[0]].holds(block), budget[dn[0]]))
            inbound = cur is not None and d != cur
            free[d] -= charges[d].add(i, inbound)
            budget[d] -= s_ms
            stage_devices.append(d)
            cur = d
        plan = self._plan(sid, req, tuple(stage_devices))
        for d, ms in self.device_load_ms(plan).items():
            if ms > self._budget_ms(d, T) + 1e-9:  # sends beyond the reserved one
                return None, _Failure(
                    resource="compute",
                    reason=(
                        f"compute: device {d} would be busy {ms:.1f} ms per interval with "
                        f"{self._budget_ms(d, T):.1f} ms spare (target {T:.1f} ms)"
                    ),
                    shortfall=f"{ms - self._budget_ms(d, T):.1f} ms",
                )
        return plan, _Failure("", "", "")

    @staticmethod
    def _stuck(i, L, s_ms, S, T, *, short, budget, free, charges, cur) -> _Failure:
        """Why stage i found no device: memory (where compute was left) or compute.

        The memory shortfall is what the device with the most spare compute lacks to hold
        all remaining stages (i..S-1) of the stream."""
        if short:
            d, _ = max(short, key=lambda dn: budget[dn[0]])
            rest = charges[d].clone()
            need = sum(rest.add(j, j == i and cur is not None and d != cur) for j in range(i, S))
            gap = (need - free[d]) / GIB
            step, blk = divmod(i, L)
            return _Failure(
                resource="memory",
                reason=(
                    f"memory on device {d} short by {gap:.3f} GiB: stages ({step},{blk}).. "
                    f"of the stream need {need / GIB:.3f} GiB, "
                    f"{max(free[d], 0) / GIB:.3f} GiB free"
                ),
                shortfall=f"{gap:.3f} GiB",
            )
        placed = i * s_ms
        return _Failure(
            resource="compute",
            reason=(
                f"compute: spare compute is fragmented: {placed:.1f} of {S * s_ms:.1f} ms per "
                f"interval placed, no device has {s_ms:.1f} ms left for the next stage "
                f"(target {T:.1f} ms)"
            ),
            shortfall=f"{S * s_ms - placed:.1f} ms",
        )

    def _held(self, d: int) -> tuple[set[tuple[str, int]], set[str], int]:
        if d not in self._held_cache:
            self._held_cache[d] = self._held_uncached(d)
        return self._held_cache[d]

    def _held_uncached(self, d: int) -> tuple[set[tuple[str, int]], set[str], int]:
        blocks: set[tuple[str, int]] = set()
        edges: set[str] = set()
        ws = 0
        for plan in self._on_device[d].values():
            L = plan.model.num_blocks
            bl = {i % L for i in plan.stages_on(d)}
            blocks.update((plan.model.name, b) for b in bl)
            if 0 in bl or L - 1 in bl:
                edges.add(plan.model.name)
            ws = max(ws, self.pool.memory.workspace_bytes(plan.model))
        return blocks, edges, ws
