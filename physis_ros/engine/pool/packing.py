"""Candidate placements of one new stream in the pool's spare capacity.

``SparePacker`` is the part of ``AdmissionController`` (admission.py) that reads the pool's
committed compute and memory (``_util``, ``_mem_used``, ``_on_device``, set by the
controller) to place one new stream: the smallest exclusive group of empty devices that
meets the target alone (``_fresh_group``, the static baseline's placement), or the greedy
packing stage by stage in pipeline order into spare compute and memory, staying on a device
while it has room (``_pack``); each says which resource ran out when it cannot place it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from physis_ros.engine.pool.costmodel import GIB
from physis_ros.engine.pool.memory import StageCharge
from physis_ros.engine.pool.plan import StreamPlan, block_split, contiguous_split
from physis_ros.engine.pool.terms import StreamRequest


@dataclass
class Failure:
    """Why a candidate placement is not possible (the refusal's fields)."""

    resource: str
    reason: str
    shortfall: str


class SparePacker:
    """Packing into spare compute and memory (module docstring); needs the controller's
    ``pool``, ``cost``, ``_util``, ``_mem_used``, ``_on_device``, ``_held_cache``,
    ``stage_ms``, ``_comm_ms``, ``_plan`` and ``device_load_ms``."""

    def _budget_ms(self, d: int, T: float) -> float:
        return max(0.0, (self.pool.max_utilization - self._util[d]) * T)

    def _fresh_group(self, sid: int, req: StreamRequest) -> tuple[StreamPlan | None, Failure]:
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
            return None, Failure(
                resource="compute",
                reason=f"compute: {shown} device(s), an exclusive group needs {g_need}",
                shortfall=f"{g_need - len(empty)} devices",
            )
        layout = layout_or_failure
        devices = empty[:g_need]
        S = req.sampler.steps * req.model.num_blocks
        stage_devices = tuple(devices[i] for i in layout)
        assert len(stage_devices) == S
        return self._plan(sid, req, stage_devices), Failure("", "", "")

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
            return None, Failure(
                resource="memory",
                reason=(
                    f"memory on device 0 short by {short:.2f} GiB: the stream alone needs "
                    f"{worst_mem[1] / GIB:.2f} GiB per device on {worst_mem[0]} devices"
                ),
                shortfall=f"{short:.2f} GiB",
            )
        best = self._alone_interval_ms(req, min(S, self.pool.num_devices))
        best /= self.pool.max_utilization
        return None, Failure(
            resource="compute",
            reason=(
                f"compute: interval {best:.1f} ms > target {T:.1f} ms even alone on all "
                f"{self.pool.num_devices} devices (at {self.pool.max_utilization:.0%} utilization)"
            ),
            shortfall=f"{best - T:.1f} ms",
        )

    def _check_fits(self, plan: StreamPlan) -> Failure | None:
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
                return Failure(
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
                return Failure(
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
    ) -> tuple[StreamPlan | None, Failure]:
        """Greedy placement of stages in pipeline order into spare compute and memory.

        Stays on the current device while it has room (fewest hops); otherwise moves to the
        candidate that already holds the block's weights and has the most spare compute.
        """
        cfg, sampler, T = req.model, req.sampler, req.target_interval_ms
        L, S = cfg.num_blocks, sampler.steps * cfg.num_blocks
        # A stage's work per interval: one forward per chunk that passes it.
        s_ms = self.stage_ms(cfg, sampler) * req.chunks_per_interval
        # One hop in and one out are reserved on every device when messages cost compute.
        reserve = sum(self._comm_ms(cfg)) * req.chunks_per_interval if len(candidates) > 1 else 0.0
        budget = {d: self._budget_ms(d, T) - reserve for d in candidates}
        free = {d: self.pool.usable_bytes - self._mem_used[d] for d in candidates}
        charges = self._charges(req, candidates)
        total_spare = sum(max(0.0, b) for b in budget.values())
        if total_spare < S * s_ms:
            interval = S * s_ms / max(total_spare / T, 1e-12)
            return None, Failure(
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
        over = self._over_budget(plan)
        return (None, over) if over else (plan, Failure("", "", ""))

    def _charges(self, req: StreamRequest, candidates: list[int]) -> dict[int, StageCharge]:
        """Per candidate device, what each stage of ``req`` would cost its memory given the
        blocks, edges and workspace it holds now."""
        charges = {}
        for d in candidates:
            blocks, edges, ws = self._held(d)
            charges[d] = StageCharge(
                mem=self.pool.memory,
                cfg=req.model,
                sampler=req.sampler,
                held_blocks=blocks,
                held_edges=edges,
                workspace_now=ws,
            )
        return charges

    def _over_budget(self, plan: StreamPlan) -> Failure | None:
        """A device ``plan`` would keep busy beyond its spare compute (its sends beyond the
        one reserved), if any."""
        T = plan.target_interval_ms
        for d, ms in self.device_load_ms(plan).items():
            if ms > self._budget_ms(d, T) + 1e-9:
                return Failure(
                    resource="compute",
                    reason=(
                        f"compute: device {d} would be busy {ms:.1f} ms per interval with "
                        f"{self._budget_ms(d, T):.1f} ms spare (target {T:.1f} ms)"
                    ),
                    shortfall=f"{ms - self._budget_ms(d, T):.1f} ms",
                )
        return None

    @staticmethod
    def _stuck(i, L, s_ms, S, T, *, short, budget, free, charges, cur) -> Failure:
        """Why stage i found no device: memory (where compute was left) or compute.

        The memory shortfall is what the device with the most spare compute lacks to hold
        all remaining stages (i..S-1) of the stream."""
        if short:
            d, _ = max(short, key=lambda dn: budget[dn[0]])
            rest = charges[d].clone()
            need = sum(rest.add(j, j == i and cur is not None and d != cur) for j in range(i, S))
            gap = (need - free[d]) / GIB
            step, blk = divmod(i, L)
            return Failure(
                resource="memory",
                reason=(
                    f"memory on device {d} short by {gap:.3f} GiB: stages ({step},{blk}).. "
                    f"of the stream need {need / GIB:.3f} GiB, "
                    f"{max(free[d], 0) / GIB:.3f} GiB free"
                ),
                shortfall=f"{gap:.3f} GiB",
            )
        placed = i * s_ms
        return Failure(
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
