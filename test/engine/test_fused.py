"""The fused block path (engine/fused.py) equals the eager one: block by block, through the
engine against the oracle, after strict checkpoint loading, and (where triton is installed)
with the Triton kernels run by the interpreter on the CPU."""

from __future__ import annotations

import copy
import dataclasses
import os
import subprocess
import sys

import pytest
import torch
from engine_helpers import SAMPLER, TOL, run_and_compare

from physis_ros.engine import fused
from physis_ros.engine.build import build_model
from physis_ros.engine.checkpoints import resolve_model, summary
from physis_ros.engine.config import get_preset
from physis_ros.engine.forward import cross_kv, embed_cond
from physis_ros.engine.kvring import KVRing, StageTask
from physis_ros.engine.model import load_upstream_state_dict, to_upstream_state_dict
from physis_ros.engine.placement import layout_groups, layout_single
from physis_ros.engine.sampler import chunk_numel
from physis_ros.engine.stage import StageCaches, run_block

K = SAMPLER.steps
BLOCK_TOL = 2e-6
"""Relative (to the largest |h|) difference of one block, float32."""


def _fused_copy(model, kernels: str = "torch"):
    twin = copy.deepcopy(model)
    fused.set_block_impl(twin, "fused", kernels=kernels)
    return twin


def _tasks(model, block: int, histories: list[int], streams: list[int], *, horizon: int, seed: int):
    """Tasks of slot ``histories[i] + 3 i`` with random rings of W + ``horizon`` entries, the
    cross-attention K/V of stream ``streams[i]`` (the same tensors for one stream, as the
    worker has); task 1 is an observed chunk (noise level 0)."""
    cfg = model.cfg
    gen = torch.Generator().manual_seed(seed)
    cross = {}
    for s in sorted(set(streams)):
        ctx = embed_cond(model, torch.randn(3, cfg.text_dim, generator=gen))
        cross[s] = cross_kv(model, block, ctx)
    tasks = []
    for i, (hist, s) in enumerate(zip(histories, streams, strict=True)):
        ring = KVRing(SAMPLER.window, cfg.num_heads, cfg.tokens_per_chunk, cfg.head_dim, "cpu",
                      model.dtype, horizon)  # fmt: skip
        ring.k.normal_(generator=gen)
        ring.v.normal_(generator=gen)
        tasks.append(
            StageTask(
                chunk=hist + 3 * i,
                step=i % K,
                sigma=0.0 if i == 1 else 1.0 - (i % K) / K,
                x=torch.randn(chunk_numel(cfg), generator=gen),
                h=torch.randn(cfg.tokens_per_chunk, cfg.dim, generator=gen).to(model.dtype),
                ring=ring,
                observed=i == 1,
                cross_k=cross[s][0],
                cross_v=cross[s][1],
            )
        )
    return tasks


def _twin_tasks(tasks):
    """The same tasks with their own copies of the rings."""
    out = []
    for t in tasks:
        ring = copy.copy(t.ring)
        ring.k, ring.v = t.ring.k.clone(), t.ring.v.clone()
        ring.slot, ring.observed = list(t.ring.slot), list(t.ring.observed)
        out.append(dataclasses.replace(t, ring=ring))
    return out


def _compare_blocks(eager, fast, compositions, seed=0) -> float:
    """Largest relative difference of h (and v at the last block) and of the rings."""
    worst = 0.0
    for block in sorted(eager.block_ids):
        for j, (histories, streams, horizon) in enumerate(compositions):
            tasks = _tasks(eager, block, histories, streams, horizon=horizon, seed=seed + j)
            twins = _twin_tasks(tasks)
            h_ref, v_ref = run_block(eager, block, tasks, StageCaches(eager, [1.0, 0.5, 0.0]))
            h, v = run_block(fast, block, twins, StageCaches(fast, [1.0, 0.5, 0.0]))
            scale = h_ref.abs().max().item()
            worst = max(worst, (h - h_ref).abs().max().item() / scale)
            if v_ref is not None:
                worst = max(worst, (v - v_ref).abs().max().item() / v_ref.abs().max().item())
            for a, b in zip(tasks, twins, strict=True):
                assert (a.ring.slot, a.ring.observed) == (b.ring.slot, b.ring.observed)
                worst = max(worst, (a.ring.k - b.ring.k).abs().max().item() / scale)
                worst = max(worst, (a.ring.v - b.ring.v).abs().max().item() / scale)
    return worst


COMPOSITIONS = [  # (slots before each task's, its stream, horizon: ring of W + horizon entries)
    ([2], [0], 1),  # one task, the window is the whole ring
    ([0], [0], 1),  # first chunk: it attends to itself only
    ([2, 1, 0], [0, 0, 0], 1),  # one stream: cross-attention over all rows at once
    ([2, 2, 5], [0, 1, 0], 3),  # two streams: cross-attention per task; a window that wraps
]
FULL_RINGS = [  # every ring full (horizon 1, slot >= W): the CUDA-graph path's steady state
    ([2], [0], 1),
    ([4, 2, 3], [0, 0, 0], 1),  # wrapped rings, one stream; task 1 observed
    ([2, 5, 7], [0, 1, 0], 1),  # two streams: cross-attention per task
]


@pytest.mark.parametrize("variant", ["tiny", "video", "no-qk-norm"])
def test_fused_block_equals_eager(variant):
    overrides = {
        "tiny": {},
        "video": {"action_mode": "none"},
        "no-qk-norm": {"qk_norm": False, "cross_attn_norm": False, "prediction": "x0"},
    }[variant]
    eager = build_model(get_preset("tiny", **overrides), seed=3, block_impl="eager")
    fast = _fused_copy(eager)
    assert fused.block_impl(fast) == "fused" and fused.block_impl(eager) == "eager"
    assert _compare_blocks(eager, fast, COMPOSITIONS) <= BLOCK_TOL


def test_fused_engine_equals_oracle(tiny):
    fast = _fused_copy(tiny)
    for mode, layout, streams in (
        ("pipelined", layout_groups(K, 2, [1, 3, 2]), 3),
        ("sequential-clean", layout_single(K, 2), 2),
    ):
        diff = run_and_compare(fast, layout, mode=mode, batching=True, streams=streams)
        assert diff <= TOL, (mode, diff)


def test_fused_qkv_is_one_buffer_and_strict_loading_fills_it(tiny, tmp_path):
    """The model's q/k/v parameters are views of the fused [3D, D] weight: an upstream-named
    checkpoint loads strictly into it, and the fused path computes with the loaded values."""
    path = tmp_path / "w.safetensors"
    tiny.save_safetensors(path)
    fast = build_model(tiny.cfg, seed=11, block_impl="fused")  # other weights until loaded
    w = fast.fused_blocks.weights(1)
    sa = fast.blocks[1].self_attn
    d = tiny.cfg.dim
    assert sa.q.weight.data_ptr() == w.qkv_w.data_ptr()
    assert sa.k.weight.data_ptr() == w.qkv_w[d:].data_ptr()
    assert sa.v.bias.data_ptr() == w.qkv_b[2 * d :].data_ptr()
    assert sorted(fast.state_dict()) == sorted(tiny.state_dict())  # no new keys
    fast.load_safetensors(path)  # strict
    assert fast.fused_blocks.weights(1) is w  # loaded in place: nothing re-fused
    assert torch.equal(w.qkv_w[:d], tiny.blocks[1].self_attn.q.weight)
    assert torch.equal(w.qk_norm[d:], tiny.blocks[1].self_attn.norm_k.weight)
    assert _compare_blocks(tiny, fast, COMPOSITIONS[:1]) <= BLOCK_TOL
    with pytest.raises(ValueError, match=r"unexpected .*self_attn\.qkv\.weight"):
        bad = to_upstream_state_dict(tiny)
        bad["blocks.0.self_attn.qkv.weight"] = w.qkv_w
        load_upstream_state_dict(fast, bad)


def test_replaced_or_moved_blocks_are_fused_again(tiny):
    fast = _fused_copy(tiny)
    fresh = build_model(tiny.cfg, seed=0, block_ids={1}, block_impl="eager")
    fast.blocks[1] = fresh.blocks[1]  # what a rank does when it loads more blocks
    fast.to(torch.float64).to(torch.float32)  # every parameter re-allocated
    assert _compare_blocks(tiny, fast, COMPOSITIONS[2:3]) <= BLOCK_TOL
    assert fast.fused_blocks.weights(1).module is fresh.blocks[1]


def test_block_impl_from_environment_and_bad_names(monkeypatch):
    cfg = get_preset("tiny")
    monkeypatch.setenv(fused.BLOCK_IMPL_ENV, "fused")
    assert fused.block_impl(build_model(cfg)) == "fused"
    assert fused.block_impl(build_model(cfg, block_impl="eager")) == "eager"
    monkeypatch.setenv(fused.BLOCK_IMPL_ENV, "fast")
    with pytest.raises(ValueError, match="PHYSIS_BLOCK_IMPL"):
        build_model(cfg)
    monkeypatch.delenv(fused.BLOCK_IMPL_ENV)
    with pytest.raises(ValueError, match="not one of"):
        fused.set_block_impl(build_model(cfg), "compiled")


def test_block_impl_follows_the_device(monkeypatch):
    """Fused on CUDA, eager on any other device, unless a caller or ``PHYSIS_BLOCK_IMPL``
    names one; the engine's start-up summary says which runs and why."""
    assert fused.choose_block_impl("cuda", env="") == ("fused", "cuda")
    assert fused.choose_block_impl("cpu", env="") == ("eager", "cpu")
    assert fused.choose_block_impl("mps", env="") == ("eager", "mps")
    assert fused.choose_block_impl("cpu", env="graph") == ("graph", fused.BLOCK_IMPL_ENV)
    assert fused.choose_block_impl("cuda", "eager", env="graph") == ("eager", fused.REQUESTED)
    with pytest.raises(ValueError, match="not one of"):
        fused.choose_block_impl("cuda", "compiled")
    monkeypatch.delenv(fused.BLOCK_IMPL_ENV, raising=False)
    assert fused.default_block_impl("cuda") == "fused"
    assert fused.default_block_impl() == "eager"
    rule = "fused implementation on cuda, eager on cpu (the device's default)"
    assert fused.describe_block_impl() == rule
    resolved = resolve_model("tiny")
    model = build_model(resolved.cfg)
    assert fused.describe_block_impl(model) == "eager implementation (cpu)"
    text = summary(resolved, SAMPLER, torch.float32, model=model)
    assert "blocks   eager implementation (cpu)" in text.splitlines()
    assert f"blocks   {rule}" in summary(resolved, SAMPLER, torch.float32).splitlines()
    monkeypatch.setenv(fused.BLOCK_IMPL_ENV, "fused")
    assert fused.describe_block_impl() == "fused implementation (PHYSIS_BLOCK_IMPL)"
    assert fused.describe_block_impl(build_model(resolved.cfg)) == (
        "fused implementation (PHYSIS_BLOCK_IMPL)"
    )
    assert fused.describe_block_impl(build_model(resolved.cfg, block_impl="graph")) == (
        "graph implementation (asked for)"
    )


TRITON_CHECK = """
import copy, sys
import torch
sys.path.insert(0, "test/engine")
import test_fused as T
from physis_ros.engine import fused
from physis_ros.engine.config import get_preset
from physis_ros.engine.build import build_model
torch.set_num_threads(1)
worst = 0.0
for over in ({}, {"action_mode": "none", "qk_norm": False, "cross_attn_norm": False}):
    eager = build_model(get_preset("tiny", **over), seed=5, block_impl="eager")
    worst = max(worst, T._compare_blocks(eager, T._fused_copy(eager, "triton"), T.COMPOSITIONS))
    graph = copy.deepcopy(eager)
    fused.set_block_impl(graph, "graph", kernels="triton")  # K/V written at device-side slots
    worst = max(worst, T._compare_blocks(eager, graph, T.FULL_RINGS))
print(worst)
assert worst <= T.BLOCK_TOL, worst
"""


@pytest.mark.slow
@pytest.mark.skipif(not fused.triton_available(), reason="triton is not installed")
def test_triton_kernels_equal_eager_in_the_interpreter():
    """The hand-written kernels, run by Triton's interpreter on CPU tensors (float32); also
    with the ring slot read on the device (the graph path's static forward)."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    res = subprocess.run(
        [sys.executable, "-c", TRITON_CHECK],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert res.returncode == 0, res.stdout + res.stderr
