"""Model conventions (upstream Wan2.1 layout), checkpoints, training forward, codecs, sampler."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from engine_helpers import SAMPLER, context_x, plan_for

from physis_ros.engine.build import build_model
from physis_ros.engine.codec import Codec
from physis_ros.engine.config import PRESETS, SamplerConfig, get_preset
from physis_ros.engine.forward import forward_sequence, head_velocity, make_cond, token_positions
from physis_ros.engine.model import to_upstream_state_dict
from physis_ros.engine.oracle import sample_noisy
from physis_ros.engine.sampler import (
    chunk_numel,
    initial_noise,
    latent_to_tokens,
    pack_chunk,
    sigmas,
    tokens_to_latent,
    unpack_chunk,
)

UPSTREAM_KEYS = {
    "patch_embedding.weight",
    "patch_embedding.bias",
    "text_embedding.0.weight",
    "text_embedding.2.weight",
    "time_embedding.0.weight",
    "time_embedding.2.weight",
    "time_projection.1.weight",
    "blocks.0.self_attn.q.weight",
    "blocks.0.self_attn.k.bias",
    "blocks.0.self_attn.o.weight",
    "blocks.0.self_attn.norm_q.weight",
    "blocks.0.self_attn.norm_k.weight",
    "blocks.0.norm3.weight",
    "blocks.0.norm3.bias",
    "blocks.1.cross_attn.v.weight",
    "blocks.1.cross_attn.norm_k.weight",
    "blocks.1.ffn.0.weight",
    "blocks.1.ffn.2.bias",
    "blocks.1.modulation",
    "head.head.weight",
    "head.modulation",
}


def _seq_inputs(model, chunks=3, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(chunks, chunk_numel(model.cfg), generator=gen)
    sig = torch.tensor([0.0, 0.7, 0.3][:chunks])
    return x, sig, make_cond(model.cfg, 5)


def test_x0_head_turns_its_output_into_the_velocity_that_steps_to_it(tiny, tiny_x0):
    """Same weights: the x0 model's v satisfies x - sigma v = the velocity model's raw head
    output on noised chunks (so the last Euler step lands on x0), and stays finite on context."""
    x, sig, cond = _seq_inputs(tiny)
    raw = forward_sequence(tiny, x, sig, cond, window=2)
    v = forward_sequence(tiny_x0, x, sig, cond, window=2)
    assert torch.isfinite(v).all()
    n = chunk_numel(tiny.cfg)
    for c in (1, 2):
        torch.testing.assert_close(x[c, :n] - sig[c] * v[c], raw[c], rtol=1e-5, atol=1e-5)
    assert (v[0] - raw[0]).abs().max() > 1e-3  # not the velocity head by accident


def test_safetensors_round_trip_with_upstream_names(tiny, tmp_path):
    from safetensors.torch import load_file

    path = tmp_path / "tiny.safetensors"
    tiny.save_safetensors(path)
    state = load_file(str(path))
    assert set(state) >= UPSTREAM_KEYS
    cfg = tiny.cfg
    assert tuple(state["patch_embedding.weight"].shape) == (cfg.dim, cfg.in_channels, *cfg.patch)
    assert tuple(state["blocks.0.modulation"].shape) == (1, 6, cfg.dim)
    assert tuple(state["head.modulation"].shape) == (1, 2, cfg.dim)
    other = build_model(cfg, seed=123)
    x, sig, cond = _seq_inputs(tiny)
    with torch.no_grad():
        assert not torch.equal(other.head.head.weight, tiny.head.head.weight)
        other.load_safetensors(path)
        assert torch.equal(
            forward_sequence(other, x, sig, cond, window=2),
            forward_sequence(tiny, x, sig, cond, window=2),
        )
    plan = plan_for(tiny, 0)
    a = sample_noisy(tiny, SAMPLER, plan, seed=1, cond=make_cond(tiny.cfg, 2))
    b = sample_noisy(other, SAMPLER, plan, seed=1, cond=make_cond(tiny.cfg, 2))
    assert all(torch.equal(a[c], b[c]) for c in a)


def test_checkpoint_errors_name_the_problem(tiny, tmp_path):
    from safetensors.torch import save_file

    state = to_upstream_state_dict(tiny)
    del state["blocks.1.ffn.0.weight"]
    save_file(state, str(tmp_path / "missing.safetensors"))
    with pytest.raises(ValueError, match=r"lacks 1 key\(s\) \[blocks\.1\.ffn\.0\.weight\]"):
        build_model(tiny.cfg).load_safetensors(tmp_path / "missing.safetensors")
    state = to_upstream_state_dict(tiny)
    state["head.head.weight"] = torch.zeros(3, 3)
    save_file(state, str(tmp_path / "shape.safetensors"))
    with pytest.raises(ValueError, match=r"head\.head\.weight"):
        build_model(tiny.cfg).load_safetensors(tmp_path / "shape.safetensors")


def test_partial_model_has_the_full_models_blocks(tiny):
    part = build_model(tiny.cfg, seed=0, block_ids={1})
    assert part.block_ids == {1}
    assert isinstance(part.blocks[0], torch.nn.Identity)
    for (ka, va), (kb, vb) in zip(
        part.blocks[1].state_dict().items(), tiny.blocks[1].state_dict().items(), strict=True
    ):
        assert ka == kb and torch.equal(va, vb)
    assert torch.equal(part.head.head.weight, tiny.head.head.weight)


def test_patch_embedding_is_upstreams_conv3d(tiny):
    cfg = tiny.cfg
    latent = torch.randn(cfg.in_channels, cfg.latent_frames, cfg.latent_height, cfg.latent_width)
    w = to_upstream_state_dict(tiny)["patch_embedding.weight"]
    conv = F.conv3d(latent[None], w, tiny.patch_embedding.bias.detach(), stride=cfg.patch)
    ref = conv.flatten(2).transpose(1, 2)[0]  # [Nv, D], tokens in (t, h, w) order
    with torch.no_grad():
        ours = tiny.patch_embedding(latent_to_tokens(cfg, latent))
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)


def test_head_output_follows_upstream_unpatchify(tiny):
    """Upstream lays the head output out (pt, ph, pw, c); our v is (c, pt, ph, pw) per token."""
    cfg = tiny.cfg
    h = torch.randn(1, cfg.tokens_per_chunk, cfg.dim)
    e = torch.randn(1, cfg.dim)
    with torch.no_grad():
        v = head_velocity(tiny, h, e)[0]
        shift, scale = (tiny.head.modulation + e[:, None]).chunk(2, dim=1)
        raw = tiny.head.head(F.layer_norm(h, (cfg.dim,), eps=cfg.eps) * (1 + scale) + shift)
    nv = cfg.video_tokens
    u = raw[0, :nv].view(*cfg.grid, *cfg.patch, cfg.in_channels)
    u = torch.einsum("fhwpqrc->cfphqwr", u).reshape(
        cfg.in_channels, *[g * p for g, p in zip(cfg.grid, cfg.patch, strict=True)]
    )
    latent, _ = unpack_chunk(cfg, v)
    torch.testing.assert_close(latent, u)


def test_rope_positions_are_absolute_and_action_tokens_do_not_collide(tiny):
    cfg = tiny.cfg
    pos = token_positions(cfg, torch.tensor([0, 5]))
    gt = cfg.grid[0]
    video = pos[:, : cfg.video_tokens]
    assert video[1, :, 0].min() == 5 * gt and video[1, :, 0].max() == 5 * gt + gt - 1
    rows = {tuple(r) for r in pos[0].tolist()}
    assert len(rows) == cfg.tokens_per_chunk  # all distinct, action tokens included


def test_forward_sequence_is_differentiable_and_batched(tiny):
    x, sig, cond = _seq_inputs(tiny)
    model = build_model(tiny.cfg, seed=0).train()
    xb = torch.stack([x, x.flip(0)])
    v = forward_sequence(model, xb, torch.stack([sig, sig]), torch.stack([cond, cond]), window=1)
    v.pow(2).mean().backward()
    grads = [p.grad for p in model.blocks[0].parameters()]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
    assert any(g.abs().sum() > 0 for g in grads)
    with torch.no_grad():
        single = forward_sequence(model, x, sig, cond, window=1)
    torch.testing.assert_close(v[0].detach(), single, rtol=1e-5, atol=1e-5)


def test_forward_sequence_is_block_causal(tiny):
    """Changing chunk 2 leaves chunks 0 and 1 unchanged; changing chunk 0 changes chunk 1."""
    x, sig, cond = _seq_inputs(tiny)
    with torch.no_grad():
        v = forward_sequence(tiny, x, sig, cond, window=1)
        x2 = x.clone()
        x2[2] += 1.0
        v2 = forward_sequence(tiny, x2, sig, cond, window=1)
        x0 = x.clone()
        x0[0] += 1.0
        v0 = forward_sequence(tiny, x0, sig, cond, window=1)
    assert torch.equal(v[:2], v2[:2])
    assert (v0[1] - v[1]).abs().max() > 1e-4


def test_presets_keep_real_shapes():
    wan = PRESETS["wan2.1-1.3b"]
    assert (wan.num_blocks, wan.dim, wan.num_heads, wan.ffn_dim) == (30, 1536, 12, 8960)
    assert wan.tokens_per_frame == 1560
    assert 1.2e9 < wan.num_params() < 1.5e9
    assert 13e9 < PRESETS["wan2.1-14b"].num_params() < 15e9
    assert 4.5e9 < PRESETS["wan2.2-ti2v-5b"].num_params() < 5.5e9
    assert 21e9 < PRESETS["dit-22b"].num_params() < 23.5e9
    assert 32e9 < PRESETS["dit-33b"].num_params() < 35e9


def test_bad_configs_raise_value_errors():
    with pytest.raises(ValueError, match="steps"):
        SamplerConfig(steps=0)
    with pytest.raises(ValueError, match="window"):
        SamplerConfig(window=-1)
    with pytest.raises(ValueError, match="unknown model preset 'nope'"):
        get_preset("nope")
    with pytest.raises(ValueError, match="action_mode"):
        get_preset("tiny", action_mode="steer")


def test_sigma_schedule_and_seeded_noise(tiny):
    s = sigmas(SamplerConfig(steps=4, shift=5.0))
    assert s[0] == 1.0 and s[-1] == 0.0 and all(a > b for a, b in itertools.pairwise(s))
    assert s[2] == pytest.approx(5 * 0.5 / (1 + 4 * 0.5))
    a, b = initial_noise(tiny.cfg, 3, 4), initial_noise(tiny.cfg, 3, 4)
    assert torch.equal(a, b) and not torch.equal(a, initial_noise(tiny.cfg, 3, 5))
    assert not torch.equal(a, initial_noise(tiny.cfg, 4, 4))


def test_pack_unpack_round_trip(tiny):
    cfg = tiny.cfg
    x = context_x(tiny, 0)
    latent, act = unpack_chunk(cfg, x)
    assert torch.equal(pack_chunk(cfg, latent, act), x)
    assert torch.equal(tokens_to_latent(cfg, latent_to_tokens(cfg, latent)), latent)
    with pytest.raises(ValueError, match="actions have shape"):
        pack_chunk(cfg, latent, torch.zeros(2, 2))


def test_pixel_codec_is_exact(tiny):
    codec = Codec(tiny.cfg)
    frames = np.random.default_rng(0).integers(0, 256, (2, 16, 16, 3), dtype=np.uint8)
    latent = codec.encode(frames)
    assert tuple(latent.shape) == (12, 2, 8, 8)
    assert latent.min() >= -1 and latent.max() <= 1
    np.testing.assert_array_equal(codec.decode(latent), frames)
    padded = codec.decode(codec.encode(frames[:1]))  # one frame: the newest is repeated
    np.testing.assert_array_equal(padded[1], frames[0])
    with pytest.raises(ValueError, match="frames have shape"):
        codec.encode(np.zeros((2, 8, 8, 3), np.uint8))
    with pytest.raises(ValueError, match="uint8"):
        codec.encode(np.zeros((2, 16, 16, 3), np.float32))


def test_vae_standin_has_wan_shapes():
    cfg = get_preset("wan2.1-1.3b")
    codec = Codec(cfg)
    frames = np.zeros((cfg.frames_per_chunk, 480, 832, 3), np.uint8)
    latent = codec.encode(frames)
    assert tuple(latent.shape) == (16, 3, 60, 104)
    assert codec.decode(latent).shape == frames.shape
