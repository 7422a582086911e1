"""The block-causal Wan-style diffusion transformer as modules: its weights, how they are
initialised, and their upstream (Wan2.1) key names in checkpoints.

What belongs here: the module tree (upstream Wan2.1 key names), seeded and unseeded
initialisation, and strict loading and saving of upstream-named state dicts and safetensors
files. The math that runs these weights (embeddings, RoPE, one block, the head, the
full-sequence forward) lives in ``forward.py``; how the engine runs the blocks (eager, fused,
CUDA graphs) in ``fused.py``; ``build.build_model`` builds a model with its block
implementation chosen.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from physis_ros.cli_errors import UsageError
from physis_ros.engine.config import ModelConfig

ROPE_THETA = 10000.0


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class Attention(nn.Module):
    """q, k, v, o projections with RMSNorm on q and k over the full width (Wan2.1; identity
    without ``qk_norm``, as upstream)."""

    def __init__(self, dim: int, eps: float, qk_norm: bool = True) -> None:
        super().__init__()
        self.q = nn.Linear(dim, dim)
        self.k = nn.Linear(dim, dim)
        self.v = nn.Linear(dim, dim)
        self.o = nn.Linear(dim, dim)
        self.norm_q = RMSNorm(dim, eps) if qk_norm else nn.Identity()
        self.norm_k = RMSNorm(dim, eps) if qk_norm else nn.Identity()


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        d = cfg.dim
        self.self_attn = Attention(d, cfg.eps, cfg.qk_norm)
        self.norm3 = (
            nn.LayerNorm(d, eps=cfg.eps, elementwise_affine=True)
            if cfg.cross_attn_norm
            else nn.Identity()
        )
        self.cross_attn = Attention(d, cfg.eps, cfg.qk_norm)
        self.ffn = nn.Sequential(
            nn.Linear(d, cfg.ffn_dim), nn.GELU(approximate="tanh"), nn.Linear(cfg.ffn_dim, d)
        )
        self.modulation = nn.Parameter(torch.randn(1, 6, d) / d**0.5)


class Head(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.head = nn.Linear(cfg.dim, cfg.patch_dim)
        self.modulation = nn.Parameter(torch.randn(1, 2, cfg.dim) / cfg.dim**0.5)
        if cfg.anchor_residual:  # per token feature (c, pt, ph, pw): how much of the anchor
            self.anchor_gate = nn.Parameter(torch.ones(cfg.patch_dim))


def _seeded(seed: int | None, part: int, make: Callable[[], nn.Module], device, dtype) -> nn.Module:
    # Each part is initialised from its own seed on the CPU, so a worker that builds only
    # blocks 10..19 gets exactly the weights the full model has there, on any device; each
    # part moves to the device at once, so a 14B model never sits whole in host memory.
    # seed None: the weights are loaded next (or only timed), so the part is allocated on the
    # device directly and filled at memory speed (a 14B model's random init on the CPU alone
    # takes minutes; one 33B block's, 10-25 s).
    if seed is None:
        with torch.device("meta"):
            part = make().to(dtype=dtype)
        part = part.to_empty(device=device)
        _fill_unseeded(part)
        return part
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed((seed * 1_000_003 + part + 7) % (2**63))
        return make().to(device=device, dtype=dtype)


_FILL_PERIOD = 65_537
"""A prime: rows of any width see the pattern shifted, not repeated."""


@torch.no_grad()
def _fill_unseeded(part: nn.Module) -> None:
    """Random-looking finite weights of the usual scales without a random draw per value: a
    fixed normal sequence repeated (matrices scaled by 1/sqrt(fan-in), norm weights near 1,
    biases near 0). Only the values' spread matters to timing, and loading overwrites them."""
    gen = torch.Generator().manual_seed(_FILL_PERIOD)
    base = torch.randn(_FILL_PERIOD, generator=gen)
    for name, p in part.named_parameters():
        if p.dim() >= 2:
            seq = base / p.shape[-1] ** 0.5
        elif "norm" in name and name.endswith("weight"):
            seq = 1 + 0.02 * base
        else:
            seq = 0.02 * base
        seq = seq.to(p.device, p.dtype)
        flat = p.view(-1)
        whole = flat.numel() // _FILL_PERIOD * _FILL_PERIOD
        flat[:whole].view(-1, _FILL_PERIOD).copy_(seq.expand(whole // _FILL_PERIOD, -1))
        flat[whole:].copy_(seq[: flat.numel() - whole])  # one pass over the weights


class WanDiT(nn.Module):
    """Wan2.1-style DiT. ``block_ids`` limits which blocks exist (the rest are None);
    ``seed`` None: unseeded init on the device, for weights that are loaded next."""

    def __init__(
        self,
        cfg: ModelConfig,
        *,
        seed: int | None = 0,
        block_ids: set[int] | None = None,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        self.cfg = cfg
        p = cfg.patch_dim
        stem = _seeded(seed, -1, lambda: Stem(cfg), device, dtype)
        # The stem's children become top-level modules so that the keys are upstream's.
        self.patch_embedding = stem.patch_embedding
        self.text_embedding = stem.text_embedding
        self.time_embedding = stem.time_embedding
        self.time_projection = stem.time_projection
        self.head = stem.head
        if cfg.action_mode == "predict":
            self.action_embedding = stem.action_embedding
            self.action_head = stem.action_head
            if cfg.committed_actions:
                self.action_known = stem.action_known
            if cfg.state_dim:
                self.state_embedding = stem.state_embedding
                self.state_head = stem.state_head
        elif cfg.action_mode == "condition":
            self.action_cond = stem.action_cond
        ids = set(range(cfg.num_blocks)) if block_ids is None else set(block_ids)
        self.blocks = nn.ModuleList(
            [
                _seeded(seed, i, lambda: Block(cfg), device, dtype) if i in ids else nn.Identity()
                for i in range(cfg.num_blocks)
            ]
        )
        self.block_ids = frozenset(ids)
        # head output is laid out (pt, ph, pw, c) upstream; our tokens are (c, pt, ph, pw).
        pt, ph, pw = cfg.patch
        perm = torch.arange(p).view(pt, ph, pw, cfg.in_channels).permute(3, 0, 1, 2).flatten()
        self.register_buffer("head_perm", perm, persistent=False)
        # float64 and kept out of the buffers so that .to(bf16) cannot round it.
        self._rope_inv = {torch.device("cpu"): rope_inv_freqs(cfg.head_dim)}

    @property
    def device(self) -> torch.device:
        return self.head.head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.head.head.weight.dtype

    def rope_inv_freq(self, device: torch.device) -> torch.Tensor:
        """[d/2] float64 RoPE inverse frequencies on ``device`` (cached)."""
        if device not in self._rope_inv:
            self._rope_inv[device] = self._rope_inv[torch.device("cpu")].to(device)
        return self._rope_inv[device]

    # ---- checkpoints -------------------------------------------------------------------------
    def save_safetensors(self, path: str | Path) -> None:
        """Write weights with upstream key names (patch_embedding as Conv3d [D, C, pt, ph, pw])."""
        save_file(to_upstream_state_dict(self), str(path))

    def load_safetensors(self, path: str | Path) -> None:
        """Load upstream-named weights, strictly: every key this model holds (the blocks it
        was built with, and the stem) must be in the file with its shape, and the file may
        hold no other key except those of blocks this model does not hold. Raises naming the
        file when it is not a readable safetensors file, and naming the tensor when one this
        model loads holds NaN or inf."""
        if not Path(path).is_file():
            raise FileNotFoundError(2, "weights file not found", str(path))
        try:
            state = load_file(str(path), device="cpu")
        except (SafetensorError, OSError) as exc:
            raise UsageError(
                f"{path} is not a readable safetensors file ({exc})",
                "copy it again, or export it again (physis-train writes weights.safetensors)",
            ) from exc
        load_upstream_state_dict(self, state, source=str(path))


class Stem(nn.Module):
    """Everything of the model but its blocks: the embeddings and the head (``WanDiT`` makes
    its children top-level modules, so that the keys are upstream's)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        d = cfg.dim
        self.patch_embedding = nn.Linear(cfg.patch_dim, d)
        self.text_embedding = nn.Sequential(
            nn.Linear(cfg.text_dim, d), nn.GELU(approximate="tanh"), nn.Linear(d, d)
        )
        self.time_embedding = nn.Sequential(nn.Linear(cfg.freq_dim, d), nn.SiLU(), nn.Linear(d, d))
        self.time_projection = nn.Sequential(nn.SiLU(), nn.Linear(d, 6 * d))
        self.head = Head(cfg)
        a = cfg.action_dim
        if cfg.action_mode == "predict":
            self.action_embedding = nn.Linear(a, d)
            self.action_head = nn.Linear(d, a)
            if cfg.committed_actions:  # flag 1: the row's value is known (clean)
                self.action_known = nn.Linear(1, d, bias=False)
            if cfg.state_dim:
                self.state_embedding = nn.Linear(cfg.state_dim, d)
                self.state_head = nn.Linear(d, cfg.state_dim)
        elif cfg.action_mode == "condition":
            self.action_cond = nn.Sequential(
                nn.Linear(cfg.action_horizon * a, d), nn.SiLU(), nn.Linear(d, d)
            )


def to_upstream_state_dict(model: WanDiT) -> dict[str, torch.Tensor]:
    cfg = model.cfg
    out = {}
    for key, param in model.state_dict().items():
        val = param.detach().contiguous().cpu()
        if key == "patch_embedding.weight":
            val = val.view(cfg.dim, cfg.in_channels, *cfg.patch).contiguous()
        out[key] = val
    return out


def load_upstream_state_dict(
    model: WanDiT, state: dict[str, torch.Tensor], *, source: str = "checkpoint"
) -> None:
    """Load ``state`` (upstream key names) into ``model`` strictly (see ``check_state_keys``)."""
    check_state_keys(model, {k: tuple(v.shape) for k, v in state.items()}, source=source)
    fixed = {}
    for key, tensor in state.items():
        if _is_absent_block(model, key):
            continue
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            bad = int((~torch.isfinite(tensor)).sum())
            raise UsageError(
                f"checkpoint tensor {key} holds {bad} NaN/inf value(s) of {tensor.numel()}: "
                "the weights are broken (a diverged training run?)",
                "use a checkpoint from before it went non-finite",
            )
        if key == "patch_embedding.weight":  # stored as the Conv3d [D, C, pt, ph, pw]
            fixed[key] = tensor.reshape(model.cfg.dim, model.cfg.patch_dim)
        else:
            fixed[key] = tensor
    model.load_state_dict(fixed)


def upstream_shapes(model: WanDiT) -> dict[str, tuple[int, ...]]:
    """Key -> shape of every tensor ``model`` holds, as an upstream checkpoint stores it."""
    cfg = model.cfg
    out = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    out["patch_embedding.weight"] = (cfg.dim, cfg.in_channels, *cfg.patch)
    return out


MAX_KEYS_NAMED = 8
"""A key mismatch names at most this many keys of each kind (and how many more there are)."""


def check_state_keys(
    model: WanDiT, shapes: dict[str, tuple[int, ...]], *, source: str = "checkpoint"
) -> None:
    """Raise ValueError, in one line naming the keys, unless ``shapes`` (key -> shape of a
    checkpoint) holds exactly the tensors ``model`` needs: none missing, none unexpected
    (keys of blocks the model was built without are skipped, not unexpected), none of another
    shape. ``model`` may live on the meta device (shapes only)."""
    own = upstream_shapes(model)
    missing = sorted(k for k in own if k not in shapes)
    unexpected = sorted(k for k in shapes if k not in own and not _is_absent_block(model, k))
    misshaped = sorted(
        f"{k} {list(shapes[k])} (model {list(own[k])})"
        for k in own
        if k in shapes and tuple(shapes[k]) != own[k]
    )
    parts = [
        f"{label} {len(keys)} key(s) {_named(keys)}"
        for label, keys in (
            ("lacks", missing),
            ("has unexpected", unexpected),
            ("has mis-shaped", misshaped),
        )
        if keys
    ]
    if parts:
        raise ValueError(f"{source} does not fit model {model.cfg.name}: " + "; ".join(parts))


def _named(keys: list[str]) -> str:
    shown = ", ".join(keys[:MAX_KEYS_NAMED])
    more = len(keys) - MAX_KEYS_NAMED
    return f"[{shown}{f', and {more} more' if more > 0 else ''}]"


def _is_absent_block(model: WanDiT, key: str) -> bool:
    parts = key.split(".")
    return (
        len(parts) > 1
        and parts[0] == "blocks"
        and parts[1].isdigit()
        and int(parts[1]) < model.cfg.num_blocks
        and int(parts[1]) not in model.block_ids
    )


def rope_inv_freqs(head_dim: int) -> torch.Tensor:
    """[d/2] float64 inverse frequencies: temporal part, then h, then w (Wan's 3-D split)."""
    part = head_dim // 6
    dims = (head_dim - 4 * part, 2 * part, 2 * part)
    return torch.cat(
        [1.0 / ROPE_THETA ** (torch.arange(0, p, 2, dtype=torch.float64) / p) for p in dims]
    )


def param_count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
