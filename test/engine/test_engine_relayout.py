"""Placement changes of a running stream (worker.py ``relayout``): outputs equal the oracle
across the change, KV rings of moved stages follow them, no barrier (workers learn of the
change at different times and hold what they cannot place yet)."""

from __future__ import annotations

import pytest
from engine_helpers import SAMPLER, TOL, plan_for
from live_helpers import live_plan

from physis_ros.engine import oracle
from physis_ros.engine.controller import submit_item
from physis_ros.engine.forward import make_cond
from physis_ros.engine.placement import layout_groups, layout_one_stage_per_worker
from physis_ros.engine.threads import InProcRuntime

K, L = SAMPLER.steps, 2


def _round(rt: InProcRuntime, out: dict) -> None:
    for w in rt.workers:
        w.run_once(0.0)
    for res in rt.drain():
        out[(res.stream_id, res.chunk)] = res


def _run_with_changes(model, start, changes, *, streams=2, stagger=False, batching=True, horizon=0):
    """Open ``streams`` streams on ``start``, queue every chunk (3 in flight at most), and
    after 2, 4, ... finished outputs move stream 0 to the next layout of ``changes``.
    ``stagger``: workers learn of each change one at a time, a round of work apart.
    ``horizon``: live plans (observations replacing predicted slots) instead of offline ones."""
    workers = 1 + max(r for lay in [start, *changes] for row in lay for r in row)
    rt = InProcRuntime(model, SAMPLER, start, num_workers=workers, batching=batching)
    if horizon:
        plans = {s: live_plan(model, s, horizon=horizon) for s in range(streams)}
    else:
        plans = {s: plan_for(model, s) for s in range(streams)}
    for s, plan in plans.items():
        rt.open_stream(
            s, seed=7 + s, cond=make_cond(model.cfg, 70 + s), max_in_flight=3, horizon=horizon
        )
        for item in plan:
            submit_item(rt.controller, s, item)
    rt.controller.pump()
    out: dict = {}
    firsts = []
    pending = list(changes)
    for _ in range(100_000):
        if pending and len(out) >= 2 * (len(changes) - len(pending) + 1):
            layout = pending.pop(0)
            if stagger:
                epoch, first = rt.controller.relayout(0, entry_rank=layout[0][0])
                rt.controller.pump()
                for w in reversed(rt.workers):
                    _round(rt, out)
                    w.relayout(0, epoch=epoch, first_ticket=first, layout=layout)
            else:
                first = rt.relayout(0, layout)
            firsts.append(first)
        _round(rt, out)
        if rt.controller.idle() and not pending:
            break
    got = {s: {c: r for (sid, c), r in out.items() if sid == s} for s in plans}
    worst = 0.0
    for s, plan in plans.items():
        ref = oracle.sample(
            model, SAMPLER, plan, mode="pipelined", seed=7 + s, cond=make_cond(model.cfg, 70 + s)
        )
        assert sorted(got[s]) == sorted(ref)
        worst = max(worst, *((got[s][c].x - x).abs().max().item() for c, x in ref.items()))
    assert all(not w.stats.drops for w in rt.workers), [w.stats.drops for w in rt.workers]
    return worst, firsts, rt


@pytest.mark.parametrize("stagger", [False, True], ids=["together", "staggered"])
def test_live_streams_moving_between_workers_equal_the_live_oracle(tiny, stagger):
    """Observations replacing predicted slots (tickets, not slots, order the stages) across
    placement changes."""
    start = layout_groups(K, L, [3, 3])
    changes = [layout_groups(K, L, [1, 5]), layout_groups(K, L, [5, 1])]
    worst, firsts, rt = _run_with_changes(tiny, start, changes, stagger=stagger, horizon=3)
    assert worst <= TOL
    assert 0 < firsts[0] <= firsts[1]
    assert sum(w.stats.rings_installed for w in rt.workers) == 6


@pytest.mark.parametrize("stagger", [False, True], ids=["together", "staggered"])
def test_two_workers_moving_stages_back_and_forth_equal_the_oracle(tiny, stagger):
    start = layout_groups(K, L, [3, 3])
    changes = [layout_groups(K, L, [1, 5]), layout_groups(K, L, [5, 1])]
    worst, firsts, rt = _run_with_changes(tiny, start, changes, stagger=stagger)
    assert worst <= TOL
    assert 0 < firsts[0] <= firsts[1] < 7  # changed mid-stream, with chunks in flight
    # [3,3] -> [1,5] moves 2 stages to worker 1; [1,5] -> [5,1] moves 4 back to worker 0
    assert sum(w.stats.rings_sent for w in rt.workers) == 6
    assert sum(w.stats.rings_installed for w in rt.workers) == 6
    # staggered: chunks of the new epoch reached workers that had not heard of it yet
    assert (sum(w.stats.held for w in rt.workers) > 0) == stagger


@pytest.mark.parametrize("batching", [False, True])
def test_four_workers_regrouped_and_spread_equal_the_oracle(tiny, batching):
    start = layout_groups(K, L, [1, 2, 2, 1])
    spread = tuple(tuple((k * L + blk) % 4 for blk in range(L)) for k in range(K))
    changes = [spread, layout_groups(K, L, [2, 1, 1, 2])]
    worst, _, rt = _run_with_changes(tiny, start, changes, stagger=True, batching=batching)
    assert worst <= TOL
    assert sum(w.stats.rings_installed for w in rt.workers) > 0


def test_relayout_is_refused_for_clean_history_and_missing_blocks(tiny):
    rt = InProcRuntime(tiny, SAMPLER, layout_groups(K, L, [3, 3]), num_workers=2)
    rt.open_stream(0, mode="sequential-clean", layout=((0, 1),) * K)
    with pytest.raises(ValueError, match="noisy history"):
        rt.relayout(0, layout_groups(K, L, [3, 3]))
    with pytest.raises(ValueError, match="outside"):
        rt.workers[0].relayout(0, epoch=1, first_ticket=0, layout=layout_one_stage_per_worker(K, L))
