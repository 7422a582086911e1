"""Live-timeline plans (observations replacing predicted slots) and a driver that feeds them
while chunks are in flight, for the engine tests."""

from __future__ import annotations

import random

from engine_helpers import SAMPLER, actions, context_x
from stream_plans import live_skeleton, rollout_skeleton

from physis_ros.engine import oracle
from physis_ros.engine.controller import submit_item
from physis_ros.engine.forward import make_cond
from physis_ros.engine.threads import InProcRuntime


def live_plan(model, stream: int, *, horizon: int, observations: int = 6, with_actions=False):
    """``stream_plans.live_skeleton`` with this model's observed chunks (and actions)."""
    return [
        ("observe", item[1], context_x(model, 10 * stream + item[1]))
        if item[0] == "observe"
        else ("generate", actions(model, 1000 * stream + i) if with_actions else None)
        for i, item in enumerate(live_skeleton(stream, horizon=horizon, observations=observations))
    ]


def rollout_plan(model, stream: int, *, horizon: int, observations: int = 6, with_actions=False):
    """``stream_plans.rollout_skeleton`` with this model's observed chunks (and actions)."""
    return [
        ("observe", item[1], context_x(model, 10 * stream + item[1]))
        if item[0] == "observe"
        else ("generate", actions(model, 1000 * stream + i) if with_actions else None, item[1])
        for i, item in enumerate(
            rollout_skeleton(stream, horizon=horizon, observations=observations)
        )
    ]


def worst_rollout_error(model, plans, out) -> float:
    """Max |out - oracle| over every generated version of every stream (seed 7 + s, prompt
    70 + s), after checking that each stream got exactly the oracle's versions."""
    worst = 0.0
    for s, plan in plans.items():
        ref = oracle.sample_noisy(
            model, SAMPLER, plan, seed=7 + s, cond=make_cond(model.cfg, 70 + s), by_anchor=True
        )
        assert sorted(out[s]) == sorted(ref), f"stream {s}: {sorted(out[s])} != {sorted(ref)}"
        for key, x in ref.items():
            worst = max(worst, (out[s][key].x - x).abs().max().item())
    return worst


def replaced_slots(plan, window: int) -> int:
    """How many observations replaced a slot generated before them."""
    vs = oracle.versions(plan, window)
    generated = set()
    count = 0
    for v in vs:
        if v.observed and v.slot in generated:
            count += 1
        if not v.observed:
            generated.add(v.slot)
    return count


class LiveFeed:
    """Feeds plans item by item into a runtime that is running, and counts the items that
    arrived while a chunk of their stream was in flight."""

    def __init__(self, rt: InProcRuntime, plans: dict, *, seed: int = 0) -> None:
        self.rt = rt
        self.todo = {s: list(p) for s, p in plans.items()}
        self.rng = random.Random(seed)
        self.mid_flight = 0

    def done(self) -> bool:
        return not any(self.todo.values())

    def submit_some(self) -> None:
        """Submit the next item of one random stream that has items left."""
        sid = self.rng.choice([s for s, items in self.todo.items() if items])
        ctl = self.rt.controller
        if ctl.streams[sid].in_flight:
            self.mid_flight += 1
        submit_item(ctl, sid, self.todo[sid].pop(0))
        ctl.pump()


def open_streams(rt, plans, *, mode, horizon, max_in_flight=0):
    for s in plans:
        rt.open_stream(
            s,
            seed=7 + s,
            cond=make_cond(rt.model.cfg, 70 + s),
            mode=mode,
            max_in_flight=max_in_flight,
            horizon=horizon,
        )


class Results(dict):
    """stream -> slot -> ChunkResult, or with ``by_anchor`` stream -> (slot, anchor) -> it
    (rollouts: a slot has one version per anchor); a version that comes twice fails."""

    def __init__(self, streams, *, by_anchor: bool = False) -> None:
        super().__init__({s: {} for s in streams})
        self.by_anchor = by_anchor

    def add(self, results) -> None:
        for res in results:
            key = (res.chunk, res.anchor) if self.by_anchor else res.chunk
            assert key not in self[res.stream_id], f"version {key} came back twice"
            self[res.stream_id][key] = res


def run_live_inline(rt, plans, *, mode, horizon, max_in_flight=0, seed=0, by_anchor=False):
    """One thread: between items, 0-3 rounds of every worker; results per stream per slot
    (``Results``)."""
    open_streams(rt, plans, mode=mode, horizon=horizon, max_in_flight=max_in_flight)
    feed = LiveFeed(rt, plans, seed=seed)
    out = Results(plans, by_anchor=by_anchor)
    while not feed.done():
        feed.submit_some()
        for _ in range(feed.rng.randrange(4)):
            for w in rt.workers:
                w.run_once(0.0)
            out.add(rt.drain())
    out.add(rt.run_inline())
    return out, feed


def run_live_threads(rt, plans, *, mode, horizon, timeout_s=120.0, seed=0, by_anchor=False):
    """Workers in threads; items arrive every 0-2 ms, whatever the workers are doing."""
    open_streams(rt, plans, mode=mode, horizon=horizon)
    feed = LiveFeed(rt, plans, seed=seed)
    out = Results(plans, by_anchor=by_anchor)
    rt.start_threads()
    try:
        while not feed.done():
            feed.submit_some()
            out.add(rt.drain(wait_s=feed.rng.random() * 0.002))
        out.add(rt.wait_idle(timeout_s))
    finally:
        rt.stop_threads()
    return out, feed


def worst_live_error(model, sampler, plans, out, *, mode) -> float:
    """Max |streamed - oracle| over every generated chunk; also checks each chunk's anchor."""
    worst = 0.0
    for s, plan in plans.items():
        cond = make_cond(model.cfg, 70 + s)
        ref = oracle.sample(model, sampler, plan, mode=mode, seed=7 + s, cond=cond)
        anchors = {
            v.slot: v.anchor for v in oracle.versions(plan, sampler.window) if not v.observed
        }
        assert sorted(out[s]) == sorted(ref), f"stream {s}: {sorted(out[s])} != {sorted(ref)}"
        for c, x in ref.items():
            assert out[s][c].anchor == anchors[c], (s, c, out[s][c].anchor, anchors[c])
            worst = max(worst, (out[s][c].x - x).abs().max().item())
    return worst
