"""Hand-written Triton kernels of the fused block (``fused.TritonKernels``): CUDA only.

One program per token row; every value is read once and written once, in float32 registers
(bf16 in memory). Two kernels:

- ``_norm_kernel``: [residual + gate ->] LayerNorm [-> modulation (1 + scale) * y + shift, or
  affine weight * y + bias]. The residual result is rounded to the storage dtype before it is
  normalised, so the normalised value is that of the h the next residual reads.
- ``_rms_rope_kernel``: [RMSNorm over the full width ->] [RoPE on adjacent pairs ->] store
  into a [head, token, head_dim]-strided destination: q for attention, or k / v straight into
  a KV-ring slot. Without norm and RoPE it is a strided copy (v).

Also runs under ``TRITON_INTERPRET=1`` on CPU tensors (how the kernels are tested without a
GPU: test_fused.py).
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # importable without Triton (CPU machines); the kernels need it
    triton = tl = None

NORM_NONE, NORM_MODULATE, NORM_AFFINE = 0, 1, 2


def _jit(fn):
    return triton.jit(fn) if triton is not None else fn


@_jit
def _norm_kernel(  # noqa: PLR0917
    x_ptr,
    a_ptr,
    gate_ptr,
    shift_ptr,
    scale_ptr,
    h_out_ptr,
    y_ptr,
    n_tok,
    D,
    gate_stride,
    mod_stride,
    eps,
    HAS_RES: tl.constexpr,
    HAS_GATE: tl.constexpr,
    NORM: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    task = row // n_tok
    cols = tl.arange(0, BLOCK)
    mask = cols < D
    base = row * D
    x = tl.load(x_ptr + base + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RES:
        a = tl.load(a_ptr + base + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_GATE:
            g = tl.load(gate_ptr + task * gate_stride + cols, mask=mask, other=0.0).to(tl.float32)
            a = a * g
        stored = (x + a).to(h_out_ptr.dtype.element_ty)
        tl.store(h_out_ptr + base + cols, stored, mask=mask)
        x = stored.to(tl.float32)
    if NORM != 0:
        mean = tl.sum(x, axis=0) / D
        xc = tl.where(mask, x - mean, 0.0)
        var = tl.sum(xc * xc, axis=0) / D
        y = xc * tl.rsqrt(var + eps)
        # NORM 1: per-task modulation vectors; NORM 2: affine weight and bias (row vectors,
        # passed in the shift/scale slots with mod_stride 0)
        sc = tl.load(scale_ptr + task * mod_stride + cols, mask=mask, other=0.0).to(tl.float32)
        sh = tl.load(shift_ptr + task * mod_stride + cols, mask=mask, other=0.0).to(tl.float32)
        if NORM == 1:  # noqa: SIM108 - a constexpr branch, compiled away
            y = y * (1.0 + sc) + sh
        else:
            y = y * sc + sh
        tl.store(y_ptr + base + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


@_jit
def _rms_rope_kernel(  # noqa: PLR0917
    src_ptr,
    src_stride,
    w_ptr,
    rope_ptr,
    dst_ptr,
    dst_head_stride,
    dst_tok_stride,
    D,
    HALF,
    eps,
    HAS_NORM: tl.constexpr,
    HAS_ROPE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    p = tl.arange(0, BLOCK)  # pair index: elements 2p, 2p+1 of the row
    mask = p < D // 2
    src = src_ptr + tok * src_stride
    xe = tl.load(src + 2 * p, mask=mask, other=0.0).to(tl.float32)
    xo = tl.load(src + 2 * p + 1, mask=mask, other=0.0).to(tl.float32)
    if HAS_NORM:
        r = tl.rsqrt(tl.sum(xe * xe + xo * xo, axis=0) / D + eps)
        we = tl.load(w_ptr + 2 * p, mask=mask, other=0.0).to(tl.float32)
        wo = tl.load(w_ptr + 2 * p + 1, mask=mask, other=0.0).to(tl.float32)
        xe = xe * r * we
        xo = xo * r * wo
    head = p // HALF
    f = p % HALF
    if HAS_ROPE:
        # rope: [tokens, HALF, 2] float32 (cos, sin) = torch.view_as_real of the complex table
        c = tl.load(rope_ptr + (tok * HALF + f) * 2, mask=mask, other=1.0)
        s = tl.load(rope_ptr + (tok * HALF + f) * 2 + 1, mask=mask, other=0.0)
        re = xe * c - xo * s
        xo = xe * s + xo * c
        xe = re
    dst = dst_ptr + head * dst_head_stride + tok * dst_tok_stride + 2 * f
    tl.store(dst, xe.to(dst_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + 1, xo.to(dst_ptr.dtype.element_ty), mask=mask)


def _next_power_of_2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def _warps(block: int) -> int:
    return max(4, min(16, block // 256))


def norm(
    x: torch.Tensor,
    tokens: int,
    *,
    eps: float,
    residual: torch.Tensor | None = None,
    gate: torch.Tensor | None = None,
    shift: torch.Tensor | None = None,
    scale: torch.Tensor | None = None,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    normalize: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, D] (T = tasks * tokens) -> (h, y): h = x + residual * gate[task] (or x), y its
    LayerNorm modulated by shift/scale[task] [B, D] (rows of a [B, 6, D] tensor), or affine
    by weight/bias [D], or h itself when not ``normalize``."""
    rows, dim = x.shape
    block = _next_power_of_2(dim)
    h = torch.empty_like(x) if residual is not None else x
    if not normalize:
        if residual is None:
            return x, x
        y = h
        mode = NORM_NONE
    else:
        y = torch.empty_like(x)
        mode = NORM_MODULATE if shift is not None else NORM_AFFINE
    if mode == NORM_AFFINE:
        shift, scale, mod_stride = bias, weight, 0
    elif mode == NORM_MODULATE:
        mod_stride = shift.stride(0)
    else:
        shift = scale = x
        mod_stride = 0
    _norm_kernel[(rows,)](
        x,
        residual if residual is not None else x,
        gate if gate is not None else x,
        shift,
        scale,
        h,
        y,
        tokens,
        dim,
        gate.stride(0) if gate is not None else 0,
        mod_stride,
        eps,
        HAS_RES=residual is not None,
        HAS_GATE=gate is not None,
        NORM=mode,
        BLOCK=block,
        num_warps=_warps(block),
    )
    return h, y


def rms_rope(
    src: torch.Tensor,
    dst: torch.Tensor,
    *,
    heads: int,
    eps: float,
    weight: torch.Tensor | None,
    rope: torch.Tensor | None,
) -> None:
    """src [T, D] rows (row stride free, unit column stride) -> dst [H, T, d] (any strides
    with a unit last one): RMSNorm by ``weight`` [D] (None: none), RoPE by ``rope`` [T, d/2, 2]
    float32 cos/sin (None: none)."""
    rows, dim = src.shape
    hd = dim // heads
    if src.stride(1) != 1 or dst.stride(2) != 1 or tuple(dst.shape) != (heads, rows, hd):
        raise ValueError(f"rms_rope: src {tuple(src.shape)} -> dst {tuple(dst.shape)} layout")
    if rope is not None and (rope.dtype != torch.float32 or not rope.is_contiguous()):
        raise ValueError("rms_rope: the rope table must be contiguous float32 [T, d/2, 2]")
    block = _next_power_of_2(dim // 2)
    _rms_rope_kernel[(rows,)](
        src,
        src.stride(0),
        weight if weight is not None else src,
        rope if rope is not None else src,
        dst,
        dst.stride(0),
        dst.stride(1),
        dim,
        hd // 2,
        eps,
        HAS_NORM=weight is not None,
        HAS_ROPE=rope is not None,
        BLOCK=block,
        num_warps=_warps(block),
    )
