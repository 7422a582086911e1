"""The pool in the engine core (PoolAdmission): admission with simulated promises, refusals
that name their reason, promises revised as streams join and leave, the static policy and
placements given by hand; start-up planning of the default target. A fake engine stands in
for the core's workers (what it is asked to open is checked), with a measured-looking
profile; ``Served`` calls the pool as the core does (engine/core.py)."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest

from physis_ros.engine.api import AdmissionRefused, ChunkOutput, StreamPromise, StreamSpec
from physis_ros.engine.config import SamplerConfig, get_preset
from physis_ros.engine.pool.costmodel import GIB, Profile, ProfileCostModel, ProfileEntry
from physis_ros.engine.pool.memory import MemoryModel
from physis_ros.engine.pool.planning import PoolSimulation, plan_default_target, simulate_plans
from physis_ros.engine.pool.service import (
    RECALIBRATE_CHUNKS,
    RECALIBRATE_WARMUP_CHUNKS,
    PoolAdmission,
)
from physis_ros.engine.pool.terms import PoolConfig, StreamRequest

CFG = get_preset("tiny")
SAMPLER = SamplerConfig(steps=4, window=2)
PROFILE = Profile(
    device="test",
    model="tiny",
    steps=4,
    window=2,
    dtype="float32",
    entries=(
        ProfileEntry(tasks=1, ms_p50=1.0, ms_p99=1.2),
        ProfileEntry(tasks=4, ms_p50=1.6, ms_p99=2.0),
        ProfileEntry(tasks=16, ms_p50=4.0, ms_p99=5.0),
    ),
    hop_ms=0.05,
    task_overhead_ms=0.1,
)
COST = ProfileCostModel(PROFILE)


class FakeEngine:
    """Opens streams with the layout it is given and remembers them."""

    def __init__(self) -> None:
        self.layouts: dict[int, tuple] = {}
        self.closed: list[int] = []
        self.finished: list[ChunkOutput] = []  # what the next poll returns
        self._next = 0

    def open_stream(self, spec: StreamSpec, *, layout) -> StreamPromise:
        sid, self._next = self._next, self._next + 1
        self.layouts[sid] = layout
        return StreamPromise(
            stream_id=sid,
            model="tiny",
            steps=4,
            blocks=2,
            expected_interval_ms=0.0,
            pipeline_depth=1,
            expected_response_latency_ms=0.0,
            chunk_frames=2,
            image_height=16,
            image_width=16,
            action_horizon=4,
            action_dim=4,
        )

    def close_stream(self, stream_id: int) -> None:
        self.closed.append(stream_id)
        del self.layouts[stream_id]

    def poll(self, timeout_s: float) -> list[ChunkOutput]:
        out, self.finished = self.finished, []
        return out


class Served:
    """The fake engine with the pool in front, called the way EngineCore calls it."""

    def __init__(self, engine: FakeEngine, admission: PoolAdmission) -> None:
        self.engine = engine
        self.admission = admission
        self.controller = admission.controller
        self.pool = admission.pool
        self._missing = admission._missing

    def open_stream(self, spec: StreamSpec) -> StreamPromise:
        return self.admission.open(
            spec, lambda layout: self.engine.open_stream(spec, layout=layout)
        )

    def close_stream(self, stream_id: int) -> None:
        self.engine.close_stream(stream_id)
        self.admission.close(stream_id)

    def poll(self, timeout_s: float) -> list[ChunkOutput]:
        outputs = self.engine.poll(timeout_s)
        self.admission.measure(outputs)
        return outputs

    def take_revisions(self) -> list[StreamPromise]:
        return self.admission.take_revisions()

    def promise(self, stream_id: int) -> StreamPromise:
        return self.admission.promise(stream_id)

    def info(self) -> dict[str, str]:
        return self.admission.info()

    @property
    def measured_slowdown(self) -> float:
        return self.admission.measured_slowdown


def _pooled(*, devices=2, policy="shared", usable=1.0 * GIB, stage_devices=None, **kw):
    pool = PoolConfig(
        num_devices=devices,
        usable_bytes=usable,
        policy=policy,
        max_utilization=0.9,
        memory=MemoryModel(dtype_bytes=4),
        charged_batch=4,
    )
    engine = FakeEngine()
    admission = PoolAdmission(
        pool,
        COST,
        PoolSimulation(),
        model=CFG,
        sampler=SAMPLER,
        default_target_ms=kw.pop("default_target_ms", 40.0),
        chunks_per_interval=2,
        stage_devices=stage_devices,
    )
    return Served(engine, admission), engine


def _ranks(layout) -> set[int]:
    return {r for row in layout for r in row}


def test_streams_are_admitted_with_simulated_promises_until_one_is_refused_with_its_reason():
    served, engine = _pooled()
    promises = []
    with pytest.raises(AdmissionRefused) as refused:
        for seed in range(50):
            promises.append(served.open_stream(StreamSpec(seed=seed, target_interval_ms=30.0)))
    assert 2 <= len(promises) < 50
    assert refused.value.resource == "compute"
    assert "ms" in refused.value.reason and "30.0" in refused.value.reason
    # every promise is what the simulator predicts for the pool with that stream: the target
    # met, a response latency, and the chunks in flight it takes
    for p in promises:
        assert p.target_interval_ms == 30.0
        assert 30.0 <= p.expected_interval_ms <= 30.0 * 1.01
        assert p.expected_response_latency_ms > 0 and p.pipeline_depth >= 2
    report = simulate_plans(list(served.controller.plans.values()), COST, PoolSimulation(), 2)
    assert report.all_meet_target
    assert len(engine.layouts) == len(promises)  # the refused one never reached the engine


def test_a_request_for_0_gets_the_fastest_target_the_pool_can_promise_it_now():
    probe, _ = _pooled(devices=1)
    request = StreamRequest(
        model=CFG, sampler=SAMPLER, target_interval_ms=1.0, chunks_per_interval=2
    )
    default = plan_default_target(probe.pool, COST, PoolSimulation(), request).target_interval_ms
    served, _ = _pooled(devices=1, default_target_ms=default)
    first = served.open_stream(StreamSpec(target_interval_ms=0.0))
    assert first.target_interval_ms == default  # on the empty pool: the default target
    with pytest.raises(AdmissionRefused, match=r"compute: .* no slower target"):  # it is taken
        served.open_stream(StreamSpec(seed=1, target_interval_ms=0.0))
    served.close_stream(first.stream_id)
    slow = served.open_stream(StreamSpec(seed=2, target_interval_ms=3 * default))
    second = served.open_stream(StreamSpec(seed=1, target_interval_ms=0.0))
    assert second.target_interval_ms > default  # beside another: slower, but admitted
    assert served.promise(slow.stream_id).target_interval_ms == 3 * default  # kept


def test_promises_are_revised_when_streams_join_and_leave():
    served, _ = _pooled(devices=1)
    # one worker, three streams at 32 ms: the third's chunks meet the others'
    first, second = (
        served.open_stream(StreamSpec(seed=seed, target_interval_ms=32.0)) for seed in (0, 1)
    )
    assert served.take_revisions() == []  # spread over the interval, the two never meet
    third = served.open_stream(StreamSpec(seed=2, target_interval_ms=32.0))
    revised = {p.stream_id: p for p in served.take_revisions()}
    assert set(revised) == {first.stream_id, second.stream_id}  # those there before
    for sid, before in ((first.stream_id, first), (second.stream_id, second)):
        assert revised[sid].revision == 1
        assert revised[sid].expected_response_latency_ms > before.expected_response_latency_ms
        assert served.promise(sid) == revised[sid]
    served.close_stream(third.stream_id)
    again = {p.stream_id: p for p in served.take_revisions()}
    assert set(again) == {first.stream_id, second.stream_id}
    assert again[first.stream_id].revision == 2
    assert again[first.stream_id].expected_response_latency_ms == pytest.approx(
        first.expected_response_latency_ms, rel=0.05
    )


def _finished(stream_id: int, latencies_ms: list[float], *, preview_steps: int = 0):
    return [
        ChunkOutput(
            stream_id=stream_id, chunk=c, frames=None, actions=None, entered_s=100.0 + c,
            left_s=100.0 + c + ms / 1e3, decoded_s=100.0 + c + ms / 1e3,
            preview_steps=preview_steps,
        )
        for c, ms in enumerate(latencies_ms)
    ]  # fmt: skip


def test_promises_follow_the_measured_latency():
    """A host slower than at calibration (other processes on it): once a stream's measured
    median is off its promise, every promise is simulated again with the costs scaled until
    the simulated pool gives that stream the latency measured (here, far from saturation,
    the measured ratio), and the streams are told; within the tolerance nothing changes."""
    served, engine = _pooled(devices=1)
    first = served.open_stream(StreamSpec(seed=0, target_interval_ms=64.0))
    second = served.open_stream(StreamSpec(seed=1, target_interval_ms=64.0))
    served.take_revisions()
    promised = first.expected_response_latency_ms

    start_up = [promised * 10] * RECALIBRATE_WARMUP_CHUNKS  # not timed
    near = start_up + [promised * 1.1] * RECALIBRATE_CHUNKS  # within the tolerance
    previews = [promised * 5] * RECALIBRATE_CHUNKS  # a preview is not a chunk's latency
    engine.finished = _finished(first.stream_id, near) + _finished(
        first.stream_id, previews, preview_steps=1
    )
    assert len(served.poll(0.0)) == len(near) + len(previews)  # handed on as they are
    assert served.measured_slowdown == 1.0 and served.take_revisions() == []

    engine.finished = _finished(first.stream_id, [promised * 2.0] * (RECALIBRATE_CHUNKS - 1))
    served.poll(0.0)
    assert served.measured_slowdown == 1.0  # not enough chunks yet
    engine.finished = _finished(first.stream_id, [promised * 2.0])
    served.poll(0.0)
    # the costs at which the simulated pool gives that stream the latency measured
    assert served.measured_slowdown == pytest.approx(2.0, rel=0.02)
    revised = {p.stream_id: p for p in served.take_revisions()}
    assert set(revised) == {first.stream_id, second.stream_id}  # every stream, both told
    assert revised[first.stream_id].revision == 1
    assert revised[first.stream_id].expected_response_latency_ms == pytest.approx(
        2.0 * promised, rel=0.02
    )
    assert float(served.info()["measured_slowdown"]) == pytest.approx(2.0, rel=0.02)

    # A stream admitted now is promised what the slower host gives.
    third = served.open_stream(StreamSpec(seed=2, target_interval_ms=64.0))
    assert third.expected_response_latency_ms > 1.5 * promised


def test_near_saturation_the_costs_are_fitted_to_the_latency_measured():
    """Seven streams on one worker: latency grows much faster than the costs there (17.8 ms
    at the calibration, 36 ms at x1.3, 274 ms at x2). A measured latency twice the promise
    gives the costs at which the simulated pool predicts it (about x1.3) and a promise equal
    to the measurement, not the costs scaled by the ratio (x2, a promise of 274 ms)."""
    served, engine = _pooled(devices=1)
    streams = [served.open_stream(StreamSpec(seed=s, target_interval_ms=64.0)) for s in range(7)]
    served.take_revisions()
    first = streams[0]
    promised = first.expected_response_latency_ms
    measured = [promised * 2.0] * (RECALIBRATE_WARMUP_CHUNKS + RECALIBRATE_CHUNKS)
    engine.finished = _finished(first.stream_id, measured)
    served.poll(0.0)
    assert 1.1 < served.measured_slowdown < 1.5
    revised = {p.stream_id: p for p in served.take_revisions()}
    assert revised[first.stream_id].expected_response_latency_ms == pytest.approx(
        2.0 * promised, rel=0.05
    )


def test_memory_refusal_names_the_device_and_the_shortfall():
    served, _ = _pooled(usable=1024.0)  # 1 KiB per worker: not even one block's weights
    with pytest.raises(AdmissionRefused) as refused:
        served.open_stream(StreamSpec(target_interval_ms=100.0))
    assert refused.value.resource == "memory"
    assert "device" in refused.value.reason and "GiB" in refused.value.shortfall


def test_static_policy_gives_each_stream_its_own_workers():
    served, engine = _pooled(devices=4, policy="static")
    for seed in range(2):
        served.open_stream(StreamSpec(seed=seed, target_interval_ms=100.0))
    first, second = (_ranks(engine.layouts[sid]) for sid in sorted(engine.layouts))
    assert first and second and not first & second


def test_a_placement_given_by_hand_is_used_and_checked():
    S = SAMPLER.steps * CFG.num_blocks
    given = tuple([0] * (S // 2) + [1] * (S // 2))
    served, engine = _pooled(stage_devices=given)
    served.open_stream(StreamSpec(target_interval_ms=100.0))
    assert tuple(r for row in engine.layouts[0] for r in row) == given
    with pytest.raises(AdmissionRefused, match="device"):
        for seed in range(1, 50):
            served.open_stream(StreamSpec(seed=seed, target_interval_ms=100.0))
    assert all(tuple(r for row in lay for r in row) == given for lay in engine.layouts.values())


def test_default_target_is_the_fastest_the_simulator_confirms():
    pool = PoolConfig(num_devices=2, usable_bytes=GIB, memory=MemoryModel(dtype_bytes=4))
    request = StreamRequest(model=CFG, sampler=SAMPLER, target_interval_ms=1.0)
    plan = plan_default_target(pool, COST, PoolSimulation(), request)
    assert plan.report.all_meet_target
    faster = dataclasses.replace(plan.plan, target_interval_ms=plan.target_interval_ms * 0.6)
    assert not simulate_plans([faster], COST, PoolSimulation(), 2).all_meet_target
    assert plan.describe().startswith(f"default target {plan.target_interval_ms:.1f} ms")


@pytest.mark.parametrize(
    ("p50_ms", "mean_ms", "reason", "shortfall"),
    [
        (55.0, 56.0, "predicted interval 55.0 ms for the new stream vs target 50.0 ms", "5.0 ms"),
        # on median it keeps up; with no headroom its chunks still fall behind their slots
        (49.6, 51.2, "the new stream would fall behind its 50.0 ms slots: 13 of 16", "13 late"),
    ],
)
def test_a_compute_refusal_says_what_falls_short(p50_ms, mean_ms, reason, shortfall):
    served, _ = _pooled()
    late = SimpleNamespace(
        meets_target=False,
        interval_p50_ms=p50_ms,
        interval_mean_ms=mean_ms,
        deadline_misses=13,
        chunks_measured=16,
    )
    report = SimpleNamespace(streams=[late], devices=[SimpleNamespace(device=0, utilization=1.0)])
    refused = served._missing(report, [SimpleNamespace(target_interval_ms=50.0)])
    assert refused.resource == "compute"
    assert reason in refused.reason and "device 0 busy 100%" in refused.reason
    assert refused.shortfall.startswith(shortfall)
    assert "0.0 ms" not in refused.shortfall
