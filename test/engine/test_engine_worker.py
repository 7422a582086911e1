"""Worker boundary: placement objects, batching, drops with reasons, stream lifecycle."""

from __future__ import annotations

import threading

import pytest
import torch
from engine_helpers import SAMPLER, TOL, plan_for

from physis_ros.engine import oracle
from physis_ros.engine.forward import make_cond
from physis_ros.engine.pipeline import run_plan
from physis_ros.engine.placement import (
    Placement,
    layout_even,
    layout_groups,
    layout_one_stage_per_worker,
    layout_single,
)
from physis_ros.engine.stage import measure_block_ms, time_block_forward
from physis_ros.engine.threads import InProcRuntime
from physis_ros.engine.transport import FLAG_CONTEXT, Activation, InProcTransport
from physis_ros.engine.worker import Worker

K, L = SAMPLER.steps, 2


def test_placement_constructors_and_printing():
    p = Placement.even(K, L, 4, streams=(0, 1))
    assert p.num_workers == 4
    sizes = [len([1 for s, _, _ in p.stages_on(r) if s == 0]) for r in range(4)]
    assert sizes == [2, 2, 1, 1]
    assert p.entry_rank(0) == 0 and p.worker_of(0, K, 0) == p.sink_rank
    text = str(p)
    assert "stream 1: stages (0,0)..(0,1) [2] -> worker 0" in text
    assert len(p.virtual_ranks()) == 8
    assert layout_one_stage_per_worker(K, L)[2][1] == 5
    assert layout_groups(K, L, [1, 3, 2]) == ((0, 1), (1, 1), (2, 2))
    assert Placement.single(K, L).blocks_on(0) == {0, 1}
    assert Placement.groups(K, L, [1, 5]).blocks_on(0) == {0}
    with pytest.raises(ValueError, match=r"group sizes \[1, 1\] must"):
        layout_groups(K, L, [1, 1])
    with pytest.raises(ValueError, match="7 workers but only 6 stages"):
        layout_even(K, L, 7)
    with pytest.raises(ValueError, match="outside"):
        Placement.uniform(layout_single(K, L, rank=3), num_workers=2)


def test_clean_history_needs_blocks_on_one_worker(tiny):
    rt = InProcRuntime(tiny, SAMPLER, layout_one_stage_per_worker(K, L))
    with pytest.raises(ValueError, match="every block's stages must be on one worker"):
        rt.open_stream(0, mode="sequential-clean")


def test_batching_groups_tasks_of_one_block(tiny):
    plans = {s: plan_for(tiny, s) for s in range(2)}
    batched = InProcRuntime(tiny, SAMPLER, layout_single(K, L), batching=True)
    run_plan(batched, plans, mode="pipelined")
    single = InProcRuntime(tiny, SAMPLER, layout_single(K, L), batching=False)
    run_plan(single, plans, mode="pipelined")
    tasks = 2 * len(plans[0]) * K * L  # every chunk (context too) passes every stage
    for rt in (batched, single):
        assert rt.workers[0].stats.tasks == tasks
    assert single.workers[0].stats.batches == tasks
    assert batched.workers[0].stats.batches < tasks / 2  # several steps/streams per forward
    capped = InProcRuntime(tiny, SAMPLER, layout_single(K, L), batching=True, max_batch=2)
    out = run_plan(capped, plans, mode="pipelined")
    assert capped.workers[0].stats.batches >= tasks / 2
    ref = oracle.sample(
        tiny, SAMPLER, plans[1], mode="pipelined", seed=1, cond=make_cond(tiny.cfg, 101)
    )
    assert max((out[1][c].x - x).abs().max().item() for c, x in ref.items()) <= TOL


def test_bad_activations_are_dropped_and_counted(tiny):
    (t0,) = InProcTransport.group(1)
    placement = Placement.single(K, L)
    w = Worker(tiny, SAMPLER, t0, placement)
    x = torch.zeros(tiny.cfg.video_tokens * tiny.cfg.patch_dim + 16)
    t0.send(0, Activation(9, 0, 0, 0, 0, x, None))  # never opened
    t0.send(0, Activation(0, 0, K + 1, 0, 0, x, None))  # no such step
    assert w.run_once(0.0) == 0
    assert w.stats.drops == {"unknown or closed stream": 2}
    w.open_stream(0, cond=make_cond(tiny.cfg, 1))
    t0.send(0, Activation(0, 0, 5, 0, 0, x, None))
    w.run_once(0.0)
    assert w.stats.drops["stage out of range"] == 1
    # a stream closed with chunks queued: they are dropped and counted, the worker goes on
    t0.send(0, Activation(0, 0, 0, 0, FLAG_CONTEXT, x, None))
    t0.send(0, Activation(0, 1, 0, 0, FLAG_CONTEXT, x, None))
    assert w.run_once(0.0) == 1
    w.close_stream(0)
    w.run_once(0.0)
    assert w.stats.drops["stream closed"] >= 1
    assert not w.has_work()


def test_worker_refuses_a_model_without_its_blocks(tiny):
    from physis_ros.engine.build import build_model

    part = build_model(tiny.cfg, seed=0, block_ids={0})
    (t0,) = InProcTransport.group(1)
    w = Worker(part, SAMPLER, t0, Placement.single(K, L))
    w.open_stream(0)
    with pytest.raises(ValueError, match=r"hosts blocks \[1\] its model lacks"):
        w.run_once(0.0)


def test_close_stream_keeps_other_streams_exact(tiny):
    rt = InProcRuntime(tiny, SAMPLER, layout_groups(K, L, [2, 4]))
    rt.open_stream(0, seed=7, cond=make_cond(tiny.cfg, 70))
    rt.open_stream(1, seed=8, cond=make_cond(tiny.cfg, 71))
    plan = plan_for(tiny, 1)
    for kind, val in plan:
        getattr(rt.controller, f"submit_{kind}")(1, val)
        rt.controller.submit_generate(0)
    rt.controller.pump()
    for w in rt.workers:  # let stream 0 get into the pipeline, then close it
        w.run_once(0.0)
    rt.close_stream(0)
    out = rt.run_inline()
    assert {r.stream_id for r in out} == {1}
    ref = oracle.sample(tiny, SAMPLER, plan, mode="pipelined", seed=8, cond=make_cond(tiny.cfg, 71))
    got = {r.chunk: r.x for r in out}
    assert max((got[c] - x).abs().max().item() for c, x in ref.items()) <= TOL
    assert (
        sum(
            w.stats.drops["stream closed"] + w.stats.drops["unknown or closed stream"]
            for w in rt.workers
        )
        >= 1
    )


def test_block_timing_for_batch_compositions(tiny):
    one = time_block_forward(tiny, [2], repeats=3, warmup=1)
    assert len(one) == 3 and all(t > 0 for t in one)
    assert measure_block_ms(tiny, [0, 1, 2], repeats=3, warmup=1) > 0
    with pytest.raises(ValueError, match="history_chunks"):
        measure_block_ms(tiny, [])


def test_bfloat16_pipeline_runs_and_tracks_its_oracle(tiny):
    """dtype support: h and weights in bf16, x and the Euler update in float32."""
    from physis_ros.engine.build import build_model

    model = build_model(tiny.cfg, seed=0, dtype=torch.bfloat16)
    rt = InProcRuntime(model, SAMPLER, layout_groups(K, L, [2, 4]))
    plan = plan_for(tiny, 0)
    out = run_plan(
        rt, {0: plan}, mode="pipelined", seeds={0: 3}, conds={0: make_cond(model.cfg, 4)}
    )
    ref = oracle.sample(model, SAMPLER, plan, mode="pipelined", seed=3, cond=make_cond(tiny.cfg, 4))
    for c, x in ref.items():
        assert out[0][c].x.dtype == torch.float32
        assert (out[0][c].x - x).abs().max().item() < 0.1  # bf16 round-off, not a bug


def test_close_joins_every_thread_the_runtime_started(tiny):
    """physis-serve's engine shutdown (EngineCore.shutdown -> ThreadExecutor.shutdown): no worker
    loop is left running when the process goes on to exit."""
    layout = layout_even(SAMPLER.steps, tiny.cfg.num_blocks, 2)
    before = set(threading.enumerate())
    with InProcRuntime(tiny, SAMPLER, layout) as rt:
        rt.start_threads()
        started = set(threading.enumerate()) - before
        assert {t.name for t in started} == {"worker-0", "worker-1"}
    assert not any(t.is_alive() for t in started)
    rt.close()  # idempotent


def test_rope_cache_stays_exact_when_it_is_full(tiny):
    """A long stream fills the RoPE cache: when a batch clears it, every chunk of the batch is
    computed again (a chunk cached before the clear was once left out: KeyError after 256
    slots, 51 s into a 5-chunk/s demo)."""
    from physis_ros.engine.forward import rope_freqs
    from physis_ros.engine.stage import StageCaches

    caches = StageCaches(tiny, [1.0, 0.5, 0.0], max_chunks=4)
    caches.rope([0, 1, 2])
    got = caches.rope([2, 3, 4])  # 2 is cached, 3 and 4 overflow the cache
    want = rope_freqs(tiny, torch.tensor([2, 3, 4]))
    torch.testing.assert_close(got, want.to(got.device), rtol=0, atol=0)
