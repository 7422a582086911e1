"""What one stream of a model needs in memory, before anything is loaded, and what would fit.

A server that loads a model whose first stream cannot fit ends minutes later, mid-start-up,
in an allocator's error. ``one_stream`` estimates a worker's bytes for one stream with the
pool's own figures (``MemoryModel.device_usage``: weights, KV slots, cross-attention K/V,
receive buffers, the workspace of the largest batched forward), the weights counted from the
safetensors headers where there are files, and the attention scores where this device's
attention kernel materialises them (the math kernel: [H, n, W'n] per task).
``check_one_stream_fits`` compares it with what the device has and refuses, naming the
breakdown, what is available and the largest window and resolution that would fit.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from physis_ros.cli_errors import UsageError
from physis_ros.contract.safetensors import read_shapes
from physis_ros.engine.checkpoints import format_bytes
from physis_ros.engine.config import ModelConfig, SamplerConfig
from physis_ros.engine.kvring import KVRing
from physis_ros.engine.placement import layout_even
from physis_ros.engine.pool.memory import MemoryModel, MemoryUsage
from physis_ros.engine.pool.plan import StreamPlan


@dataclass(frozen=True, kw_only=True)
class Footprint:
    """Bytes one worker holds for one stream (the pool's figures, plus attention scores)."""

    usage: MemoryUsage
    scores: int = 0
    """Attention scores of one task's self-attention, where the kernel materialises them."""

    @property
    def total(self) -> int:
        return self.usage.total + self.scores

    def describe(self) -> str:
        u = self.usage
        parts = [
            ("weights", u.weights),
            ("KV slots", u.kv),
            ("cross-attention K/V", u.cross_kv),
            ("receive buffers", u.buffers),
            ("block activations", u.workspace),
            ("attention scores", self.scores),
        ]
        shown = ", ".join(f"{name} {format_bytes(n)}" for name, n in parts if n)
        return f"{format_bytes(self.total)} ({shown})"


def available_bytes(device: torch.device) -> int:
    """Memory free for this process now: a GPU's free memory, or the host's available
    memory (``MemAvailable``) for a CPU device."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    with open("/proc/meminfo") as f:
        fields = dict(line.split(":", 1) for line in f)
    return int(fields["MemAvailable"].split()[0]) * 1024


def weight_elements(files: Iterable[str | Path]) -> int:
    """Elements of every tensor in the safetensors ``files`` (their headers only)."""
    total = 0
    for path in files:
        for shape in read_shapes(path).values():
            count = 1
            for d in shape:
                count *= d
            total += count
    return total


def materialises_scores(device: torch.device, dtype: torch.dtype, cfg: ModelConfig) -> bool:
    """True when scaled_dot_product_attention on ``device`` in ``dtype`` runs the math kernel
    (which builds the [H, n, m] score matrix) for this model's heads."""
    choose = getattr(torch, "_fused_sdp_choice", None)
    if choose is None:  # a torch without the chooser: its fused kernels are assumed
        return False
    q = torch.zeros(1, cfg.num_heads, 4, cfg.head_dim, dtype=dtype, device=device)
    try:
        return int(choose(q, q, q)) == 0  # SDPBackend.MATH
    except RuntimeError:
        return False


def one_stream(
    cfg: ModelConfig,
    sampler: SamplerConfig,
    memory: MemoryModel,
    *,
    workers: int = 1,
    stored_weights: int = 0,
    scores: bool = False,
) -> Footprint:
    """The busiest worker's bytes for one stream whose stages are spread evenly over
    ``workers`` (the pool's ``device_usage``); ``stored_weights``: the elements of the
    weights as stored (``weight_elements``; 0: the model's own count), of which the worker
    holds its share in the memory model's dtype; ``scores``: the attention kernel
    materialises its scores (``materialises_scores``)."""
    K, L = sampler.steps, cfg.num_blocks
    stages = tuple(r for row in layout_even(K, L, workers) for r in row)
    plan = StreamPlan(
        stream_id=0, model=cfg, sampler=sampler, target_interval_ms=0.0, stage_devices=stages
    )
    usage = max(
        (memory.device_usage([plan], device) for device in range(workers)),
        key=lambda u: u.total,
    )
    if stored_weights:
        whole = L * memory.block_weight_bytes(cfg) + memory.edge_weight_bytes(cfg)
        share = stored_weights * memory.dtype_bytes * usage.weights / whole
        usage = dataclasses.replace(usage, weights=round(share))
    score_bytes = 0
    if scores:
        n = cfg.tokens_per_chunk
        keys = KVRing.entries_for(sampler.window, 1) * n
        score_bytes = 2 * cfg.num_heads * n * keys * memory.dtype_bytes  # scores + softmax
    return Footprint(usage=usage, scores=score_bytes)


def check_one_stream_fits(
    cfg: ModelConfig,
    sampler: SamplerConfig,
    memory: MemoryModel,
    *,
    available: float,
    where: str,
    fix: str,
    **footprint_options,
) -> Footprint:
    """The footprint of one stream (``one_stream``) when it fits in ``available`` bytes;
    else UsageError with the breakdown, ``where`` the bytes were counted (e.g. "this host's
    available memory"), the largest window and resolution that fit, and ``fix``."""
    need = one_stream(cfg, sampler, memory, **footprint_options)
    if need.total <= available:
        return need
    size = f"{cfg.image_size[0]}x{cfg.image_size[1]}"
    problem = (
        f"model {cfg.name} at {size} with window {sampler.window} needs {need.describe()} for "
        f"one stream; {where} is {format_bytes(available)}"
    )
    if need.usage.weights > available:
        raise UsageError(f"{problem}: the weights alone do not fit", fix)
    fits = []
    window = _largest_window(cfg, sampler, memory, available, footprint_options)
    if window:
        fits.append(f"window {window} at {size}")
    resolution = _largest_resolution(cfg, sampler, memory, available, footprint_options)
    if resolution:
        fits.append(f"{resolution[0]}x{resolution[1]} at window {sampler.window}")
    fits_text = " or ".join(fits) if fits else "a shorter chunk (--latent-frames)"
    raise UsageError(f"{problem}; what fits: {fits_text}", fix)


def _largest_window(cfg, sampler, memory, available, options) -> int:
    for window in range(sampler.window - 1, 0, -1):
        smaller = dataclasses.replace(sampler, window=window)
        if one_stream(cfg, smaller, memory, **options).total <= available:
            return window
    return 0


def _largest_resolution(cfg, sampler, memory, available, options) -> tuple[int, int] | None:
    """The largest camera image of the same aspect ratio (a multiple of the codec's stride
    times the patch) at which one stream fits."""
    _, ph, pw = cfg.patch
    _, sh, sw = cfg.codec_stride
    aspect = cfg.latent_width / cfg.latent_height

    def shape(units: int) -> tuple[int, int]:
        return units * ph, max(pw, round(units * ph * aspect / pw) * pw)

    def fits(units: int) -> bool:
        lh, lw = shape(units)
        smaller = dataclasses.replace(cfg, latent_height=lh, latent_width=lw)
        return one_stream(smaller, sampler, memory, **options).total <= available

    lo, hi = 0, cfg.latent_height // ph - 1  # the largest that fits lies in [lo, hi]
    while lo < hi:  # what a stream needs grows with the image
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    if lo == 0 or not fits(lo):
        return None
    lh, lw = shape(lo)
    return lh * sh, lw * sw
