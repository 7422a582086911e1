"""Previews: after each denoising step k < K a generated chunk's x0 estimate reaches the sink,
before the chunk; every executor gives the oracle's estimate (<= 1e-5), and a stream that
did not ask gets none."""

from __future__ import annotations

import pytest
from engine_helpers import SAMPLER, TOL
from live_helpers import LiveFeed, live_plan

from physis_ros.engine import oracle
from physis_ros.engine.forward import make_cond
from physis_ros.engine.placement import layout_groups, layout_single
from physis_ros.engine.threads import InProcRuntime

K, L = SAMPLER.steps, 2


def _run(rt, plans, *, previews, horizon, threads: bool):
    """Feed the live plans (observations arriving mid-flight); every result in arrival
    order per stream."""
    for s in plans:
        rt.open_stream(
            s,
            seed=7 + s,
            cond=make_cond(rt.model.cfg, 70 + s),
            horizon=horizon,
            previews=previews[s],
        )
    feed = LiveFeed(rt, plans, seed=3)
    got: dict = {s: [] for s in plans}

    def take(results):
        for res in results:
            got[res.stream_id].append(res)

    if threads:
        rt.start_threads()
        try:
            while not feed.done():
                feed.submit_some()
                take(rt.drain(wait_s=feed.rng.random() * 0.002))
            take(rt.wait_idle(120.0))
        finally:
            rt.stop_threads()
    else:
        while not feed.done():
            feed.submit_some()
            for _ in range(feed.rng.randrange(4)):
                for w in rt.workers:
                    w.run_once(0.0)
                take(rt.drain())
        take(rt.run_inline())
    return got, feed


def _check(model, sampler, plans, got, previews):
    for s, plan in plans.items():
        ref_previews: dict = {}
        ref = oracle.sample_noisy(
            model,
            sampler,
            plan,
            seed=7 + s,
            cond=make_cond(model.cfg, 70 + s),
            previews=ref_previews,
        )
        finals = {r.chunk: r for r in got[s] if not r.preview_steps}
        shown = {(r.chunk, r.preview_steps): r for r in got[s] if r.preview_steps}
        assert sorted(finals) == sorted(ref)
        for c, x in ref.items():
            assert (finals[c].x - x).abs().max().item() <= TOL
        if not previews[s]:
            assert not shown, f"stream {s} did not ask for previews"
            continue
        # every step but the last, for every generated chunk, and nothing for observations
        assert sorted(shown) == sorted(ref_previews), (sorted(shown), sorted(ref_previews))
        for key, x0 in ref_previews.items():
            assert (shown[key].x - x0).abs().max().item() <= TOL, key
        # a chunk's previews arrive before it, in step order
        order = [(r.chunk, r.preview_steps or K) for r in got[s]]
        for c in ref:
            mine = [k for cc, k in order if cc == c]
            assert mine == list(range(1, K + 1)), (c, mine)


@pytest.mark.parametrize("threads", [False, True])
@pytest.mark.parametrize("layout", ["one-worker", "uneven-groups"])
def test_previews_equal_the_oracles_x0_estimates(tiny, layout, threads):
    lay = layout_single(K, L) if layout == "one-worker" else layout_groups(K, L, [1, 3, 2])
    rt = InProcRuntime(tiny, SAMPLER, lay, batching=True)
    horizon = 2
    plans = {s: live_plan(tiny, s, horizon=horizon, observations=6) for s in range(2)}
    previews = {0: True, 1: False}
    got, feed = _run(rt, plans, previews=previews, horizon=horizon, threads=threads)
    assert feed.mid_flight > 3
    _check(tiny, SAMPLER, plans, got, previews)
    assert all(not w.stats.drops for w in rt.workers), [w.stats.drops for w in rt.workers]


def test_an_x0_head_previews_its_own_prediction(tiny_x0):
    """x - sigma v is the x0 head's output itself: the estimate is what the head predicted."""
    rt = InProcRuntime(tiny_x0, SAMPLER, layout_groups(K, L, [2, 2, 2]), batching=True)
    plans = {0: live_plan(tiny_x0, 0, horizon=2, observations=5)}
    got, _ = _run(rt, plans, previews={0: True}, horizon=2, threads=False)
    _check(tiny_x0, SAMPLER, plans, got, {0: True})


def test_previews_do_not_count_as_chunks_in_flight(tiny):
    """A throttled pipeline (one chunk in flight) still releases the next chunk only when
    the chunk itself, not its preview, reached the sink."""
    rt = InProcRuntime(tiny, SAMPLER, layout_groups(K, L, [3, 3]), batching=True)
    rt.open_stream(0, seed=7, cond=make_cond(tiny.cfg, 70), previews=True, max_in_flight=1)
    for _ in range(3):
        rt.controller.submit_generate(0)
    rt.controller.pump()
    out = rt.run_inline()
    assert [(r.chunk, r.preview_steps) for r in out] == [
        (c, k) for c in range(3) for k in (*range(1, K), 0)
    ]
