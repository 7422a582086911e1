"""Memory model and admission control: no overcommit, specific refusals, shared >= static."""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from physis_ros.engine.api import AdmissionRefused
from physis_ros.engine.config import SamplerConfig, get_preset
from physis_ros.engine.pool.admission import AdmissionController
from physis_ros.engine.pool.costmodel import GIB, H200, AnalyticCostModel
from physis_ros.engine.pool.memory import MemoryModel
from physis_ros.engine.pool.plan import StreamPlan, block_split, contiguous_split
from physis_ros.engine.pool.terms import PoolConfig, StreamRequest
from physis_ros.tools.experiments.pool24 import POOL24_BACKBONES, admit_until_refused

SAMPLER = SamplerConfig(steps=4, window=2)
COST = AnalyticCostModel(H200)
MEM = MemoryModel(dtype_bytes=2, max_batch=8)


def _pool(policy="shared", devices=4, usable=H200.usable_bytes, util=0.9):
    return PoolConfig(
        num_devices=devices, usable_bytes=usable, policy=policy, max_utilization=util, memory=MEM
    )


def _req(name="wan2.1-14b", target_ms=1600.0, sampler=SAMPLER):
    return StreamRequest(model=get_preset(name), sampler=sampler, target_interval_ms=target_ms)


def test_memory_counts_weights_once_per_device_and_kv_per_stage():
    cfg = get_preset("wan2.1-1.3b")
    S = SAMPLER.steps * cfg.num_blocks
    plans = [
        StreamPlan(
            stream_id=i, model=cfg, sampler=SAMPLER, target_interval_ms=1600, stage_devices=(0,) * S
        )
        for i in range(3)
    ]
    one = MEM.device_usage(plans[:1], 0)
    three = MEM.device_usage(plans, 0)
    assert three.weights == one.weights == cfg.num_params() * 2  # all blocks + embed/head
    kv_stage = SAMPLER.window * cfg.tokens_per_chunk * 2 * cfg.dim * 2
    assert one.kv == S * kv_stage and three.kv == 3 * S * kv_stage
    assert three.cross_kv == 3 * cfg.num_blocks * cfg.text_len * 2 * cfg.dim * 2
    assert three.buffers == 0 and three.workspace == one.workspace > 0
    # Split by block over two devices: each holds half the blocks' weights, and receives
    # one hop per step.
    split = StreamPlan(
        stream_id=9,
        model=cfg,
        sampler=SAMPLER,
        target_interval_ms=1600,
        stage_devices=block_split(SAMPLER.steps, cfg.num_blocks, [0, 1]),
    )
    d1 = MEM.device_usage([split], 1)
    assert d1.kv == S // 2 * kv_stage
    assert d1.buffers == SAMPLER.steps * MEM.recv_buffer_bytes(cfg)
    assert MEM.device_usage([split], 2).total == 0


def test_static_policy_takes_the_smallest_exclusive_group():
    ctl = AdmissionController(_pool("static", devices=6), COST)
    a = ctl.admit(_req("dit-33b"))  # 2.3 s of compute per chunk: needs two devices at 1.6 s
    assert sorted(set(a.plan.stage_devices)) == [0, 1]
    b = ctl.admit(_req("dit-33b"))
    assert sorted(set(b.plan.stage_devices)) == [2, 3]
    assert a.expected_interval_ms == 1600.0
    assert a.expected_response_latency_ms > a.no_contention_latency_ms > 0


def test_refusal_names_compute_with_interval_and_target():
    ctl = AdmissionController(_pool("shared", devices=2), COST)
    with pytest.raises(AdmissionRefused) as err:
        ctl.admit(_req("dit-33b", target_ms=500.0))
    r = err.value
    assert r.resource == "compute"
    assert "interval" in r.reason and "> target 500.0 ms" in r.reason
    assert r.shortfall.endswith(" ms") and float(r.shortfall.split()[0]) > 0


def test_refusal_names_memory_device_and_shortfall():
    # 1.3B stream: ~2.6 GiB weights + 6.4 GiB KV; give each device only 8 GiB.
    ctl = AdmissionController(_pool("shared", devices=1, usable=8 * GIB), COST)
    with pytest.raises(AdmissionRefused) as err:
        ctl.admit(_req("wan2.1-1.3b"))
    r = err.value
    assert r.resource == "memory"
    assert r.reason.startswith("memory on device 0 short by ")
    short_gib = float(r.shortfall.split()[0])
    need = MEM.device_usage(
        [
            StreamPlan(
                stream_id=0,
                model=get_preset("wan2.1-1.3b"),
                sampler=SAMPLER,
                target_interval_ms=1600,
                stage_devices=(0,) * 120,
            )
        ],
        0,
    ).total
    assert short_gib == pytest.approx((need - 8 * GIB) / GIB, abs=0.01)


def test_memory_refusal_in_a_partly_full_pool_names_the_device():
    # Two devices with room for exactly the weights and KV of a few 1.3B streams each.
    ctl = AdmissionController(_pool("shared", devices=2, usable=20 * GIB, util=1.0), COST)
    admitted, refusal = admit_until_refused(ctl, _req("wan2.1-1.3b", target_ms=5000.0))
    assert admitted and refusal is not None
    assert refusal.resource == "memory"
    assert "memory on device" in refusal.reason and "GiB" in refusal.shortfall
    for d in range(2):
        assert ctl.memory_used(d) <= 20 * GIB


def test_static_refusal_when_no_exclusive_group_is_free():
    ctl = AdmissionController(_pool("static", devices=3), COST)
    admit_until_refused(ctl, _req("dit-33b"))
    with pytest.raises(AdmissionRefused) as err:
        ctl.admit(_req("dit-33b"))
    assert err.value.resource == "compute"
    # one free device: all 200 stages on it, at 90% utilization
    alone_ms = 200 * COST.group_ms(get_preset("dit-33b"), SAMPLER, 1) / 0.9
    want = f"interval {alone_ms:.1f} ms > target 1600.0 ms on the 1 free device(s)"
    assert want in err.value.reason
    assert "an exclusive group needs 2" in err.value.reason


def test_close_frees_compute_and_memory_for_the_next_stream():
    ctl = AdmissionController(_pool("shared", devices=2), COST)
    admitted, refusal = admit_until_refused(ctl, _req("dit-33b"))
    assert len(admitted) == 1 and refusal is not None
    with pytest.raises(ValueError, match="not admitted"):
        ctl.close(99)
    ctl.close(admitted[0].plan.stream_id)
    assert ctl.utilization(0) == ctl.utilization(1) == 0.0
    assert ctl.memory_used(0) == ctl.memory_used(1) == 0
    ctl.admit(_req("dit-33b"))


def test_shared_packs_a_second_stream_into_spare_compute():
    # a 14B stream takes 73% of a device at T = 1600 ms: the spare 17% of five devices holds
    # one more (that of four does not)
    devices = 5
    ctl = AdmissionController(_pool("shared", devices=devices), COST)
    admitted, _ = admit_until_refused(ctl, _req("wan2.1-14b"))
    # five exclusive-size streams, then packed ones that span several devices' spare time
    assert [a.candidate for a in admitted[:devices]] == ["fresh-group"] * devices
    assert len(admitted) > devices and admitted[devices].candidate == "packed-used"
    assert len(set(admitted[devices].plan.stage_devices)) >= 2
    for d in range(devices):
        assert ctl.utilization(d) <= 0.9 + 1e-9


@pytest.mark.parametrize("backbone", POOL24_BACKBONES)
def test_shared_admits_at_least_as_many_as_static(backbone):
    counts = {}
    for policy in ("static", "shared"):
        ctl = AdmissionController(_pool(policy, devices=24), COST)
        admitted, refusal = admit_until_refused(ctl, _req(backbone))
        assert refusal is not None
        counts[policy] = len(admitted)
    assert counts["static"] >= 1
    assert counts["shared"] >= counts["static"]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    name=st.sampled_from(("small", "wan2.1-1.3b", "wan2.2-ti2v-5b", "wan2.1-14b", "dit-33b")),
    target_ms=st.floats(min_value=50.0, max_value=8000.0),
    devices=st.integers(1, 12),
    usable_gib=st.floats(min_value=8.0, max_value=140.0),
    steps=st.integers(1, 4),
    window=st.integers(0, 3),
)
def test_shared_never_admits_fewer_identical_streams_than_static(  # noqa: PLR0917
    name, target_ms, devices, usable_gib, steps, window
):
    """A static partition is one of the placements shared can choose, so for any model,
    target, pool and sampler, admitting identical streams until refusal, shared >= static."""
    req = _req(name, target_ms, SamplerConfig(steps=steps, window=window))
    counts = {}
    for policy in ("static", "shared"):
        ctl = AdmissionController(_pool(policy, devices=devices, usable=usable_gib * GIB), COST)
        admitted, refusal = admit_until_refused(ctl, req, limit=400)
        assert refusal is not None or len(admitted) == 400
        if refusal is not None:
            assert refusal.resource in ("memory", "compute") and refusal.shortfall
        counts[policy] = len(admitted)
    assert counts["shared"] >= counts["static"], counts


_MODELS = ("tiny", "small", "wan2.1-1.3b", "wan2.2-ti2v-5b", "wan2.1-14b", "dit-33b")
_op = st.one_of(
    st.tuples(
        st.just("open"),
        st.sampled_from(_MODELS),
        st.floats(min_value=5.0, max_value=6000.0),
        st.integers(1, 4),
        st.integers(0, 3),
    ),
    st.tuples(st.just("close"), st.integers(0, 50)),
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    policy=st.sampled_from(("shared", "static")),
    devices=st.integers(1, 6),
    usable_gib=st.floats(min_value=4.0, max_value=140.0),
    ops=st.lists(_op, min_size=1, max_size=25),
)
def test_admission_never_overcommits_memory_or_compute(policy, devices, usable_gib, ops):
    """Random open/close sequences of mixed models: after every operation, every device's
    memory (recomputed from scratch from the admitted plans) fits, and its committed work
    per interval stays within max_utilization of every stream's target."""
    usable = usable_gib * GIB
    ctl = AdmissionController(_pool(policy, devices=devices, usable=usable), COST)
    for op in ops:
        if op[0] == "open":
            _, name, target_ms, steps, window = op
            req = _req(name, target_ms, SamplerConfig(steps=steps, window=window))
            try:
                ctl.admit(req)
            except AdmissionRefused as refusal:
                assert refusal.resource in ("memory", "compute")
                assert refusal.shortfall
        elif ctl.plans:
            sid = sorted(ctl.plans)[op[1] % len(ctl.plans)]
            ctl.close(sid)
        plans = list(ctl.plans.values())
        for d in range(devices):
            used = MEM.device_usage(plans, d).total
            assert used <= usable
            assert used == ctl.memory_used(d)
            busy = sum(ctl.device_load_ms(p).get(d, 0.0) / p.target_interval_ms for p in plans)
            assert busy <= 0.9 + 1e-9
        if policy == "static":  # exclusive groups never share a device
            owners = [d for p in plans for d in set(p.stage_devices)]
            assert len(owners) == len(set(owners))


def test_layout_helpers_cover_every_stage():
    assert contiguous_split(10, [3, 5]) == (3,) * 5 + (5,) * 5
    assert block_split(2, 4, [0, 1]) == (0, 0, 1, 1, 0, 0, 1, 1)
    with pytest.raises(ValueError, match="stage_devices has 3 entries"):
        StreamPlan(
            stream_id=0,
            model=get_preset("tiny"),
            sampler=SAMPLER,
            target_interval_ms=1.0,
            stage_devices=(0, 0, 0),
        )


def test_cpu_messages_and_the_controller_are_charged_where_they_run():
    """A CPU profile: each hop costs its sender and receiver processor time; with a
    controller device, entry and exit hops and the per-chunk controller work land there."""
    from physis_ros.engine.pool.costmodel import Profile, ProfileCostModel, ProfileEntry

    prof = Profile(
        device="cpu",
        model="tiny",
        steps=2,
        window=2,
        dtype="float32",
        entries=(ProfileEntry(tasks=1, ms_p50=1.0, ms_p99=1.0),),
        hop_ms=0.5,
        send_cpu_ms=0.1,
        recv_cpu_ms=0.2,
        chunk_overhead_ms=0.3,
    )
    sampler = SamplerConfig(steps=2, window=2)
    plan = StreamPlan(
        stream_id=0,
        model=get_preset("tiny"),
        sampler=sampler,
        target_interval_ms=100.0,
        stage_devices=(1, 1, 2, 2),
    )
    cost = ProfileCostModel(prof)
    plain = AdmissionController(_pool(devices=3), cost).device_load_ms(plan)
    assert plain == pytest.approx({1: 2.0 + 0.1, 2: 2.0 + 0.2})
    pool = PoolConfig(
        num_devices=3, usable_bytes=GIB, memory=MemoryModel(dtype_bytes=4), controller_device=0
    )
    load = AdmissionController(pool, cost).device_load_ms(plan)
    # device 0: sends the chunk in, receives it back, runs the controller's share
    assert load == pytest.approx({0: 0.1 + 0.2 + 0.3, 1: 2.0 + 0.1 + 0.2, 2: 2.0 + 0.2 + 0.1})
    with pytest.raises(ValueError, match="controller_device 3"):
        PoolConfig(num_devices=3, usable_bytes=GIB, controller_device=3)
