"""The engine core over real gloo ranks (child processes; this test process is rank 0).

Output equals the offline oracle for 2 and 4 ranks, several placements, 2 streams; a killed
rank fails exactly the streams placed on it, within the fault timeout, naming the rank;
shutdown leaves no process and no bound port behind.
"""

from __future__ import annotations

import os
import signal
import socket
import time

import pytest
import torch
from stream_plans import (
    live_random_plan,
    random_plan,
    run_live_plans,
    run_plans,
    tiny_cond,
    worst_oracle_error,
)

from physis_ros.engine import oracle
from physis_ros.engine.api import StreamFailed, StreamSpec
from physis_ros.engine.config import get_preset
from physis_ros.engine.core import EngineCore
from physis_ros.engine.ranks.config import RuntimeConfig
from physis_ros.engine.ranks.executor import ranks_engine
from physis_ros.engine.ranks.launch import RANK_VARS

torch.set_num_threads(1)
TOL = 1e-5
DEVICE = os.environ.get("PHYSIS_TEST_DEVICE", "cpu")
"""``cuda`` on a GPU machine (benchmarks/gpu_check.sh): every rank computes on the GPU."""
ORACLE_DEVICE = "cuda" if DEVICE == "cuda" else "cpu"


def _cfg(**kw) -> RuntimeConfig:
    base = dict(
        device=DEVICE,
        model="tiny",
        steps=4,
        window=2,
        heartbeat_interval_s=0.2,
        # Generous: a live rank starved of CPU on a busy machine must not be declared dead
        # (3 s did that under load). The fault test sets its own, shorter one.
        fault_timeout_s=30.0,
        comm_timeout_s=60.0,
        startup_timeout_s=120.0,
    )
    base.update(kw)
    return RuntimeConfig(**base)


def _assert_clean_exit(engine: EngineCore) -> None:
    port = engine.executor.master_port
    # torchrun's variables were set only while rank 0 joined: a physis-serve started later by
    # this process must not think it runs under torchrun
    assert not set(RANK_VARS) & set(os.environ)
    assert [p.poll() for p in engine.executor.procs] == [0] * len(engine.executor.procs)
    with socket.socket() as sock:  # the store's port is free again
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", port))


# (world size, default placement, per-stream layouts: None = the default placement)
CASES = {
    "2 ranks, even, 2 streams": (2, "even", [None, None]),
    "2 ranks, uneven groups + all on rank 1": (2, "groups:3,5", [None, ((1, 1),) * 4]),
    "4 ranks, even + interleaved": (
        4,
        "even",
        [None, tuple(tuple((k + blk) % 4 for blk in range(2)) for k in range(4))],
    ),
    "4 ranks, uneven groups + one block per rank pair": (
        4,
        "groups:1,3,2,2",
        [None, ((0, 1), (2, 3), (0, 1), (2, 3))],
    ),
    "2 ranks, balanced by costs measured on the ranks": (2, "balanced", [None, None]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_dist_output_equals_oracle(case):
    world, placement, layouts = CASES[case]
    cfg = _cfg(placement=placement)
    specs = {}
    plans = {}
    with ranks_engine(cfg, world_size=world) as engine:
        for i, layout in enumerate(layouts):
            spec = StreamSpec(seed=11 + i, prompt_embedding=tiny_cond(200 + i))
            promise = engine.open_stream(spec, layout=layout)
            assert promise.steps == 4 and promise.blocks == 2
            specs[promise.stream_id] = spec
            plans[promise.stream_id] = random_plan(_cfg().model_config, i, 5, context_at=(0, 3))
        got = run_plans(engine, plans)
    _assert_clean_exit(engine)
    assert worst_oracle_error(cfg, plans, specs, got, device=ORACLE_DEVICE) <= TOL


ANCHOR_RESIDUAL = get_preset("tiny", action_mode="condition", prediction="x0", anchor_residual=True)
"""A model whose generated chunks carry their anchor frame (push-wm's head)."""


@pytest.mark.parametrize(
    ("world", "placement", "horizon", "rollouts", "model"),
    [
        (2, "even", 3, False, None),
        (4, "groups:1,3,2,2", 2, False, None),
        (2, "groups:5,3", 3, True, None),
        (2, "even", 3, True, ANCHOR_RESIDUAL),
    ],
    ids=["2 ranks", "4 ranks", "rollouts", "rollouts, anchor residual"],
)
def test_live_streams_with_observations_in_flight_equal_the_live_oracle(
    world, placement, horizon, rollouts, model
):
    """Observations replace predicted slots while chunks are in flight on the ranks (with
    ``rollouts``, each observation generates its horizon again); every chunk equals the live
    oracle version by version and carries its anchor (DESIGN.md §3)."""
    cfg = _cfg(placement=placement, resolved_config=model)
    specs, plans = {}, {}
    with ranks_engine(cfg, world_size=world) as engine:
        for i in range(2):
            spec = StreamSpec(seed=41 + i, prompt_embedding=tiny_cond(500 + i), horizon=horizon)
            promise = engine.open_stream(spec)
            assert promise.horizon == horizon
            specs[promise.stream_id] = spec
            plans[promise.stream_id] = live_random_plan(
                cfg.model_config, i, horizon=horizon, observations=7, rollouts=rollouts
            )
        got, mid_flight = run_live_plans(engine, plans)
    _assert_clean_exit(engine)
    assert mid_flight > 5
    for sid, plan in plans.items():
        versions = [(v.slot, v.anchor) for v in oracle.versions(plan, cfg.window) if not v.observed]
        assert sorted(got[sid]) == sorted(versions)
        if rollouts:  # some slots were generated again
            assert len({slot for slot, _ in versions}) < len(versions)
    assert worst_oracle_error(cfg, plans, specs, got, device=ORACLE_DEVICE, by_anchor=True) <= TOL


def test_placement_computed_from_costs_loads_missing_blocks_and_equals_oracle():
    # groups:1,3,2,2 leaves rank 0 with block 0 only. Costs where block 1 is 3x block 0 give
    # the layout [(0,0),(0,1)] [(1,0),(1,1)] ... : rank 0 must load block 1 first.
    cfg = _cfg(placement="groups:1,3,2,2")
    with ranks_engine(cfg, world_size=4) as engine:
        assert engine.executor.rank_blocks[0] == {0}
        measured = engine.executor.measure_block_costs(repeats=3)
        assert sorted(measured) == [0, 1, 2, 3]
        assert set(measured[0]) == {0} and all(
            ms > 0 for c in measured.values() for ms in c.values()
        )
        layout = engine.executor.balanced_layout({0: 1.0, 1: 3.0})
        assert layout == ((0, 0), (1, 1), (2, 2), (3, 3))
        with pytest.raises(Exception, match="does not hold blocks"):
            engine.open_stream(StreamSpec(seed=1), layout=layout)
        engine.load_blocks(layout)
        assert engine.executor.rank_blocks[0] == {0, 1}
        specs, plans = {}, {}
        for i, lay in enumerate([layout, None]):
            spec = StreamSpec(seed=21 + i, prompt_embedding=tiny_cond(300 + i))
            sid = engine.open_stream(spec, layout=lay).stream_id
            specs[sid], plans[sid] = spec, random_plan(_cfg().model_config, i, 5, context_at=(0, 2))
        got = run_plans(engine, plans)
    _assert_clean_exit(engine)
    assert worst_oracle_error(cfg, plans, specs, got, device=ORACLE_DEVICE) <= TOL


# (world size, default placement, layouts stream 0 moves through while running)
RELAYOUTS = {
    "2 ranks: even -> uneven -> back": (2, "even", [((0, 1), (1, 1), (1, 1), (1, 1)), None]),
    "4 ranks: even -> reversed -> interleaved": (
        4,
        "even",
        [
            ((3, 3), (2, 2), (1, 1), (0, 0)),
            tuple(tuple((k + blk) % 4 for blk in range(2)) for k in range(4)),
        ],
    ),
}


@pytest.mark.parametrize("case", list(RELAYOUTS))
def test_running_stream_moves_to_new_layouts_and_equals_oracle(case):
    world, placement, moves = RELAYOUTS[case]
    cfg = _cfg(placement=placement)
    specs, plans, got = {}, {}, {}
    with ranks_engine(cfg, world_size=world) as engine:
        default = engine.executor.default_layout
        for i in range(2):
            spec = StreamSpec(seed=31 + i, prompt_embedding=tiny_cond(400 + i))
            sid = engine.open_stream(spec, max_in_flight=3).stream_id
            specs[sid], plans[sid], got[sid] = (
                spec,
                random_plan(_cfg().model_config, i, 12, context_at=(0, 6)),
                {},
            )
            for kind, val in plans[sid]:
                if kind == "context":
                    engine.submit_context_x(sid, val)
                else:
                    engine.submit_generate(sid)
        firsts, deadline = [], time.monotonic() + 90
        while sum(map(len, got.values())) < 20:
            assert time.monotonic() < deadline, got
            for res in engine.poll_results(0.1):
                got[res.stream_id][res.chunk] = res.x.cpu()
            done = len(got[0])
            if moves and done >= 2 * (len(firsts) + 1):
                layout = moves.pop(0)
                firsts.append(engine.relayout(0, default if layout is None else layout))
        stats = engine.executor.stats()
    _assert_clean_exit(engine)
    assert 0 < firsts[0] <= firsts[-1] < 12 and not moves  # moved twice, mid-stream
    moved = sum(s.get("rings_sent", 0) for s in engine.executor.rank_stats.values())
    assert moved > 0, engine.executor.rank_stats
    assert not stats["worker_drops"]
    assert worst_oracle_error(cfg, plans, specs, got, device=ORACLE_DEVICE) <= TOL


FAULT_TIMEOUT_S = 6.0


@pytest.mark.parametrize("fault", [signal.SIGKILL, signal.SIGSTOP], ids=["dead", "hung"])
def test_failed_rank_fails_its_streams_within_timeout_and_others_finish(fault):
    cfg = _cfg(placement="even", fault_timeout_s=FAULT_TIMEOUT_S)
    layout_a = ((0, 1),) * 4  # ranks 0 and 1
    layout_b = ((0, 2),) * 4  # ranks 0 and 2
    with ranks_engine(cfg, world_size=3) as engine:
        spec_a, spec_b = (
            StreamSpec(seed=1, prompt_embedding=tiny_cond(5)),
            StreamSpec(seed=2, prompt_embedding=tiny_cond(6)),
        )
        sid_a = engine.open_stream(spec_a, layout=layout_a).stream_id
        sid_b = engine.open_stream(spec_b, layout=layout_b).stream_id
        # warm both streams up, then kill rank 2 mid-stream
        first = run_plans(engine, {sid_a: [("generate", None)], sid_b: [("generate", None)]})
        assert first[sid_a] and first[sid_b]
        for _ in range(4):
            engine.submit_generate(sid_b)
        victim = engine.executor.procs[1]  # rank 2
        victim.send_signal(fault)
        killed_s = time.monotonic()
        failure = None
        while failure is None and time.monotonic() - killed_s < 4 * cfg.fault_timeout_s:
            try:
                engine.poll_results(0.1)
            except StreamFailed as err:
                failure = err
        detected_s = time.monotonic() - killed_s
        assert failure is not None, "the killed rank was never reported"
        assert failure.rank == 2 and failure.stream_id == sid_b
        assert "rank 2" in str(failure)
        # Within two fault intervals (one is the bound on an idle machine; the loop above
        # returns as soon as it is reported, so an idle run takes ~fault_timeout_s).
        assert detected_s < 2 * cfg.fault_timeout_s, f"reported after {detected_s:.1f} s"
        with pytest.raises(StreamFailed, match="rank 2"):
            engine.submit_generate(sid_b)
        # stream A (ranks 0, 1) is untouched and still matches the oracle
        plan_a = [("generate", None)] * 4
        rest = run_plans(engine, {sid_a: plan_a[1:]})
        shutdown_s = time.monotonic()
    shutdown_s = time.monotonic() - shutdown_s
    assert shutdown_s < 4 * cfg.fault_timeout_s  # a hung rank is reaped, not waited on
    assert [p.poll() is not None for p in engine.executor.procs] == [True, True]
    assert engine.executor.procs[0].returncode == 0
    got_a = {**first[sid_a], **rest[sid_a]}
    assert (
        worst_oracle_error(
            cfg, {sid_a: plan_a}, {sid_a: spec_a}, {sid_a: got_a}, device=ORACLE_DEVICE
        )
        <= TOL
    )
