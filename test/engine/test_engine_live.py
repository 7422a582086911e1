"""The live timeline (DESIGN.md §3): observations replace predicted slots while chunks are in
flight; every executor equals the live oracle (<= 1e-5) and gives each chunk its anchor."""

from __future__ import annotations

import pytest
from engine_helpers import SAMPLER, TOL
from live_helpers import (
    live_plan,
    replaced_slots,
    run_live_inline,
    run_live_threads,
    worst_live_error,
)

from physis_ros.engine import oracle
from physis_ros.engine.config import SamplerConfig
from physis_ros.engine.controller import MODES
from physis_ros.engine.forward import make_cond
from physis_ros.engine.placement import layout_by_block, layout_groups, layout_single
from physis_ros.engine.threads import InProcRuntime

K, L = SAMPLER.steps, 2
LAYOUTS = {
    "one-worker": layout_single(K, L),
    "uneven-groups": layout_groups(K, L, [1, 3, 2]),
    "by-block": layout_by_block(K, L, [1, 1]),
}


def _layout(mode: str, name: str):
    return LAYOUTS["by-block"] if mode == "sequential-clean" else LAYOUTS[name]


@pytest.mark.parametrize("horizon", [1, 2, 4])
def test_live_plans_replace_predicted_slots(tiny, horizon):
    """The plans the tests below run do what they are for (the check can fail)."""
    plan = live_plan(tiny, 0, horizon=horizon, observations=6)
    assert replaced_slots(plan, SAMPLER.window) >= (2 if horizon > 1 else 0)
    vs = oracle.versions(plan, SAMPLER.window)
    gen = [v for v in vs if not v.observed]
    assert all(1 <= v.slot - v.anchor <= horizon for v in gen)
    # a prediction read after its slot was observed is not what a later chunk reads
    if horizon > 1:
        noisy = oracle.sample(
            tiny, SAMPLER, plan, mode="pipelined", seed=7, cond=make_cond(tiny.cfg, 70)
        )
        stale = [("observe", 0, plan[0][2])] + [("generate", None)] * max(noisy)
        old = oracle.sample(
            tiny, SAMPLER, stale, mode="pipelined", seed=7, cond=make_cond(tiny.cfg, 70)
        )
        assert max((noisy[c] - old[c]).abs().max().item() for c in noisy) > 1e-3


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("layout", ["one-worker", "uneven-groups"])
@pytest.mark.parametrize("batching", [False, True])
def test_inline_executors_equal_the_live_oracle(tiny, mode, layout, batching):
    horizon = 3
    rt = InProcRuntime(tiny, SAMPLER, _layout(mode, layout), batching=batching)
    plans = {s: live_plan(tiny, s, horizon=horizon) for s in range(3)}
    out, feed = run_live_inline(rt, plans, mode=mode, horizon=horizon, seed=len(layout))
    assert feed.mid_flight > 5  # observations did arrive while chunks were in flight
    assert worst_live_error(tiny, SAMPLER, plans, out, mode=mode) <= TOL
    assert all(not w.stats.drops for w in rt.workers), [w.stats.drops for w in rt.workers]


@pytest.mark.parametrize("mode", MODES)
def test_threaded_workers_equal_the_live_oracle(tiny, mode):
    horizon = 2
    rt = InProcRuntime(tiny, SAMPLER, _layout(mode, "uneven-groups"), batching=True)
    plans = {s: live_plan(tiny, s, horizon=horizon, observations=8) for s in range(2)}
    out, feed = run_live_threads(rt, plans, mode=mode, horizon=horizon)
    assert feed.mid_flight > 5
    assert worst_live_error(tiny, SAMPLER, plans, out, mode=mode) <= TOL


def test_throttled_pipeline_equals_the_live_oracle(tiny):
    horizon = 4
    rt = InProcRuntime(tiny, SAMPLER, LAYOUTS["uneven-groups"], batching=True)
    plans = {s: live_plan(tiny, s, horizon=horizon, observations=7) for s in range(2)}
    out, _ = run_live_inline(rt, plans, mode="pipelined", horizon=horizon, max_in_flight=2)
    assert worst_live_error(tiny, SAMPLER, plans, out, mode="pipelined") <= TOL


def test_action_conditioned_model_equals_the_live_oracle(tiny_condition):
    horizon = 3
    rt = InProcRuntime(tiny_condition, SAMPLER, LAYOUTS["uneven-groups"], batching=True)
    plans = {s: live_plan(tiny_condition, s, horizon=horizon, with_actions=True) for s in range(2)}
    out, _ = run_live_inline(rt, plans, mode="pipelined", horizon=horizon)
    assert worst_live_error(tiny_condition, SAMPLER, plans, out, mode="pipelined") <= TOL


@pytest.mark.parametrize("model_name", ["tiny", "tiny_x0"])
def test_noised_context_equals_the_live_oracle(request, model_name):
    """Observations noised to each step's level (a model trained so) follow the oracle too,
    and differ from clean ones."""
    model = request.getfixturevalue(model_name)
    sampler = SamplerConfig(steps=3, window=2, shift=3.0, context_noise="noised")
    horizon = 2
    rt = InProcRuntime(model, sampler, LAYOUTS["uneven-groups"], batching=True)
    plans = {s: live_plan(model, s, horizon=horizon) for s in range(2)}
    out, _ = run_live_inline(rt, plans, mode="pipelined", horizon=horizon)
    assert worst_live_error(model, sampler, plans, out, mode="pipelined") <= TOL
    clean = SamplerConfig(steps=3, window=2, shift=3.0)
    ref_clean = oracle.sample(
        model, clean, plans[0], mode="pipelined", seed=7, cond=make_cond(model.cfg, 70)
    )
    assert max((out[0][c].x - x).abs().max().item() for c, x in ref_clean.items()) > 1e-3


def test_longer_window_with_a_ring_that_wraps(tiny):
    """W = 4, h = 3: the rings hold 7 entries, a window of 5 wraps around their end."""
    sampler = SamplerConfig(steps=2, window=4, shift=3.0)
    horizon = 3
    rt = InProcRuntime(tiny, sampler, layout_groups(2, L, [3, 1]), batching=True)
    plans = {0: live_plan(tiny, 0, horizon=horizon, observations=12)}
    out, _ = run_live_inline(rt, plans, mode="pipelined", horizon=horizon)
    assert worst_live_error(tiny, sampler, plans, out, mode="pipelined") <= TOL


def test_controller_refuses_what_the_timeline_forbids(tiny):
    rt = InProcRuntime(tiny, SAMPLER, LAYOUTS["one-worker"])
    rt.open_stream(0, horizon=2)
    ctl = rt.controller
    x = plans_x = live_plan(tiny, 0, horizon=2)[0][2]  # an observed chunk's packed state
    assert ctl.submit_context(0, x, slot=0) == 0
    assert [ctl.submit_generate(0), ctl.submit_generate(0)] == [1, 2]
    with pytest.raises(ValueError, match="horizon is 2"):
        ctl.submit_generate(0)
    with pytest.raises(ValueError, match="can be observed"):
        ctl.submit_context(0, plans_x, slot=0)  # not after the newest observation
    with pytest.raises(ValueError, match="can be observed"):
        ctl.submit_context(0, plans_x, slot=4)  # slot 3 would have no version
    assert ctl.submit_context(0, plans_x, slot=2) == 2  # replaces the prediction, skips 1
    assert ctl.anchor(0) == 2 and ctl.next_slot(0) == 3
    rt.open_stream(1)  # no horizon: offline generation, observations only take new slots
    ctl.submit_context(1, x)
    ctl.submit_generate(1)
    with pytest.raises(ValueError, match="only a stream with a horizon"):
        ctl.submit_context(1, x, slot=1)
