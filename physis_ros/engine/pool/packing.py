"""The pool's spare capacity and the greedy packer that places a stream's stages into it.

``SparePacker`` is the part of ``AdmissionController`` (admission.py) that reads the pool's
committed compute and memory (``_util``, ``_mem_used``, ``_on_device``, set by the
controller) to place one new stream: stage by stage in pipeline order, staying on a device
while it has room, and saying which resource ran out when no device can take the next stage.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from physis_ros.engine.pool.costmodel import GIB
from physis_ros.engine.pool.memory import StageCharge
from physis_ros.engine.pool.plan import StreamPlan

if TYPE_CHECKING:
    from physis_ros.engine.pool.admission import StreamRequest


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

    def _pack(
        self, sid: int, req: StreamRequest, candidates: list[int]
    ) -> tuple[StreamPlan | None, Failure]:
        """Greedy placement of stages in pipeline order into spare compute and memory.

        Stays on the current device while it has room (fewest hops); otherwise moves to the
        candidate that already holds the block's weights and has the most spare compute.
        """
        cfg, sampler, T = req.model, req.sampler, req.target_interval_ms
        L, S = cfg.num_blocks, sampler.steps * cfg.num_blocks
        s_ms = self.stage_ms(cfg, sampler)
        mem = self.pool.memory
        # One hop in and one out are reserved on every device when messages cost compute.
        reserve = sum(self._comm_ms(cfg)) if len(candidates) > 1 else 0.0
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
        for d, ms in self.device_load_ms(plan).items():
            if ms > self._budget_ms(d, T) + 1e-9:  # sends beyond the reserved one
                return None, Failure(
                    resource="compute",
                    reason=(
                        f"compute: device {d} would be busy {ms:.1f} ms per interval with "
                        f"{self._budget_ms(d, T):.1f} ms spare (target {T:.1f} ms)"
                    ),
                    shortfall=f"{ms - self._budget_ms(d, T):.1f} ms",
                )
        return plan, Failure("", "", "")

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
