"""The CUDA-graph path (engine/block_graphs.py, block impl ``graph``) on the CPU: its static
forward (device-side ring slots, whole-ring attention, static buffers) equals the eager block;
through the engine it matches the oracle, also when every steady-state composition is
"captured" by a stand-in graph that replays the captured closure (so nothing of the chunk may
be baked into it); a capture that fails leaves the composition eager."""

from __future__ import annotations

import copy

import pytest
import torch
from engine_helpers import SAMPLER, TOL, run_and_compare
from test_fused import BLOCK_TOL, COMPOSITIONS, FULL_RINGS, _compare_blocks, _tasks

from physis_ros.engine import fused
from physis_ros.engine.block_graphs import BlockGraphs
from physis_ros.engine.build import build_model
from physis_ros.engine.config import get_preset
from physis_ros.engine.placement import layout_groups, layout_single
from physis_ros.engine.stage import StageCaches, run_block

K = SAMPLER.steps


def _graph_copy(model, kernels: str = "torch"):
    twin = copy.deepcopy(model)
    fused.set_block_impl(twin, "graph", kernels=kernels)
    return twin


class StandInGraph:
    """What a CUDA graph does with the captured closure: replays exactly it, later."""

    def __init__(self, fn) -> None:
        self.fn = fn

    def replay(self) -> None:
        self.fn()


def _stand_in_capture(self, static, key):
    self.stats.captured += 1
    return StandInGraph(static)


@pytest.mark.parametrize("variant", ["tiny", "no-qk-norm"])
def test_static_forward_equals_eager(variant):
    overrides = {"no-qk-norm": {"qk_norm": False, "cross_attn_norm": False}}.get(variant, {})
    eager = build_model(get_preset("tiny", **overrides), seed=4, block_impl="eager")
    fast = _graph_copy(eager)
    assert fused.block_impl(fast) == "graph"
    assert _compare_blocks(eager, fast, FULL_RINGS + COMPOSITIONS) <= BLOCK_TOL
    stats = fast.fused_blocks.graphs.stats
    assert stats.eager > 0 and stats.warmup > 0  # full rings: static path; others: fused
    assert stats.captured == stats.replays == 0  # nothing is captured on a CPU


def test_graph_engine_equals_oracle(tiny):
    fast = _graph_copy(tiny)
    for mode, layout, streams in (
        ("pipelined", layout_groups(K, 2, [1, 3, 2]), 3),
        ("sequential-clean", layout_single(K, 2), 2),
    ):
        diff = run_and_compare(fast, layout, mode=mode, batching=True, streams=streams)
        assert diff <= TOL, (mode, diff)
    assert fast.fused_blocks.graphs.stats.eager > 0


def test_replayed_closures_match_the_oracle(tiny, monkeypatch):
    """Every steady-state composition seen twice is 'captured' and from then on only its
    captured closure runs, with later chunks' inputs in the static buffers: a chunk-dependent
    value baked into it (a slot, a RoPE table, a tensor of that chunk) would show here."""
    monkeypatch.setattr(BlockGraphs, "_capture", _stand_in_capture)
    fast = _graph_copy(tiny)
    graphs = fast.fused_blocks.graphs
    graphs.capture = True
    for mode, layout, streams in (
        ("pipelined", layout_groups(K, 2, [1, 3, 2]), 3),
        ("pipelined", layout_single(K, 2), 1),
        ("sequential-clean", layout_single(K, 2), 2),
    ):
        diff = run_and_compare(fast, layout, mode=mode, batching=True, streams=streams)
        assert diff <= TOL, (mode, diff)
    assert graphs.stats.captured > 0 and graphs.stats.replays > graphs.stats.captured


def test_a_failed_capture_leaves_the_composition_eager(tiny):
    """On the CPU a real capture fails (no CUDA): counted once per composition, never
    retried, and the results stay those of the fused forward."""
    fast = _graph_copy(tiny)
    graphs = fast.fused_blocks.graphs
    graphs.capture = True
    block = 1
    tasks = _tasks(fast, block, [2], [0], horizon=1, seed=3)
    caches = StageCaches(fast, [1.0, 0.5, 0.0])
    ref_model = copy.deepcopy(tiny)
    fused.set_block_impl(ref_model, "fused", kernels="torch")
    ref_tasks = _tasks(ref_model, block, [2], [0], horizon=1, seed=3)
    ref_caches = StageCaches(ref_model, [1.0, 0.5, 0.0])
    for _ in range(4):  # the same rings: one composition
        h, _ = run_block(fast, block, tasks, caches)
        h_ref, _ = run_block(ref_model, block, ref_tasks, ref_caches)
        assert torch.allclose(h, h_ref, rtol=0, atol=1e-6)
        for t in tasks:
            t.h = h[0]
        for t in ref_tasks:
            t.h = h_ref[0]
    assert graphs.stats.capture_failed == 1 and graphs.stats.replays == 0
    assert graphs.stats.eager == 4 and graphs.stats.failures
    assert torch.equal(tasks[0].ring.k, ref_tasks[0].ring.k)
    assert tasks[0].ring.slot == ref_tasks[0].ring.slot and 2 in tasks[0].ring.slot


def test_a_key_whose_tensors_are_gone_is_dropped(tiny):
    """Compositions are keyed by their tensors' addresses, held weakly: once a stream's rings
    are freed its entry goes (a new ring at the same address is a new composition)."""
    fast = _graph_copy(tiny)
    graphs = fast.fused_blocks.graphs
    caches = StageCaches(fast, [1.0, 0.5, 0.0])
    tasks = _tasks(fast, 1, [2], [0], horizon=1, seed=5)
    for _ in range(3):
        run_block(fast, 1, tasks, caches)
    (entry,) = graphs._entries.values()
    assert entry.seen == 3 and entry.alive()
    del tasks
    assert not entry.alive()
    tasks = _tasks(fast, 1, [2], [0], horizon=1, seed=6)
    run_block(fast, 1, tasks, caches)
    (fresh,) = graphs._entries.values()
    assert fresh is not entry and fresh.seen == 1
