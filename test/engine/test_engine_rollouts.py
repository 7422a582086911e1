"""Rollouts (DESIGN.md §3.1): each observation generates every slot up to its horizon again,
so one slot has several generated versions, each anchored on a newer observation. Every
executor equals the oracle version by version (<= 1e-5), with observations arriving while
the previous rollout is in flight."""

from __future__ import annotations

import pytest
from engine_helpers import SAMPLER, TOL, context_x
from live_helpers import rollout_plan, run_live_inline, run_live_threads, worst_rollout_error

from physis_ros.engine import oracle
from physis_ros.engine.forward import make_cond
from physis_ros.engine.placement import layout_groups, layout_single
from physis_ros.engine.threads import InProcRuntime

K, L = SAMPLER.steps, 2


def test_rollout_plans_generate_slots_again(tiny):
    """The plans below regenerate slots, and a slot's versions differ (the check can fail)."""
    plan = rollout_plan(tiny, 0, horizon=3)
    vs = [v for v in oracle.versions(plan, SAMPLER.window) if not v.observed]
    slots = [v.slot for v in vs]
    assert len(slots) - len(set(slots)) >= 4
    assert all(1 <= v.slot - v.anchor <= 3 for v in vs)
    ref = oracle.sample_noisy(
        tiny, SAMPLER, plan, seed=7, cond=make_cond(tiny.cfg, 70), by_anchor=True
    )
    twice = [s for s in set(slots) if slots.count(s) > 1]
    a, b = sorted(key for key in ref if key[0] == twice[0])[:2]
    assert (ref[a] - ref[b]).abs().max().item() > 1e-3


@pytest.mark.parametrize(
    "layout", [layout_single(K, L), layout_groups(K, L, [1, 3, 2])], ids=["one", "groups"]
)
@pytest.mark.parametrize("batching", [False, True])
def test_inline_executors_equal_the_oracle_version_by_version(tiny, layout, batching):
    horizon = 3
    rt = InProcRuntime(tiny, SAMPLER, layout, batching=batching)
    plans = {s: rollout_plan(tiny, s, horizon=horizon) for s in range(3)}
    out, feed = run_live_inline(
        rt, plans, mode="pipelined", horizon=horizon, seed=len(layout), by_anchor=True
    )
    assert feed.mid_flight > 5
    assert worst_rollout_error(tiny, plans, out) <= TOL
    assert all(not w.stats.drops for w in rt.workers)


def test_threaded_workers_with_commands_equal_the_oracle(tiny_condition):
    horizon = 4
    rt = InProcRuntime(tiny_condition, SAMPLER, layout_groups(K, L, [2, 2, 2]), batching=True)
    plans = {
        s: rollout_plan(tiny_condition, s, horizon=horizon, observations=7, with_actions=True)
        for s in range(2)
    }
    out, feed = run_live_threads(
        rt, plans, mode="pipelined", horizon=horizon, seed=3, by_anchor=True
    )
    assert feed.mid_flight > 5
    assert worst_rollout_error(tiny_condition, plans, out) <= TOL


def test_the_controller_generates_again_only_after_the_newest_observation(tiny):
    rt = InProcRuntime(tiny, SAMPLER, layout_single(K, L))
    rt.open_stream(0, horizon=2)
    ctl = rt.controller
    x = context_x(tiny, 0)
    ctl.submit_context(0, x, slot=0)
    assert [ctl.submit_generate(0), ctl.submit_generate(0)] == [1, 2]
    ctl.submit_context(0, x, slot=1)
    assert ctl.submit_generate(0, slot=2) == 2  # generated again, anchored at slot 1
    assert ctl.submit_generate(0, slot=3) == 3 and ctl.next_slot(0) == 4
    with pytest.raises(ValueError, match="can be generated"):
        ctl.submit_generate(0, slot=1)  # observed: no generating before the newest observation
    with pytest.raises(ValueError, match="can be generated"):
        ctl.submit_generate(0, slot=5)  # slot 4 would have no version
    rt.open_stream(1)  # no horizon: offline generation, every slot once
    ctl.submit_context(1, x)
    ctl.submit_generate(1)
    with pytest.raises(ValueError, match="only a stream with a horizon"):
        ctl.submit_generate(1, slot=1)
