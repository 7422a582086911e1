"""The model's forward as pure functions of a ``WanDiT`` and its inputs: time and token
embedding, RoPE, one block, the head, the conditioning tokens, and ``forward_sequence`` (the
differentiable full-sequence block-causal forward used by the oracle and for training).

How stages, KV rings and batching use these functions lives in ``stage.py``; the fused
arrangement of one block in ``fused.py``; the packed chunk layout in ``sampler.py``.

Shapes: B batch (tasks or sequences), S segments per row (chunks), n tokens per chunk,
D dim, H heads, d head dim, Lt conditioning tokens, P = C*pt*ph*pw values per video token.
A chunk's state ``x`` is flat: video tokens [Nv, P] (feature order (c, pt, ph, pw), the
Conv3d weight flattening) ++ action values [H_a, A] ++ state values [F, S] ++ action-row
flags [H_a] ++ anchor tokens [Nv, P] (the last three only where the config has them;
``sampler.pack_chunk``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from physis_ros.engine.config import ModelConfig
from physis_ros.engine.model import WanDiT
from physis_ros.engine.sampler import chunk_layout, chunk_numel

TIME_SCALE = 1000.0
"""Wan2.1 is fed t = 1000 * sigma."""
X0_MIN_SIGMA = 1e-3
"""x0-predicting heads divide by sigma; context chunks (sigma 0) get this instead."""


# ---- embedding, head ------------------------------------------------------------------------
def sinusoidal(freq_dim: int, t: torch.Tensor) -> torch.Tensor:
    """[...] timesteps -> [..., freq_dim] (cos ++ sin), computed in float64 as upstream."""
    half = freq_dim // 2
    pos = t.to(torch.float64)
    freqs = torch.pow(10000.0, -torch.arange(half, dtype=torch.float64, device=t.device) / half)
    arg = pos.unsqueeze(-1) * freqs
    return torch.cat([torch.cos(arg), torch.sin(arg)], dim=-1)


def time_embed(
    model: WanDiT, sigma: torch.Tensor, x: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """sigma [...] (and x [..., X] for action conditioning) -> e [..., D], e0 [..., 6, D]."""
    cfg = model.cfg
    dt = model.dtype
    e = model.time_embedding(sinusoidal(cfg.freq_dim, sigma * TIME_SCALE).to(dt))
    if cfg.action_mode == "condition":
        assert x is not None
        e = e + model.action_cond(x[..., chunk_layout(cfg).actions].to(dt))
    e0 = model.time_projection(e).unflatten(-1, (6, cfg.dim))
    return e, e0


def embed_tokens(model: WanDiT, x: torch.Tensor) -> torch.Tensor:
    """x [..., X] -> h [..., n, D] (video tokens, then action tokens, then state tokens in
    predict mode)."""
    cfg = model.cfg
    nv, p = cfg.video_tokens, cfg.patch_dim
    x = x.to(model.dtype)
    h = model.patch_embedding(x[..., : nv * p].unflatten(-1, (nv, p)))
    if cfg.action_mode == "predict":
        lay = chunk_layout(cfg)
        act = x[..., lay.actions].unflatten(-1, (cfg.action_horizon, cfg.action_dim))
        tokens = [h, model.action_embedding(act)]
        if cfg.committed_actions:
            tokens[1] = tokens[1] + model.action_known(x[..., lay.known, None])
        if cfg.state_dim:
            state = x[..., lay.state].unflatten(-1, (cfg.state_tokens, cfg.state_dim))
            tokens.append(model.state_embedding(state))
        h = torch.cat(tokens, dim=-2)
    return h


def head_velocity(
    model: WanDiT,
    h: torch.Tensor,
    e: torch.Tensor,
    x: torch.Tensor | None = None,
    sigma: torch.Tensor | None = None,
) -> torch.Tensor:
    """h [..., n, D], e [..., D] -> v [..., X] float32 (zero on conditioning action values).
    An x0-predicting head also needs the chunk states x [..., X] and their noise levels
    sigma [...]."""
    cfg = model.cfg
    nv = cfg.video_tokens
    shift, scale = (model.head.modulation + e.unsqueeze(-2)).unsqueeze(-2).unbind(-3)
    y = F.layer_norm(h, (cfg.dim,), eps=cfg.eps) * (1 + scale) + shift
    out = model.head.head(y[..., :nv, :])[..., model.head_perm].flatten(-2).float()
    if cfg.action_mode == "predict":
        na = cfg.action_tokens
        parts = [out, model.action_head(y[..., nv : nv + na, :]).flatten(-2).float()]
        if cfg.state_dim:
            parts.append(model.state_head(y[..., nv + na :, :]).flatten(-2).float())
        out = torch.cat(parts, dim=-1)
    if cfg.anchor_residual:  # the head predicts the change from the anchor
        assert x is not None, "an anchor-residual head needs the chunk states"
        nvp = nv * cfg.patch_dim
        anchor = x[..., chunk_layout(cfg).anchor].float().unflatten(-1, (nv, cfg.patch_dim))
        video = (anchor * model.head.anchor_gate.float()).flatten(-2) + out[..., :nvp]
        out = torch.cat([video, out[..., nvp:]], -1)
    if cfg.prediction == "x0":
        assert x is not None and sigma is not None, "an x0 head needs the states and sigmas"
        # v = (x - x0) / sigma; context chunks (sigma 0) are never stepped: their v only has
        # to stay finite (the training loss masks it)
        s = sigma.float().clamp_min(X0_MIN_SIGMA)[..., None]
        out = (x[..., : out.shape[-1]].float() - out) / s
    if cfg.committed_actions:
        # known rows are conditioning: never updated (v = 0), and so are the flags
        assert x is not None, "a model with committed actions needs the chunk states"
        lay = chunk_layout(cfg)
        free = 1.0 - x[..., lay.known].float()  # [..., H]
        act = out[..., lay.actions].unflatten(-1, (cfg.action_horizon, cfg.action_dim))
        out = torch.cat(
            [
                out[..., : lay.actions.start],
                (act * free[..., None]).flatten(-2),
                out[..., lay.actions.stop :],
                out.new_zeros(*out.shape[:-1], cfg.action_horizon),
            ],
            dim=-1,
        )
    if cfg.action_mode == "condition":
        out = torch.cat(
            [out, out.new_zeros(*out.shape[:-1], cfg.action_horizon * cfg.action_dim)], -1
        )
    if cfg.anchor_residual:  # the anchor is conditioning: never updated
        out = torch.cat([out, out.new_zeros(*out.shape[:-1], nv * cfg.patch_dim)], -1)
    return out


# ---- RoPE, cross-attention K/V, one block ---------------------------------------------------
def token_positions(cfg: ModelConfig, chunk: torch.Tensor) -> torch.Tensor:
    """chunk [...] int -> [..., n, 3] float64 (t, h, w) RoPE positions of a chunk's tokens.

    Video token (t, i, j): t = chunk * T_grid + t (absolute frame index in the stream).
    Action token j: (chunk's first frame, grid_h, j), which no video token has.
    State token f (camera frame f of the chunk): (its latent frame, grid_h + 1, 0).
    """
    gt, gh, gw = cfg.grid
    tt, hh, ww = torch.meshgrid(torch.arange(gt), torch.arange(gh), torch.arange(gw), indexing="ij")
    base = torch.stack([tt, hh, ww], -1).reshape(-1, 3).to(torch.float64)
    if cfg.action_tokens:
        j = torch.arange(cfg.action_tokens, dtype=torch.float64)
        act = torch.stack([torch.zeros_like(j), torch.full_like(j, gh), j], -1)
        base = torch.cat([base, act])
    if cfg.state_tokens:
        f = torch.arange(cfg.state_tokens, dtype=torch.float64)
        t = torch.div(f * gt, cfg.state_tokens, rounding_mode="floor")
        base = torch.cat([base, torch.stack([t, torch.full_like(f, gh + 1), 0 * f], -1)])
    base = base.to(chunk.device)
    off = torch.zeros(*chunk.shape, 1, 3, dtype=torch.float64, device=chunk.device)
    off[..., 0, 0] = chunk.to(torch.float64) * gt
    return base + off


def rope_freqs(model: WanDiT, chunk: torch.Tensor) -> torch.Tensor:
    """chunk [...] -> rotations [..., n, d/2] complex64 (angles computed in float64)."""
    cfg = model.cfg
    pos = token_positions(cfg, chunk)
    part = cfg.head_dim // 6
    half_t = (cfg.head_dim - 4 * part) // 2
    sel = torch.cat(
        [
            torch.zeros(half_t, dtype=torch.long),
            torch.ones(part, dtype=torch.long),
            torch.full((part,), 2, dtype=torch.long),
        ]
    ).to(pos.device)
    ang = pos[..., sel] * model.rope_inv_freq(pos.device)
    return torch.polar(torch.ones_like(ang), ang).to(torch.complex64)


def apply_rope(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """x [..., n, H, d] rotated in adjacent pairs as upstream (view_as_complex, in float32);
    freqs [..., n, d/2] complex64. One complex multiply: no strided halves, no stack."""
    xc = torch.view_as_complex(x.float().unflatten(-1, (-1, 2)))
    return torch.view_as_real(xc * freqs.unsqueeze(-2)).flatten(-2).to(x.dtype)


def cross_kv(model: WanDiT, block: int, context: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """context [..., Lt, D] (embedded conditioning) -> k, v [..., H, Lt, d] for ``block``."""
    cfg = model.cfg
    ca = model.blocks[block].cross_attn
    k = ca.norm_k(ca.k(context)).unflatten(-1, (cfg.num_heads, cfg.head_dim)).transpose(-2, -3)
    v = ca.v(context).unflatten(-1, (cfg.num_heads, cfg.head_dim)).transpose(-2, -3)
    return k, v


AttendFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def block_forward(  # noqa: PLR0917 - the hot path takes its tensors positionally
    model: WanDiT,
    block: int,
    h: torch.Tensor,
    e0: torch.Tensor,
    rope: torch.Tensor,
    ck: torch.Tensor,
    cv: torch.Tensor,
    attend: AttendFn,
) -> torch.Tensor:
    """One Wan block. h [B, S, n, D]; e0 [B, S, 6, D]; rope [B, S, n, d/2] complex;
    ck/cv [B, H, Lt, d]; attend(q, k, v) with [B, S, n, H, d] (k rotated) -> [B, S, n, H, d].
    Weight GEMMs run on all B*S*n tokens at once; only ``attend`` sees task boundaries."""
    cfg = model.cfg
    blk = model.blocks[block]
    b, s, n, d = h.shape
    nh, hd = cfg.num_heads, cfg.head_dim
    mod = (blk.modulation + e0).unsqueeze(-2)  # [B, S, 6, 1, D]
    shift1, scale1, gate1, shift2, scale2, gate2 = mod.unbind(2)  # each [B, S, 1, D]
    sa = blk.self_attn
    y = F.layer_norm(h, (d,), eps=cfg.eps) * (1 + scale1) + shift1
    q = apply_rope(sa.norm_q(sa.q(y)).unflatten(-1, (nh, hd)), rope)
    k = apply_rope(sa.norm_k(sa.k(y)).unflatten(-1, (nh, hd)), rope)
    v = sa.v(y).unflatten(-1, (nh, hd))
    o = attend(q, k, v)  # [B, S, n, H, d]
    h = h + sa.o(o.flatten(-2)) * gate1
    ca = blk.cross_attn
    q = ca.norm_q(ca.q(blk.norm3(h))).reshape(b, s * n, nh, hd).transpose(1, 2)
    o = F.scaled_dot_product_attention(q, ck, cv)  # [B, H, S*n, d]
    h = h + ca.o(o.transpose(1, 2).reshape(b, s, n, d))
    y = F.layer_norm(h, (d,), eps=cfg.eps) * (1 + scale2) + shift2
    return h + blk.ffn(y) * gate2


# ---- conditioning tokens and the full-sequence forward -----------------------------------------
def make_cond(cfg: ModelConfig, cond_seed: int) -> torch.Tensor:
    """[Lt, text_dim] float32 CPU stand-in for a prompt's text-encoder output, seeded."""
    gen = torch.Generator().manual_seed(cond_seed % (2**63))
    return torch.randn(cfg.text_len, cfg.text_dim, generator=gen)


def pad_text(cfg: ModelConfig, cond: torch.Tensor) -> torch.Tensor:
    """[..., n, text_dim] with n <= text_len -> [..., text_len, text_dim], zero-padded at the end.

    Upstream pads every prompt's encoder output (its real tokens only) with zeros to text_len
    and attends to all text_len tokens (no mask): the padding embeds to the text projection's
    bias, so an unpadded context gives a different (wrong) cross-attention."""
    if cond.dim() < 2 or cond.shape[-1] != cfg.text_dim:
        raise ValueError(
            f"conditioning has shape {tuple(cond.shape)}, model {cfg.name} needs "
            f"[n <= {cfg.text_len}, {cfg.text_dim}]"
        )
    n = cond.shape[-2]
    if n > cfg.text_len:
        raise ValueError(f"conditioning has {n} tokens, model {cfg.name} takes {cfg.text_len}")
    if n == cfg.text_len:
        return cond
    return F.pad(cond, (0, 0, 0, cfg.text_len - n))


def embed_cond(model: WanDiT, cond: torch.Tensor) -> torch.Tensor:
    """[..., n, text_dim] raw conditioning (n <= text_len, padded here) -> [..., Lt, D]."""
    return model.text_embedding(pad_text(model.cfg, cond).to(model.device, model.dtype))


def window_mask(chunks: int, window: int, device: torch.device) -> torch.Tensor:
    """[C, C] bool: chunk i may attend chunk j iff i-W <= j <= i."""
    i = torch.arange(chunks, device=device)
    return (i[None, :] <= i[:, None]) & (i[None, :] >= i[:, None] - window)


def forward_sequence(
    model: WanDiT,
    x_seq: torch.Tensor,
    sigmas: torch.Tensor,
    cond: torch.Tensor,
    actions: torch.Tensor | None = None,
    *,
    window: int,
    chunk_offset: int = 0,
    slots: torch.Tensor | None = None,
    chunk_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Full-sequence block-causal forward (no KV cache); differentiable: the training forward.

    x_seq [C, X] or [B, C, X] packed chunk states (``sampler.pack_chunk``); sigmas [C] or
    [B, C] per-chunk noise level (0 for clean/context chunks); cond [Lt, text_dim] or
    [B, Lt, text_dim] raw conditioning tokens; actions [(B,) C, H, A] if given replaces the
    action values packed in x; chunk_offset: absolute index of the first chunk (RoPE).
    ``slots`` [C] (instead of chunk_offset + 0..C-1) and ``chunk_mask`` [C, C] or [B, C, C]
    bool (instead of the window's block-causal mask): the time slot of each element and which
    elements each may attend, for sequences that hold two versions of a slot (the live
    oracle) or rows with different layouts (training windows).
    Returns the velocity v with x_seq's shape (float32; zero on conditioning action values).
    """
    cfg = model.cfg
    unbatched = x_seq.dim() == 2
    if unbatched:
        x_seq, sigmas, cond = x_seq[None], sigmas[None], cond[None]
        actions = None if actions is None else actions[None]
    b, c, xdim = x_seq.shape
    if xdim != chunk_numel(cfg):
        raise ValueError(
            f"x_seq has {xdim} values per chunk; model {cfg.name} needs {chunk_numel(cfg)}"
        )
    if actions is not None:
        lay = chunk_layout(cfg)
        x_seq = torch.cat(
            [
                x_seq[..., : lay.actions.start],
                actions.reshape(b, c, -1).to(x_seq),
                x_seq[..., lay.actions.stop :],
            ],
            -1,
        )
    dev = model.device
    x_seq = x_seq.to(dev)
    sigmas = sigmas.to(dev)
    n = cfg.tokens_per_chunk
    e, e0 = time_embed(model, sigmas, x_seq)  # [B, C, D], [B, C, 6, D]
    h = embed_tokens(model, x_seq)  # [B, C, n, D]
    chunk_ids = torch.arange(c, device=dev) + chunk_offset if slots is None else slots.to(dev)
    rope = rope_freqs(model, chunk_ids).expand(b, -1, -1, -1)  # [B, C, n, d/2]
    ctx = embed_cond(model, cond)
    if chunk_mask is None:
        chunk_mask = window_mask(c, window, dev)
    mask = chunk_mask.to(dev).repeat_interleave(n, -2).repeat_interleave(n, -1)
    if mask.dim() == 3:  # one mask per row: [B, 1, C*n, C*n] over the heads
        mask = mask[:, None]

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        q, k, v = (
            t.reshape(b, c * n, cfg.num_heads, cfg.head_dim).transpose(1, 2) for t in (q, k, v)
        )
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return o.transpose(1, 2).reshape(b, c, n, cfg.num_heads, cfg.head_dim)

    for i in range(cfg.num_blocks):
        ck, cv = cross_kv(model, i, ctx)
        h = block_forward(model, i, h, e0, rope, ck, cv, attend)
    v = head_velocity(model, h, e, x_seq, sigmas)
    return v[0] if unbatched else v
