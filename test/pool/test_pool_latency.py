"""Response latency as a target: the planner's shapes and front, admission with a latency
budget (depth and sharing traded for latency), and the frontier's points kept in simulation."""

import json
import math
import subprocess
import sys

import pytest

from physis_ros.engine.api import AdmissionRefused
from physis_ros.engine.config import SamplerConfig, get_preset
from physis_ros.engine.pool.admission import AdmissionController
from physis_ros.engine.pool.costmodel import (
    GIB,
    H200,
    AnalyticCostModel,
    Profile,
    ProfileCostModel,
    ProfileEntry,
)
from physis_ros.engine.pool.memory import MemoryModel
from physis_ros.engine.pool.plan import StreamPlan
from physis_ros.engine.pool.planner import (
    Shape,
    estimate,
    fastest_within,
    group_memory_bytes,
    objectives,
    pareto,
    shapes,
)
from physis_ros.engine.pool.terms import PoolConfig, StreamRequest
from physis_ros.tools.experiments.frontier import frontier
from physis_ros.tools.experiments.pool24 import admit_until_refused

from physis_testing import REPO_ROOT

SAMPLER = SamplerConfig(steps=4, window=2)
COST = AnalyticCostModel(H200)
MEM = MemoryModel(dtype_bytes=2, max_batch=8)
K14 = get_preset("wan2.1-14b")


def _pool(devices, policy="shared", usable=H200.usable_bytes, cost_mem=MEM, **kw):
    return PoolConfig(
        num_devices=devices, usable_bytes=usable, policy=policy, memory=cost_mem, **kw
    )


def _req(target_ms=1600.0, budget_ms=0.0, cfg=K14, sampler=SAMPLER):
    return StreamRequest(
        model=cfg, sampler=sampler, target_interval_ms=target_ms, latency_budget_ms=budget_ms
    )


# A CPU-like cost: 1 ms per stage, 0.5 ms per hop, so depth costs latency (tiny: 8 stages).
HOP_HEAVY = ProfileCostModel(
    Profile(
        device="fixture",
        model="tiny",
        steps=4,
        window=2,
        dtype="float32",
        entries=(ProfileEntry(tasks=1, ms_p50=1.0, ms_p99=1.0),),
        hop_ms=0.5,
        comm_overlaps_compute=True,
    )
)


def test_estimate_is_the_closed_form_of_depth_and_width():
    S = SAMPLER.steps * K14.num_blocks
    stage = COST.group_ms(K14, SAMPLER, 1)
    hop = COST.hop_ms(K14, 0, 1)
    four = estimate(COST, K14, SAMPLER, Shape(depth=4), MEM)
    assert four.interval_ms == pytest.approx(S / 4 * stage)
    assert four.pipeline_latency_ms == pytest.approx(S * stage + 3 * hop)
    assert four.response_latency_ms == pytest.approx(four.interval_ms + four.pipeline_latency_ms)
    # Staggered: three streams on the same four devices, each slot one run apart; none waits.
    three = estimate(COST, K14, SAMPLER, Shape(depth=4, streams=3, sharing="staggered"), MEM)
    assert three.interval_ms == pytest.approx(3 * four.interval_ms)
    assert three.pipeline_latency_ms == pytest.approx(four.pipeline_latency_ms)
    assert three.phases_ms == pytest.approx((0.0, four.interval_ms, 2 * four.interval_ms))
    assert three.devices_per_stream == pytest.approx(4 / 3)
    # Batched: two streams per stage forward on one device.
    two = estimate(COST, K14, SAMPLER, Shape(depth=1, streams=2, sharing="batched"), MEM)
    assert two.interval_ms == pytest.approx(S * COST.group_ms(K14, SAMPLER, 2))
    assert two.pipeline_latency_ms == pytest.approx(two.interval_ms)
    with pytest.raises(ValueError, match="one device only"):
        Shape(depth=2, streams=2, sharing="batched")
    with pytest.raises(ValueError, match="with 1 stream"):
        Shape(depth=2, streams=1, sharing="staggered")


def test_group_memory_is_what_the_memory_model_charges():
    for shape in (Shape(depth=1), Shape(depth=3, streams=2, sharing="staggered"), Shape(depth=9)):
        est = estimate(COST, K14, SAMPLER, shape, MEM)
        plans = [
            StreamPlan(
                stream_id=j,
                model=K14,
                sampler=SAMPLER,
                target_interval_ms=1.0,
                stage_devices=est.stage_devices,
            )
            for j in range(shape.streams)
        ]
        want = max(MEM.device_usage(plans, d).total for d in range(shape.depth))
        assert group_memory_bytes(MEM, K14, SAMPLER, est.stage_devices, streams=shape.streams) == (
            want
        )


def test_pareto_keeps_exactly_the_undominated_shapes():
    est = shapes(COST, K14, SAMPLER, devices=24, usable_bytes=H200.usable_bytes, memory=MEM)
    front = pareto(est)
    assert 1 < len(front) < len(est)

    def beats(a, b):
        ka, kb = objectives(a), objectives(b)
        return all(x <= y for x, y in zip(ka, kb, strict=True)) and ka != kb

    assert not any(beats(o, f) for f in front for o in est)
    for e in est:  # left out: beaten, or a deeper tie of a point kept
        assert e in front or any(beats(f, e) or objectives(f) == objectives(e) for f in front)
    # Every shape fits in memory; 33B on one device holds one stream only (KV of 200 stages).
    assert all(e.memory_bytes <= H200.usable_bytes for e in est)
    big = shapes(
        COST,
        get_preset("dit-33b"),
        SAMPLER,
        devices=1,
        usable_bytes=H200.usable_bytes,
        memory=MEM,
    )
    assert [e.shape for e in big] == [Shape(depth=1)]


def test_fastest_within_a_budget_is_shallower_where_hops_cost_latency():
    est = shapes(HOP_HEAVY, get_preset("tiny"), SAMPLER, devices=8, usable_bytes=GIB, memory=MEM)
    alone = {e.shape.depth: e for e in est if e.shape.sharing == "alone"}
    # 8 stages of 1 ms: depth d gives I = ceil(8 / d) and L = 8 + 0.5 (d - 1).
    assert alone[8].interval_ms == 1.0 and alone[8].pipeline_latency_ms == 8 + 3.5
    assert fastest_within(est, math.inf).shape == Shape(depth=8)  # R = 12.5
    assert fastest_within(est, 12.0).shape == Shape(depth=4)  # R = 2 + 9.5 (5 ties, deeper)
    assert fastest_within(est, 11.0) is None


def test_budget_turns_a_deep_shared_packing_into_an_exclusive_group():
    """Five 14B streams fill 73% of five devices; a sixth packed into their spare compute
    spans every one of them and queues behind their streams. With a budget the planner takes
    the free device instead: one device deep, nothing queued, within the budget."""
    runs = {}
    for budget in (0.0, 4000.0):
        ctl = AdmissionController(_pool(7), COST)
        for _ in range(5):
            assert ctl.admit(_req()).candidate == "fresh-group"
        runs[budget] = ctl.admit(_req(budget_ms=budget))
    deep, shallow = runs[0.0], runs[4000.0]
    assert deep.candidate == "packed-used" and len(deep.plan.devices()) >= 5
    assert deep.expected_response_latency_ms > 4000.0
    assert shallow.candidate == "fresh-group" and len(shallow.plan.devices()) == 1
    stage_ms = COST.group_ms(K14, SAMPLER, 1)  # 7.31 ms on the calibrated H200
    assert shallow.expected_response_latency_ms == pytest.approx(1600.0 + 160 * stage_ms)
    assert shallow.latency_budget_ms == 4000.0


def test_no_placement_meets_both_then_refused_for_latency():
    ctl = AdmissionController(_pool(5), COST)
    for _ in range(5):
        ctl.admit(_req())
    with pytest.raises(AdmissionRefused) as err:
        ctl.admit(_req(budget_ms=3000.0))
    refusal = err.value
    assert refusal.resource == "latency"
    assert "> budget 3000.0 ms" in refusal.reason and "interval 1600.0 ms" in refusal.reason
    assert float(refusal.shortfall.split()[0]) > 0
    # Without a budget the same stream is admitted (packed over the five devices).
    assert ctl.admit(_req()).candidate == "packed-used"


def test_later_streams_never_push_a_budgeted_stream_past_its_budget():
    """1.3B streams (209 ms of compute per chunk) packed until refused around a stream that
    asked for 2500 ms: its predicted response latency grows as streams share its device,
    up to its budget and no further; the refusal that ends the packing names it."""
    cfg = get_preset("wan2.1-1.3b")
    ctl = AdmissionController(_pool(2), COST)
    first = ctl.admit(_req(budget_ms=2500.0, cfg=cfg))
    assert first.expected_response_latency_ms < 2500.0
    admitted, refusal = admit_until_refused(ctl, _req(cfg=cfg))
    assert admitted and refusal is not None
    assert ctl.response_latency_ms(first.plan.stream_id) <= 2500.0
    assert any(a.plan.stage_devices[0] == first.plan.stage_devices[0] for a in admitted)
    ctl.close(first.plan.stream_id)  # its budget goes with it: the pool takes more again
    ctl.admit(_req(cfg=cfg))


def test_target_zero_is_the_fastest_exclusive_depth_within_the_budget():
    tiny = get_preset("tiny")
    pool = _pool(8, usable=GIB, cost_mem=MemoryModel(dtype_bytes=4))
    ctl = AdmissionController(pool, HOP_HEAVY)
    fast = ctl.admit(_req(target_ms=0.0, cfg=tiny))
    assert fast.candidate == "fastest" and len(fast.plan.devices()) == 8
    assert fast.expected_interval_ms == pytest.approx(1.0)
    assert fast.expected_response_latency_ms == pytest.approx(1.0 + 8 + 3.5)
    ctl.close(fast.plan.stream_id)
    shallow = ctl.admit(_req(target_ms=0.0, budget_ms=12.0, cfg=tiny))
    assert len(shallow.plan.devices()) == 4
    assert shallow.expected_interval_ms == pytest.approx(2.0)
    assert shallow.expected_response_latency_ms == pytest.approx(11.5)
    # Its two devices are its own: a paced stream goes elsewhere, never onto them.
    other = ctl.admit(_req(target_ms=50.0, cfg=tiny))
    assert not set(other.plan.devices()) & set(shallow.plan.devices())
    with pytest.raises(AdmissionRefused) as err:
        ctl.admit(_req(target_ms=0.0, budget_ms=11.0, cfg=tiny))
    assert err.value.resource == "latency" and "at every depth" in err.value.reason


@pytest.mark.parametrize("bad", [-1.0, float("nan"), float("inf")])
def test_bad_budget_is_a_value_error(bad):
    with pytest.raises(ValueError, match="latency budget"):
        _req(budget_ms=bad)


@pytest.mark.slow
@pytest.mark.parametrize(("model", "devices"), [("wan2.1-14b", 24), ("dit-33b", 200)])
def test_every_frontier_point_keeps_its_promise_in_simulation(model, devices):
    """Each point of the front, its streams paced at its interval in their planned slots,
    simulated: median interval and every chunk's pipeline latency within the promise."""
    out = frontier(model, devices)
    points = out["frontier"]
    assert len(points) > 5
    for p in points:
        sim = p["simulated"]
        assert sim["keeps_promise"], p
        assert sim["interval_p50_ms"] <= p["interval_ms"] * (1 + 1e-5)
        assert sim["response_latency_ms"] <= p["response_latency_ms"] * (1 + 1e-5)
    assert out["all_points_keep_promise"]
    # Deeper is faster: the front's shortest interval is the busiest device's share of the
    # stages at full depth, on the fewest devices that give that share.
    S = SAMPLER.steps * get_preset(model).num_blocks
    share = math.ceil(S / min(devices, S))
    fastest = min(points, key=lambda p: p["interval_ms"])
    assert fastest["interval_ms"] == pytest.approx(
        share * COST.group_ms(get_preset(model), SAMPLER, 1), rel=1e-5
    )
    assert fastest["depth"] == math.ceil(S / share)
    assert out["published"], "the published points are placed"


def test_physis_sim_frontier_json_and_plot(tmp_path):
    png = tmp_path / "front.png"
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "physis_ros.tools.sim_cli",
            "--experiment",
            "frontier",
            "--model",
            "tiny",
            "--devices",
            "8",
            "--json",
            "--plot",
            str(png),
        ],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    out = json.loads(run.stdout)
    assert out["experiment"] == "frontier" and out["all_points_keep_promise"]
    assert {"depth", "streams_per_group", "interval_ms", "response_latency_ms"} <= set(
        out["frontier"][0]
    )
    from PIL import Image

    with Image.open(png) as img:
        assert img.size == (900, 560)


def test_physis_sim_admits_with_a_latency_budget_and_says_why_it_refuses():
    def sim(*args):
        return subprocess.run(
            [sys.executable, "-m", "physis_ros.tools.sim_cli", "--json", *args],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=300,
            check=True,
        )

    base = ["--model", "wan2.1-14b", "--devices", "5", "--chunks", "9"]
    out = json.loads(sim(*base, "--latency-budget-ms", "3000").stdout)
    assert [a["devices"] for a in out["admitted"]] == [1, 1, 1, 1, 1]
    assert all(a["expected_response_latency_ms"] <= 3000 for a in out["admitted"])
    assert out["refused"][0]["resource"] == "latency"
    assert out["simulation"]["all_meet_target"]
    free = json.loads(sim(*base).stdout)  # no budget: a sixth stream packed over all five
    assert len(free["admitted"]) > 5 and free["admitted"][5]["devices"] == 5
