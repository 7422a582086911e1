"""anchor_residual: a generated chunk's x0 estimate is the newest observed latent frame (its
anchor, carried in the chunk as conditioning) plus the head's change. Every executor equals
the oracle with the anchor taken where the controller takes it (the newest observation queued
when the chunk is), and a head that predicts no change reproduces the anchor exactly."""

from __future__ import annotations

import copy

import torch
from engine_helpers import SAMPLER, TOL
from live_helpers import rollout_plan, run_live_inline, run_live_threads, worst_rollout_error

from physis_ros.engine import oracle
from physis_ros.engine.forward import head_velocity, make_cond
from physis_ros.engine.placement import layout_groups, layout_single
from physis_ros.engine.sampler import (
    anchor_tokens,
    chunk_layout,
    initial_noise,
    latent_to_tokens,
    pack_chunk,
    tokens_to_latent,
)
from physis_ros.engine.threads import InProcRuntime

K, L = SAMPLER.steps, 2
HORIZON = 3


def plan(model, stream: int) -> list:
    return rollout_plan(model, stream, horizon=HORIZON, with_actions=True)


def reference(model, p) -> dict:
    """(slot, anchor) -> x of every generated version of stream 0's plan ``p``, the oracle's."""
    return oracle.sample_noisy(
        model, SAMPLER, p, seed=7, cond=make_cond(model.cfg, 70), by_anchor=True
    )


def test_the_anchor_is_the_newest_frame_repeated(tiny_anchor):
    cfg = tiny_anchor.cfg
    latent = torch.randn(cfg.in_channels, cfg.latent_frames, cfg.latent_height, cfg.latent_width)
    x = pack_chunk(cfg, latent, torch.zeros(cfg.action_horizon, cfg.action_dim))
    lay = chunk_layout(cfg)
    assert torch.equal(x[lay.anchor], torch.zeros(lay.anchor.stop - lay.anchor.start))
    anchor = anchor_tokens(cfg, x)
    got = tokens_to_latent(cfg, anchor.reshape(cfg.video_tokens, cfg.patch_dim))
    assert torch.equal(got, latent[:, -1:].expand_as(latent))
    noise = initial_noise(cfg, 5, 3, None, x)
    assert torch.equal(noise[lay.anchor], anchor)
    assert torch.equal(noise[: lay.anchor.start], initial_noise(cfg, 5, 3)[: lay.anchor.start])
    assert not initial_noise(cfg, 5, 3)[lay.anchor].any()  # no observation yet: zeros


def test_the_anchor_moves_the_output(tiny_anchor):
    """The check below can fail: the anchor changes every generated chunk."""
    p = plan(tiny_anchor, 0)
    shifted = [(i[0], i[1], i[2] + 0.5) if i[0] == "observe" else i for i in p]
    a, b = reference(tiny_anchor, p), reference(tiny_anchor, shifted)
    assert all((a[key] - b[key]).abs().max() > 1e-2 for key in a)


def test_inline_executors_equal_the_oracle(tiny_anchor):
    for layout in (layout_single(K, L), layout_groups(K, L, [1, 3, 2])):
        rt = InProcRuntime(tiny_anchor, SAMPLER, layout, batching=True)
        plans = {s: plan(tiny_anchor, s) for s in range(2)}
        out, feed = run_live_inline(
            rt, plans, mode="pipelined", horizon=HORIZON, seed=len(layout), by_anchor=True
        )
        assert feed.mid_flight > 5
        assert worst_rollout_error(tiny_anchor, plans, out) <= TOL


def test_threaded_workers_equal_the_oracle(tiny_anchor):
    rt = InProcRuntime(tiny_anchor, SAMPLER, layout_groups(K, L, [2, 2, 2]), batching=True)
    plans = {s: plan(tiny_anchor, s) for s in range(2)}
    out, feed = run_live_threads(
        rt, plans, mode="pipelined", horizon=HORIZON, seed=3, by_anchor=True
    )
    assert feed.mid_flight > 5
    assert worst_rollout_error(tiny_anchor, plans, out) <= TOL


def test_a_head_that_predicts_no_change_copies_the_last_frame(tiny_anchor):
    """Head zeroed (where a fine-tune from a plain x0 head starts): every generated chunk is
    its anchor observation's newest frame, exactly, at every horizon."""
    model = copy.deepcopy(tiny_anchor)
    with torch.no_grad():
        model.head.head.weight.zero_()
        model.head.head.bias.zero_()
    p = plan(model, 0)
    observed = {s: x for kind, s, x in p if kind == "observe"}
    ref = reference(model, p)
    cfg = model.cfg
    nvp = cfg.video_tokens * cfg.patch_dim
    for (slot, anchor), x in ref.items():
        assert 1 <= slot - anchor <= HORIZON
        newest = tokens_to_latent(cfg, observed[anchor][:nvp].reshape(cfg.video_tokens, -1))
        copy_last = latent_to_tokens(cfg, newest[:, -1:].expand_as(newest)).reshape(-1)
        assert (x[:nvp] - copy_last).abs().max().item() <= TOL
    # and the head's velocity carries no update for the anchor values (conditioning)
    h = torch.randn(1, cfg.tokens_per_chunk, cfg.dim)
    e = torch.randn(1, cfg.dim)
    x = initial_noise(cfg, 1, 1, None, observed[0])[None]
    v = head_velocity(model, h, e, x, torch.tensor([0.5]))
    assert not v[0, chunk_layout(cfg).anchor].any()
