"""Whether the first stream of a resolved serving spec fits the memory its workers plan with,
checked before anything is loaded (``engine/pool/footprint.py`` has the estimate)."""

from __future__ import annotations

import torch

from physis_ros.engine.checkpoints import resolve_model as resolve_checkpoint
from physis_ros.engine.pool.footprint import check_one_stream_fits as check_fits
from physis_ros.engine.pool.footprint import materialises_scores, weight_elements
from physis_ros.serve.build import memory_model, usable_bytes
from physis_ros.serve.spec import ServingSpec


def check_one_stream_fits(spec: ServingSpec, device: torch.device, workers: int = 1) -> None:
    """Refuses a resolved spec whose first stream does not fit the memory each of
    ``workers`` workers may plan with (``usable_bytes``), before anything is loaded: the
    estimate broken down, and the largest window and resolution that would fit."""
    files = [spec.weights] if spec.weights else []
    if spec.model_directory:
        files = resolve_checkpoint(
            spec.model,
            latent_frames=spec.latent_frames,
            resolution=spec.resolution,
            vae=spec.vae,
            variant=spec.variant,
            dtype=spec.dtype,
        ).weights.files
    cfg = spec.model_config
    sharing = workers if device.type == "cpu" else 1
    where = (
        f"pool.memory_gib {spec.memory_gib:g} GiB per worker"
        if spec.memory_gib
        else f"the share of the available memory of {device} a worker plans with"
    )
    check_fits(
        cfg,
        spec.sampler(),
        memory_model(spec),
        available=usable_bytes(spec, device, sharing),
        where=where,
        fix="serve what fits (--resolution, engine.window), in bfloat16 (--dtype), or on a "
        "device with more memory (pool.memory_gib: the figure by hand)",
        workers=workers,
        stored_weights=weight_elements(files) if files else 0,
        scores=materialises_scores(device, getattr(torch, spec.dtype), cfg),
    )
