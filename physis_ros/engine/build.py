"""A model ready for the engine: its weights on the device in its dtype, in eval mode, and the
block implementation it runs chosen (``fused.choose_block_impl``: fused on CUDA, eager on the
CPU, unless one is asked for)."""

from __future__ import annotations

import torch

from physis_ros.engine import fused
from physis_ros.engine.config import ModelConfig
from physis_ros.engine.devices import checked_device
from physis_ros.engine.model import WanDiT


def build_model(
    cfg: ModelConfig,
    *,
    seed: int | None = 0,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    block_ids: set[int] | None = None,
    block_impl: str | None = None,
) -> WanDiT:
    """Random-init (by seed; None: unseeded, to load weights into) model on ``device`` in
    ``dtype``, in eval mode. ``block_impl``: how the engine runs its blocks, ``eager``,
    ``fused`` or ``graph`` (``fused.py``; None: the ``PHYSIS_BLOCK_IMPL`` environment
    variable, else the device's default)."""
    device = checked_device(device)
    impl, reason = fused.choose_block_impl(device.type, block_impl)
    model = WanDiT(cfg, seed=seed, block_ids=block_ids, device=device, dtype=dtype)
    model = model.to(device=device).eval()  # the head_perm buffer
    fused.set_block_impl(model, impl, reason=reason)
    return model
