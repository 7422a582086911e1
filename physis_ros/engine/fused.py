"""The fused block forward: the block-task of ``stage.run_block`` with everything that is not a
GEMM or attention done in few passes over the activations.

Same math as ``forward.block_forward`` with the stage's per-task attention, arranged for a GPU:
- q, k and v come from ONE GEMM against a [3D, D] weight. That weight (and the [2, D] q/k norm
  weights) is built once per block when the path is enabled, and the model's q/k/v parameters
  become views into it: upstream-named checkpoints still load strictly (the loaders copy into
  the views), the eager path runs on the same memory, and no weight exists twice. A block
  whose parameters were replaced or moved since (``model.to``, a rank loading more blocks) is
  re-fused on its next forward.
- RMSNorm + RoPE of q and k is one pass per tensor that writes q for attention and k (and v)
  straight into the task's KV-ring slot (``KVRing.reserve``): no ring copy.
- residual + gate + LayerNorm + modulation (or affine) is one pass, three times per block.
- cross-attention runs once for all tasks of a batch that share a stream's text K/V (their
  queries concatenated: every query row attends the same keys), not once per task.
- on CUDA the FFN's GELU (tanh) is the first FFN GEMM's epilogue (``torch._addmm_activation``,
  cuBLASLt): one pass over the [N, F] activation less.
Self-attention stays one SDPA call per task: each task attends its own ring.
With ``slots`` (a device tensor: the KV-ring slot of each task) the forward depends on no host
value that changes from chunk to chunk, so ``block_graphs`` can capture it once per batch
composition and replay it (block implementation ``graph``).

Kernels: ``triton`` (CUDA; ``fused_triton``) or ``torch`` (any device: the same passes as torch
ops; in float32 the fused path then equals the eager one to round-off, which is what CI tests
on the CPU).

Which implementation a model runs (this module owns the choice): ``eager``
(``forward.block_forward``), ``fused`` or ``graph`` (the fused path replayed as CUDA graphs
where the batch composition repeats: ``block_graphs``; on a CPU the same static path, not
captured). By default it follows the device (``choose_block_impl``): fused on CUDA, eager
elsewhere. ``build_model(block_impl=...)``, ``--block-impl`` on physis-profile and physis-bench
engine, or ``PHYSIS_BLOCK_IMPL`` for every model a process builds override it;
``set_block_impl(model, impl)`` sets it on a built model.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from physis_ros.engine.block_graphs import BlockGraphs
from physis_ros.engine.forward import apply_rope
from physis_ros.engine.kvring import StageTask
from physis_ros.engine.model import RMSNorm, WanDiT

log = logging.getLogger(__name__)

BLOCK_IMPLS = ("eager", "fused", "graph")
BLOCK_IMPL_ENV = "PHYSIS_BLOCK_IMPL"
"""Environment variable: the block implementation every ``build_model`` call selects, over the
device's default."""
DEVICE_BLOCK_IMPLS = {"cuda": "fused"}
"""The implementation a device type runs unless one is asked for; other devices run eager. On
CUDA the fused path is faster than eager and within bf16 tolerance of it (docs/gpu.md); its
passes are arranged for a GPU (Triton kernels, the cuBLASLt GELU epilogue)."""
REQUESTED = "asked for"
"""The reason ``choose_block_impl`` gives for an implementation its caller named."""
KERNELS = ("auto", "triton", "torch")


def choose_block_impl(
    device_type: str, requested: str | None = None, env: str | None = None
) -> tuple[str, str]:
    """(implementation, why) a model on a ``device_type`` device runs: ``requested`` if given,
    else ``env`` (the value of ``PHYSIS_BLOCK_IMPL``; None: read it), else the device's default
    (``DEVICE_BLOCK_IMPLS``). Why is ``REQUESTED``, ``PHYSIS_BLOCK_IMPL`` or the device type."""
    if requested:
        _check_impl(requested, "block implementation")
        return requested, REQUESTED
    if env is None:
        env = os.environ.get(BLOCK_IMPL_ENV, "")
    if env:
        _check_impl(env, BLOCK_IMPL_ENV)
        return env, BLOCK_IMPL_ENV
    return DEVICE_BLOCK_IMPLS.get(device_type, "eager"), device_type


def _check_impl(impl: str, what: str) -> None:
    if impl not in BLOCK_IMPLS:
        name = f"{what}={impl!r}" if what == BLOCK_IMPL_ENV else f"{what} {impl!r}"
        raise ValueError(f"{name} is not one of {BLOCK_IMPLS}")


def default_block_impl(device: str | torch.device = "cpu") -> str:
    """The implementation a model on ``device`` runs unless one is asked for
    (``PHYSIS_BLOCK_IMPL``, else the device's default)."""
    return choose_block_impl(torch.device(device).type)[0]


def set_block_impl(
    model: WanDiT, impl: str, *, kernels: str = "auto", reason: str = REQUESTED
) -> None:
    """Select how ``stage.run_block`` runs ``model``'s blocks: ``eager``, ``fused`` or
    ``graph`` (fused, replayed as CUDA graphs); ``reason``: why, for ``describe_block_impl``."""
    _check_impl(impl, "block implementation")
    model.fused_blocks = (
        None if impl == "eager" else FusedBlocks(model, kernels=kernels, graphs=impl == "graph")
    )
    model.block_impl_reason = reason


def block_impl(model: WanDiT) -> str:
    runner = fused_blocks(model)
    if runner is None:
        return "eager"
    return "graph" if runner.graphs is not None else "fused"


def describe_block_impl(model: WanDiT | None = None) -> str:
    """Which implementation runs ``model``'s blocks and why, e.g. ``fused implementation
    (cuda)``; without a model, how one is chosen in this process."""
    if model is not None:
        reason = getattr(model, "block_impl_reason", REQUESTED)
        return f"{block_impl(model)} implementation ({reason})"
    on_cpu, why = choose_block_impl("cpu")
    if why != "cpu":  # the environment names one: every device runs it
        return f"{on_cpu} implementation ({why})"
    on_cuda, _ = choose_block_impl("cuda")
    return f"{on_cuda} implementation on cuda, {on_cpu} on cpu (the device's default)"


def fused_blocks(model: WanDiT) -> FusedBlocks | None:
    return getattr(model, "fused_blocks", None)


def triton_available() -> bool:
    try:
        import triton  # noqa: F401 - optional: the CUDA kernels' compiler
    except ImportError:
        return False
    return True


# ---- the passes, as torch ops (any device) ---------------------------------------------------
class TorchKernels:
    """The fused passes written with torch ops; in float32 equal to the eager block."""

    name = "torch"

    @staticmethod
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
        rows, dim = x.shape
        b = rows // tokens
        h = x.view(b, tokens, dim)
        if residual is not None:
            a = residual.view(b, tokens, dim)
            h = h + (a * gate[:, None] if gate is not None else a)
        if not normalize:
            y = h
        elif shift is not None:
            y = F.layer_norm(h, (dim,), eps=eps) * (1 + scale[:, None]) + shift[:, None]
        else:
            y = F.layer_norm(h, (dim,), weight, bias, eps)
        return h.reshape(rows, dim), y.reshape(rows, dim)

    @staticmethod
    def rms_rope(
        src: torch.Tensor,
        dst: torch.Tensor,
        *,
        heads: int,
        eps: float,
        weight: torch.Tensor | None,
        rope: torch.Tensor | None,
        slot: torch.Tensor | None = None,
    ) -> None:
        x = src
        if weight is not None:
            x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight
        x = x.unflatten(-1, (heads, -1))  # [T, H, d]
        if rope is not None:
            x = apply_rope(x, torch.view_as_complex(rope))
        x = x.transpose(0, 1)  # [H, T, d]
        if slot is None:
            dst.copy_(x)
        else:  # dst is a whole ring [H, S*T, d]: rows slot*T.. of it, ``slot`` [1] on device
            dst.unflatten(1, (-1, x.shape[1])).index_copy_(1, slot, x.unsqueeze(1).to(dst.dtype))


class TritonKernels:
    """The hand-written Triton kernels (``fused_triton``): CUDA, or the Triton interpreter."""

    name = "triton"

    def __init__(self) -> None:
        from physis_ros.engine import fused_triton  # imports triton (optional)

        self.norm = fused_triton.norm
        self.rms_rope = fused_triton.rms_rope


def make_kernels(kernels: str, device: torch.device):
    if kernels not in KERNELS:
        raise ValueError(f"kernels {kernels!r} is not one of {KERNELS}")
    if kernels == "auto":
        kernels = "triton" if device.type == "cuda" and triton_available() else "torch"
    if kernels == "triton":
        if not triton_available():
            raise ValueError("kernels 'triton' need the triton package")
        return TritonKernels()
    return TorchKernels()


# ---- fused weights ---------------------------------------------------------------------------
def _alias(params: list[nn.Parameter]) -> torch.Tensor:
    """One contiguous buffer holding ``params`` back to back along dim 0; each parameter
    becomes a view of its rows (values unchanged)."""
    with torch.inference_mode(False), torch.no_grad():
        buf = torch.cat([p.detach() for p in params])
        row = 0
        for p in params:
            p.data = buf[row : row + p.shape[0]]
            row += p.shape[0]
    return buf


@dataclass
class _BlockWeights:
    module: nn.Module
    qkv_w: torch.Tensor
    """[3D, D]: q, k, v weights stacked; the model's parameters are views of it."""
    qkv_b: torch.Tensor
    """[3D]."""
    qk_norm: torch.Tensor | None
    """[2D] RMSNorm weights of q then k (None without qk_norm)."""
    views: tuple[tuple[nn.Parameter, int], ...]
    """(parameter, its data_ptr when fused): a changed pointer means re-fuse."""

    def current(self, module: nn.Module) -> bool:
        return module is self.module and all(p.data_ptr() == ptr for p, ptr in self.views)


def _fuse_block(blk: nn.Module) -> _BlockWeights:
    sa = blk.self_attn
    lins = [sa.q, sa.k, sa.v]
    qkv_w = _alias([lin.weight for lin in lins])
    qkv_b = _alias([lin.bias for lin in lins])
    qk_norm = None
    params = [lin.weight for lin in lins] + [lin.bias for lin in lins]
    if isinstance(sa.norm_q, RMSNorm):
        qk_norm = _alias([sa.norm_q.weight, sa.norm_k.weight])
        params += [sa.norm_q.weight, sa.norm_k.weight]
    views = tuple((p, p.data_ptr()) for p in params)
    return _BlockWeights(blk, qkv_w, qkv_b, qk_norm, views)


class FusedBlocks:
    """The fused forward of ``model``'s blocks (see the module docstring)."""

    def __init__(
        self,
        model: WanDiT,
        *,
        kernels: str = "auto",
        gelu_epilogue: bool | None = None,
        graphs: bool = False,
    ) -> None:
        self.model = model
        self.cfg = model.cfg
        self.kernels = make_kernels(kernels, model.device)
        self.gelu_epilogue = model.device.type == "cuda" if gelu_epilogue is None else gelu_epilogue
        """FFN GELU as the GEMM's cuBLASLt epilogue (CUDA; on the CPU it is two ops anyway)."""
        self._weights: dict[int, _BlockWeights] = {}
        for i in sorted(model.block_ids):
            self._weights[i] = _fuse_block(model.blocks[i])
        self.graphs = None
        """``block_graphs.BlockGraphs`` when the forward is replayed as CUDA graphs."""
        self.set_graphs(graphs)

    def set_graphs(self, on: bool) -> None:
        """Replay the forward as CUDA graphs per batch composition (``block_graphs``)."""
        if not on:
            self.graphs = None
        elif self.graphs is None:
            self.graphs = BlockGraphs(self)

    def run(
        self, block: int, h: torch.Tensor, e0: torch.Tensor, rope: torch.Tensor, tasks
    ) -> torch.Tensor:
        """``forward``, through the CUDA graphs when they are on."""
        if self.graphs is not None:
            return self.graphs.forward(block, h, e0, rope, tasks)
        return self.forward(block, h, e0, rope, tasks)

    def weights(self, block: int) -> _BlockWeights:
        blk = self.model.blocks[block]
        w = self._weights.get(block)
        if w is None or not w.current(blk):
            if w is not None:
                log.info("block %d: parameters replaced or moved, fusing its q/k/v again", block)
            w = self._weights[block] = _fuse_block(blk)
        return w

    def forward(
        self,
        block: int,
        h: torch.Tensor,
        e0: torch.Tensor,
        rope: torch.Tensor,
        tasks: list[StageTask],
        *,
        slots: torch.Tensor | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """h [B, n, D], e0 [B, 6, D], rope [B, n, d/2] complex -> h [B, n, D] after ``block``;
        each task's K/V go into its ring (``task.ring``, the entry of its slot).

        ``slots`` [B] int64 on the device: every task's ring is full for its chunk
        (``KVRing.full``) and the caller has taken the entries (``KVRing.take_entry``); K/V
        are written at those entries and each task attends its whole ring, so no host value
        of this chunk is read. ``out``: where the result goes (else a new tensor)."""
        cfg, kern = self.cfg, self.kernels
        blk = self.model.blocks[block]
        w = self.weights(block)
        b, n, dim = h.shape
        heads, hd, eps = cfg.num_heads, cfg.head_dim, cfg.eps
        rows = b * n
        mod = (blk.modulation + e0).contiguous()  # [B, 6, D]: shift, scale, gate (x2)
        x = h.reshape(rows, dim)
        _, y = kern.norm(x, n, eps=eps, shift=mod[:, 0], scale=mod[:, 1])
        qkv = F.linear(y, w.qkv_w, w.qkv_b)  # [T, 3D]
        rope_t = torch.view_as_real(rope.reshape(rows, hd // 2))  # [T, d/2, 2] cos, sin
        qn = kn = None
        if w.qk_norm is not None:
            qn, kn = w.qk_norm[:dim], w.qk_norm[dim:]
        q = torch.empty(rows, dim, dtype=h.dtype, device=h.device)
        kern.rms_rope(
            qkv[:, :dim], q.view(rows, heads, hd).transpose(0, 1), heads=heads, eps=eps,
            weight=qn, rope=rope_t,
        )  # fmt: skip
        outs = []
        for i, t in enumerate(tasks):
            r = slice(i * n, (i + 1) * n)
            if slots is None:
                k_slot, v_slot = t.ring.reserve(t.chunk, observed=t.observed)
                slot = None
            else:  # the whole ring: the entry index is read on the device
                k_slot, v_slot = t.ring.k, t.ring.v
                slot = slots[i : i + 1]
            kern.rms_rope(qkv[r, dim : 2 * dim], k_slot, heads=heads, eps=eps, weight=kn,
                          rope=rope_t[r], slot=slot)  # fmt: skip
            kern.rms_rope(qkv[r, 2 * dim :], v_slot, heads=heads, eps=eps, weight=None, rope=None,
                          slot=slot)  # fmt: skip
            k_all, v_all = (t.ring.k, t.ring.v) if slot is not None else t.ring.attended(t.chunk)
            qi = q[r].view(n, heads, hd).transpose(0, 1)[None]
            o = F.scaled_dot_product_attention(qi, k_all[None], v_all[None])  # [1, H, n, d]
            outs.append(o[0].transpose(0, 1))  # [n, H, d]
        o = outs[0].reshape(n, dim) if b == 1 else torch.stack(outs).reshape(rows, dim)
        sa, ca = blk.self_attn, blk.cross_attn
        a = F.linear(o, sa.o.weight, sa.o.bias)
        if isinstance(blk.norm3, nn.LayerNorm):
            h1, y = kern.norm(x, n, eps=blk.norm3.eps, residual=a, gate=mod[:, 2],
                              weight=blk.norm3.weight, bias=blk.norm3.bias)  # fmt: skip
        else:
            h1, y = kern.norm(x, n, eps=eps, residual=a, gate=mod[:, 2], normalize=False)
        cq = F.linear(y, ca.q.weight, ca.q.bias)
        if isinstance(ca.norm_q, RMSNorm):
            normed = torch.empty_like(cq)
            kern.rms_rope(cq, normed.view(rows, heads, hd).transpose(0, 1), heads=heads,
                          eps=ca.norm_q.eps, weight=ca.norm_q.weight, rope=None)  # fmt: skip
            cq = normed
        c = F.linear(self._cross_attention(cq, tasks, n), ca.o.weight, ca.o.bias)
        h2, y = kern.norm(h1, n, eps=eps, residual=c, shift=mod[:, 3], scale=mod[:, 4])
        up, down = blk.ffn[0], blk.ffn[2]
        if self.gelu_epilogue:
            f = torch._addmm_activation(up.bias, y, up.weight.t(), use_gelu=True)
        else:
            f = F.gelu(F.linear(y, up.weight, up.bias), approximate="tanh")
        f = F.linear(f, down.weight, down.bias)
        if out is not None:
            return torch.addcmul(h2.view(b, n, dim), f.view(b, n, dim), mod[:, 5:6], out=out)
        return torch.addcmul(h2.view(b, n, dim), f.view(b, n, dim), mod[:, 5:6])

    def _cross_attention(self, cq: torch.Tensor, tasks: list[StageTask], n: int) -> torch.Tensor:
        """cq [T, D] -> attention output [T, D] against each task's text K/V [H, Lt, d]."""
        rows, dim = cq.shape
        heads, hd = self.cfg.num_heads, self.cfg.head_dim
        ck, cv = tasks[0].cross_k, tasks[0].cross_v
        if all(t.cross_k is ck and t.cross_v is cv for t in tasks):  # one stream's tasks
            q = cq.view(1, rows, heads, hd).transpose(1, 2)
            o = F.scaled_dot_product_attention(q, ck[None], cv[None])  # [1, H, T, d]
            return o[0].transpose(0, 1).reshape(rows, dim)
        outs = []
        for i, t in enumerate(tasks):
            q = cq[i * n : (i + 1) * n].view(1, n, heads, hd).transpose(1, 2)
            o = F.scaled_dot_product_attention(q, t.cross_k[None], t.cross_v[None])
            outs.append(o[0].transpose(0, 1))
        return torch.stack(outs).reshape(rows, dim)
