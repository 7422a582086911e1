"""Discrete-event simulator: scheduling rules, intervals, latency, misses; the experiments."""

import json
import subprocess
import sys

import pytest

from physis_ros.engine.config import SamplerConfig, get_preset
from physis_ros.engine.pool.costmodel import H200, AnalyticCostModel, Profile, ProfileCostModel
from physis_ros.engine.pool.costmodel import ProfileEntry as E
from physis_ros.engine.pool.memory import MemoryModel
from physis_ros.engine.pool.plan import StreamPlan
from physis_ros.engine.pool.simulator import SimConfig, SimStream, simulate
from physis_ros.tools.experiments.depth import depth, load_measured
from physis_ros.tools.experiments.pool24 import pool24

from physis_testing import REPO_ROOT

TINY = get_preset("tiny")  # L = 2
K2 = SamplerConfig(steps=2, window=2)


def _cost(batch_ms=(1.0, 1.5, 2.0, 3.0), hop_ms=0.25, overlap=True):
    entries = tuple(
        E(tasks=b, ms_p50=t, ms_p99=t) for b, t in zip((1, 2, 4, 8), batch_ms, strict=True)
    )
    return ProfileCostModel(
        Profile(
            device="test",
            model="tiny",
            steps=2,
            window=2,
            dtype="float32",
            entries=entries,
            hop_ms=hop_ms,
            comm_overlaps_compute=overlap,
        )
    )


def _plan(sid, devices, target_ms=0.0):
    return StreamPlan(
        stream_id=sid,
        model=TINY,
        sampler=K2,
        target_interval_ms=target_ms,
        stage_devices=tuple(devices),
    )


def test_one_stream_one_device_as_fast_as_it_goes():
    rep = simulate(
        [SimStream(plan=_plan(0, [0] * 4), max_inflight=8)],
        _cost(),
        SimConfig(num_devices=1, chunks=20, warmup_chunks=6),
    )
    s = rep.streams[0]
    # 4 stages of 1 ms each per chunk, but with several chunks in flight the worker batches
    # stages of the same block across chunks: the interval is at most 4 ms.
    assert s.interval_p50_ms <= 4.0 + 1e-9
    unbatched = simulate(
        [SimStream(plan=_plan(0, [0] * 4), max_inflight=8)],
        _cost(),
        SimConfig(num_devices=1, chunks=20, warmup_chunks=6, batching=False),
    )
    assert unbatched.streams[0].interval_p50_ms == pytest.approx(4.0)
    assert unbatched.devices[0].mean_batch == 1.0
    assert rep.devices[0].mean_batch > 1.0


def test_pipeline_over_devices_interval_is_the_slowest_device_and_latency_adds_hops():
    # 4 stages on 4 devices, one chunk in flight at a time: latency = 4 stages + 3 hops.
    one = simulate(
        [SimStream(plan=_plan(0, [0, 1, 2, 3]), max_inflight=1)],
        _cost(),
        SimConfig(num_devices=4, chunks=10, warmup_chunks=2),
    )
    assert one.streams[0].latency_p50_ms == pytest.approx(4 * 1.0 + 3 * 0.25)
    # enough chunks in flight: one chunk per stage time
    full = simulate(
        [SimStream(plan=_plan(0, [0, 1, 2, 3]), max_inflight=8)],
        _cost(),
        SimConfig(num_devices=4, chunks=30, warmup_chunks=10, batching=False),
    )
    assert full.streams[0].interval_p50_ms == pytest.approx(1.0)
    assert all(d.utilization == pytest.approx(1.0, abs=0.02) for d in full.devices)
    # uneven split: device 0 holds 3 stages -> interval 3 ms, device 1 idle 2/3 of the time
    uneven = simulate(
        [SimStream(plan=_plan(0, [0, 0, 0, 1]), max_inflight=8)],
        _cost(),
        SimConfig(num_devices=2, chunks=30, warmup_chunks=10, batching=False),
    )
    assert uneven.streams[0].interval_p50_ms == pytest.approx(3.0)
    assert uneven.devices[1].utilization == pytest.approx(1 / 3, abs=0.03)


def test_sends_that_block_compute_lengthen_the_interval():
    plan = _plan(0, [0, 0, 1, 1])
    cfg = SimConfig(num_devices=2, chunks=30, warmup_chunks=10, batching=False)
    overl = simulate([SimStream(plan=plan, max_inflight=8)], _cost(overlap=True), cfg)
    block = simulate([SimStream(plan=plan, max_inflight=8)], _cost(overlap=False), cfg)
    assert overl.streams[0].interval_p50_ms == pytest.approx(2.0)
    assert block.streams[0].interval_p50_ms == pytest.approx(2.25)


def test_paced_streams_meet_a_feasible_target_and_miss_an_infeasible_one():
    cost = _cost(batch_ms=(1.0, 2.0, 4.0, 8.0))  # no batching gain
    streams = [
        SimStream(plan=_plan(i, [0] * 4, target_ms=10.0), phase_ms=2.5 * i) for i in range(2)
    ]
    ok = simulate(streams, cost, SimConfig(num_devices=1, chunks=30))
    assert ok.all_meet_target
    for s in ok.streams:
        assert s.interval_p50_ms == pytest.approx(10.0) and s.deadline_misses == 0
    assert ok.devices[0].utilization == pytest.approx(0.8, abs=0.05)
    # three streams need 12 ms per 10 ms interval: they fall behind
    over = [SimStream(plan=_plan(i, [0] * 4, target_ms=10.0), phase_ms=i) for i in range(3)]
    bad = simulate(over, cost, SimConfig(num_devices=1, chunks=30))
    assert not bad.all_meet_target
    assert max(s.interval_p50_ms for s in bad.streams) > 10.0
    assert sum(s.deadline_misses for s in bad.streams) > 0


def test_latency_promise_misses_are_counted():
    plan = _plan(0, [0] * 4, target_ms=10.0)
    rep = simulate(
        [SimStream(plan=plan, latency_budget_ms=3.0)], _cost(), SimConfig(num_devices=1, chunks=12)
    )
    s = rep.streams[0]
    assert s.latency_p50_ms == pytest.approx(4.0)
    assert s.latency_promise_misses == s.chunks_measured and s.meets_target


@pytest.mark.parametrize("priority", ["oldest_chunk", "ready_first", "engine"])
def test_every_priority_rule_keeps_per_stage_fifo_and_finishes(priority):
    streams = [
        SimStream(plan=_plan(i, [i % 2, 0, 1, i % 2], target_ms=6.0), phase_ms=i * 0.7)
        for i in range(3)
    ]
    rep = simulate(streams, _cost(), SimConfig(num_devices=2, chunks=16, priority=priority))
    assert rep.tasks == 3 * 16 * 4
    assert all(s.interval_mean_ms == pytest.approx(6.0, rel=0.15) for s in rep.streams)


def test_simulator_rejects_bad_input():
    with pytest.raises(ValueError, match="device >= num_devices"):
        simulate(
            [SimStream(plan=_plan(0, [0, 0, 0, 5]), max_inflight=1)],
            _cost(),
            SimConfig(num_devices=2),
        )
    with pytest.raises(ValueError, match="max_inflight"):
        simulate([SimStream(plan=_plan(0, [0] * 4))], _cost(), SimConfig(num_devices=1))
    with pytest.raises(ValueError, match="priority"):
        SimConfig(num_devices=1, priority="random")
    with pytest.raises(ValueError, match="chunks"):
        SimConfig(num_devices=1, chunks=5, warmup_chunks=4)


def test_memory_is_reported_per_device():
    cfg = get_preset("wan2.1-1.3b")
    plan = StreamPlan(
        stream_id=0,
        model=cfg,
        sampler=SamplerConfig(steps=4, window=2),
        target_interval_ms=1600.0,
        stage_devices=(0,) * 60 + (1,) * 60,
    )
    rep = simulate(
        [SimStream(plan=plan)],
        AnalyticCostModel(H200),
        SimConfig(num_devices=3, chunks=10),
        MemoryModel(),
    )
    assert rep.devices[0].memory["weights_gib"] > 2.0
    assert rep.devices[1].memory["buffers_gib"] > 0
    assert rep.devices[2].memory["total_gib"] == 0.0


def test_depth_experiment_interval_is_one_stage_and_latency_the_whole_pipe():
    out = depth()
    assert out["gpus"] == 200
    assert out["interval_ms"] == pytest.approx(out["stage_ms"], rel=1e-6)
    assert out["hops_intra_node"] + out["hops_inter_node"] == 199
    pipe = (
        200 * out["stage_ms"]
        + out["hops_intra_node"] * out["hop_ms_intra_node"]
        + (out["hops_inter_node"] * out["hop_ms_inter_node"])
    )
    assert out["pipeline_latency_ms"] == pytest.approx(pipe, abs=0.01)  # rounded inputs
    assert out["response_latency_ms"] == pytest.approx(pipe + out["interval_ms"], abs=0.01)
    assert out["published_interval_ms"] == 4.083
    # the gap to the published figure is the chunk size: the stage time scales with tokens
    rows = {(r["latent_frames"], r["window"]): r for r in out["by_chunk_size_and_window"]}
    assert rows[3, 2]["modelled_interval_ms"] == pytest.approx(out["interval_ms"], 1e-3)
    assert rows[3, 2]["modelled_response_latency_ms"] == pytest.approx(
        out["response_latency_ms"], abs=0.1
    )
    assert rows[1, 2]["tokens_per_chunk"] == 1560
    assert rows[1, 2]["modelled_interval_ms"] < 4.083 < out["interval_ms"]
    for f in (1, 2, 3):  # a longer window costs interval and latency
        ms = [rows[f, w]["modelled_interval_ms"] for w in (1, 2, 3, 6)]
        assert ms == sorted(ms) and ms[0] < ms[-1]
    assert out["what_it_takes"]["basis"] == f"the cost model: {H200.name}"
    assert {"latent_frames": 1, "window": 2} in out["what_it_takes"]["reaching_4.083_ms"]


def test_depth_experiment_with_block_times_measured_on_an_h200(tmp_path):
    """docs/pool/h200_block_times.json: one 33B block-task measured on an H200 per chunk
    size and window; a 1-latent-frame chunk with W <= 3 reaches the published 4.083 ms."""
    measured = load_measured(REPO_ROOT / "docs" / "pool" / "h200_block_times.json")
    out = depth(measured=measured)
    rows = {(r["latent_frames"], r["window"]): r for r in out["by_chunk_size_and_window"]}
    assert rows[3, 2]["measured_block_ms"] == measured["dit-33b", 3, 2]
    assert rows[3, 2]["measured_interval_ms"] > 4.083
    assert out["what_it_takes"]["basis"] == "measured block-tasks"
    reach = out["what_it_takes"]["reaching_4.083_ms"]
    assert reach and all(r["latent_frames"] == 1 for r in reach)
    bad = tmp_path / "bad.json"
    bad.write_text('{"rows": [{"model": "dit-33b"}]}')
    with pytest.raises(ValueError, match="not a depth_block_times JSON"):
        load_measured(bad)


@pytest.mark.slow
def test_pool24_shared_verified_at_least_static_for_every_backbone():
    out = pool24()
    assert [r["backbone"] for r in out["rows"]] == [
        "wan2.1-1.3b",
        "wan2.2-ti2v-5b",
        "wan2.1-14b",
        "dit-22b",
        "dit-33b",
    ]
    for row in out["rows"]:
        assert row["static"] >= 1
        assert row["shared"] >= row["static"], row
        assert row["ratio"] == pytest.approx(row["shared"] / row["static"], abs=1e-3)
        d = out["details"][row["backbone"]]
        assert d["shared"]["verified"] <= d["shared"]["admitted"]
        # every admitted stream's predicted pipeline latency held in simulation
        assert d["shared"]["latency_promise_misses"] == d["static"]["latency_promise_misses"] == 0
        # the bound: no placement beats it, and a row under 1.7x says why
        assert row["shared"] / row["static"] <= row["bound_ratio_at_cap"] + 1e-9
        if not row["meets_target"]:
            bound = d["bound"]
            assert bound["limited_by"] == "compute"
            if bound["target_reachable"]:  # only above the admission's headroom
                assert row["at_utilization"]["max_utilization"] > 0.9
                assert row["at_utilization"]["ratio"] >= 1.7
            else:
                assert row["bound_ratio_at_100_percent"] < 1.7
    rows = {r["backbone"]: r for r in out["rows"]}
    assert rows["wan2.1-1.3b"]["meets_target"] and rows["wan2.2-ti2v-5b"]["meets_target"]
    a = out["assumptions"]
    assert a["target_interval_ms"] == 1600.0 and a["devices"] == 24
    assert a["K"] == 4 and a["W"] == 2 and a["device"]["peak_flops"] == 989e12
    assert {"static", "shared"} <= set(a["policies"])
    assert a["memory"]["dtype_bytes"] == 2 and a["memory"]["usable_bytes_per_gpu"] > 0
    for d in out["details"].values():  # chunk size and resolution stated per backbone
        assert {"resolution", "tokens_per_chunk", "chunk_latent_frames", "stage_ms"} <= set(d)


def test_physis_sim_cli_depth_json_and_bad_input():
    run = subprocess.run(
        [sys.executable, "-m", "physis_ros.tools.sim_cli", "--experiment", "depth", "--json"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    out = json.loads(run.stdout)
    assert {"interval_ms", "response_latency_ms", "assumptions"} <= set(out)
    bad = subprocess.run(
        [sys.executable, "-m", "physis_ros.tools.sim_cli", "--model", "nope"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert bad.returncode == 2 and "unknown model preset 'nope'" in bad.stderr


def test_devices_sharing_host_cores_slow_down_and_the_sink_hop_adds_latency():
    plan = _plan(0, [0, 1, 2, 3])
    free = SimConfig(num_devices=4, chunks=30, warmup_chunks=10, batching=False)
    shared = SimConfig(num_devices=4, chunks=30, warmup_chunks=10, batching=False, host_cores=2)
    a = simulate([SimStream(plan=plan, max_inflight=8)], _cost(), free)
    b = simulate([SimStream(plan=plan, max_inflight=8)], _cost(), shared)
    assert a.streams[0].interval_p50_ms == pytest.approx(1.0)
    # four busy single-stage devices on two cores: each runs at half speed
    assert b.streams[0].interval_p50_ms == pytest.approx(2.0, rel=0.02)
    one = SimConfig(num_devices=4, chunks=10, warmup_chunks=2, sink_device=0)
    c = simulate([SimStream(plan=plan, max_inflight=1)], _cost(), one)
    assert c.streams[0].latency_p50_ms == pytest.approx(4 * 1.0 + 4 * 0.25)
    with pytest.raises(ValueError, match="sink_device 7"):
        SimConfig(num_devices=4, sink_device=7)


def test_message_processor_time_loads_both_ends_and_forward_scale_slows_forwards():
    """CPU ranks: a hop costs the sender send_cpu_ms and the receiver recv_cpu_ms of work,
    the sink pays the controller's chunk_overhead_ms, forward_scale stretches forwards and
    worker_message_ms charges both ends' workers."""
    prof = Profile(
        device="test",
        model="tiny",
        steps=2,
        window=2,
        dtype="float32",
        entries=(E(tasks=1, ms_p50=1.0, ms_p99=1.0),),
        hop_ms=0.6,
        send_cpu_ms=0.2,
        recv_cpu_ms=0.3,
        chunk_overhead_ms=0.4,
    )
    plan = _plan(0, [0, 0, 1, 1])

    def interval_ms(**config) -> float:
        cfg = SimConfig(
            num_devices=2, chunks=30, warmup_chunks=10, batching=False, sink_device=0, **config
        )
        rep = simulate([SimStream(plan=plan, max_inflight=8)], ProfileCostModel(prof), cfg)
        return rep.streams[0].interval_p50_ms

    # device 0: 2 stages + 1 send + 1 receive (the finished chunk) + the controller's share
    assert interval_ms() == pytest.approx(2.0 + 0.2 + 0.3 + 0.4)
    assert interval_ms(forward_scale=1.5) == pytest.approx(1.5 * 2.0 + 0.2 + 0.3 + 0.4)
    # worker_message_ms: device 0's worker pays it for its send and for the finished chunk
    assert interval_ms(worker_message_ms=0.1) == pytest.approx(2.0 + 0.2 + 0.3 + 0.4 + 2 * 0.1)
    # one chunk in flight: its stages, both sends, the wire time left of each hop, device 1's
    # receive, and device 0 first pays the previous chunk's arrival (receive + controller)
    one = simulate(
        [SimStream(plan=plan, max_inflight=1)],
        ProfileCostModel(prof),
        SimConfig(num_devices=2, chunks=10, warmup_chunks=2, batching=False, sink_device=0),
    )
    wire = 0.6 - 0.2 - 0.3
    want = 4 * 1.0 + 2 * (0.2 + wire) + 0.3 + (0.3 + 0.4)
    assert one.streams[0].latency_p50_ms == pytest.approx(want)
    with pytest.raises(ValueError, match="forward_scale"):
        SimConfig(num_devices=1, forward_scale=0.0)
    with pytest.raises(ValueError, match="worker_message_ms"):
        SimConfig(num_devices=1, worker_message_ms=-0.1)


def test_message_threads_serve_messages_beside_the_worker():
    """comm_threads (gloo ranks): a message takes the sender's send thread, the wire and the
    receiver's receive thread, in that order, and never stops either worker; on a shared host
    the threads' processor time slows everything that runs at the same time."""
    prof = Profile(
        device="test",
        model="tiny",
        steps=2,
        window=2,
        dtype="float32",
        entries=(E(tasks=1, ms_p50=1.0, ms_p99=1.0),),
        hop_ms=0.6,
        comm_threads=True,
        send_cpu_ms=0.2,
        recv_cpu_ms=0.3,
    )
    plan = _plan(0, [0, 0, 1, 1])

    def run(inflight: int, cores: float, worker_message_ms: float = 0.0):
        cfg = SimConfig(
            num_devices=2,
            chunks=30,
            warmup_chunks=10,
            batching=False,
            sink_device=0,
            host_cores=cores,
            worker_message_ms=worker_message_ms,
        )
        return simulate([SimStream(plan=plan, max_inflight=inflight)], ProfileCostModel(prof), cfg)

    # each device only runs its 2 stages: the messages' time is on other threads
    assert run(8, 0.0).streams[0].interval_p50_ms == pytest.approx(2.0)
    # one chunk in flight: 4 stages and 2 hops of hop_ms (send thread + wire + receive thread)
    assert run(1, 0.0).streams[0].latency_p50_ms == pytest.approx(4 * 1.0 + 2 * 0.6)
    # one core for both workers and all threads: per chunk 4 ms of stages + 2 x 0.5 ms of
    # message threads
    assert run(8, 1.0).streams[0].interval_p50_ms == pytest.approx(5.0, rel=0.02)
    # what the messages cost the workers: each device's worker sends one and receives one
    assert run(8, 0.0, 0.25).streams[0].interval_p50_ms == pytest.approx(2.0 + 2 * 0.25)


def test_other_jobs_on_the_host_share_its_cores():
    """One busy device on two cores runs at full speed next to one foreign job; two busy
    devices next to it share the two cores three ways."""
    one = _plan(0, [0, 0, 0, 0])
    two = _plan(0, [0, 0, 1, 1])

    def interval(plan, devices, foreign):
        cfg = SimConfig(
            num_devices=devices,
            chunks=30,
            warmup_chunks=10,
            batching=False,
            host_cores=2,
            foreign_load=foreign,
        )
        rep = simulate([SimStream(plan=plan, max_inflight=8)], _cost(), cfg)
        return rep.streams[0].interval_p50_ms

    assert interval(one, 1, 1.0) == pytest.approx(4.0)
    assert interval(two, 2, 0.0) == pytest.approx(2.0)
    assert interval(two, 2, 1.0) == pytest.approx(2.0 * 3 / 2, rel=0.02)
    with pytest.raises(ValueError, match="foreign_load"):
        SimConfig(num_devices=1, foreign_load=-1.0)
