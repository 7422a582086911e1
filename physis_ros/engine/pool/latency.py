"""Response latency in admission: what a placement is predicted to give, and what a new stream
costs the latency of the streams already admitted.

Response latency R = I + L (``planner``): an observation waits at most one interval I for its
stream's next slot, and that chunk then takes its pipeline latency L. In a shared pool

    L = no-contention latency + the other streams' work queued ahead of the chunk,

the no-contention latency being every stage and hop (and, where a controller device runs the
front end, the hops in from and out to it). The queued work is predicted per *visit* (a run of
the chunk's stages on one device): under the oldest-chunk-first rule a chunk waits only for
work of chunks released before it, and the other streams put ``util_other * I`` of work per
interval on that device. The pool simulator checks the prediction (``latency_promise_misses``).

Every admission changes the prediction of the streams it shares devices with; a stream that
asked for a budget is never pushed past it (``budget_breaks``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from physis_ros.engine.pool.plan import StreamPlan


def visits(plan: StreamPlan) -> list[int]:
    """The devices a chunk of ``plan`` visits, in order, one entry per run of stages."""
    sd = plan.stage_devices
    return [d for i, d in enumerate(sd) if i == 0 or sd[i - 1] != d]


def queued_ms(plan: StreamPlan, other_util: Callable[[int], float]) -> float:
    """Other streams' work ahead of one chunk of ``plan`` over its visits (module doc)."""
    return sum(max(other_util(d), 0.0) for d in visits(plan)) * plan.target_interval_ms


def budget_bound(budget_ms: float) -> float:
    """A request's latency budget as a bound: 0 (none asked) is no bound."""
    if not budget_ms >= 0 or math.isinf(budget_ms):
        raise ValueError(f"a latency budget must be finite and >= 0 (0: none), got {budget_ms}")
    return math.inf if budget_ms == 0 else budget_ms


@dataclass(frozen=True)
class BudgetBreak:
    stream_id: int
    response_latency_ms: float
    budget_ms: float


def budget_breaks(
    added_util: dict[int, float],
    budgeted: Sequence[tuple[StreamPlan, float, float]],
) -> list[BudgetBreak]:
    """Admitted streams (plan, predicted response latency now, budget) that ``added_util``
    (device -> utilization a new stream adds) would push past their budget."""
    out = []
    for plan, response_ms, budget_ms in budgeted:
        extra = sum(added_util.get(d, 0.0) for d in visits(plan)) * plan.target_interval_ms
        if extra and response_ms + extra > budget_ms:
            out.append(BudgetBreak(plan.stream_id, response_ms + extra, budget_ms))
    return out
