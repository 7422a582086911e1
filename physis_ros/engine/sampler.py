"""The flow-matching schedule, seeded initial noise, and the packed chunk layout.

A chunk's state x is one flat float32 vector: the latent as video tokens [Nv, C*pt*ph*pw]
(token order (t, h, w) of the grid, feature order (c, pt, ph, pw)) followed by the action
values [H, A] when the model has actions. In ``predict`` mode the action values are state
(noised and denoised); in ``condition`` mode they are the commanded actions (never updated).
"""

from __future__ import annotations

import torch

from physis_ros.engine.config import ModelConfig, SamplerConfig
from physis_ros.engine.model import chunk_numel


def sigmas(sampler: SamplerConfig) -> list[float]:
    """sigma_0 = 1 ... sigma_K = 0: shifted linspace, shift*s / (1 + (shift-1)*s)."""
    k = sampler.steps
    s = [1.0 - i / k for i in range(k + 1)]
    sh = sampler.shift
    return [sh * v / (1.0 + (sh - 1.0) * v) for v in s]


def noise_seed(stream_seed: int, chunk: int) -> int:
    """The generator seed of chunk ``chunk``'s initial noise: a fixed function of both."""
    return (stream_seed * 1_000_003 + chunk * 7_919 + 12_345) % (2**63)


def context_noise(cfg: ModelConfig, stream_seed: int, slot: int) -> torch.Tensor:
    """[state_numel] float32 CPU noise of observed slot ``slot`` under ``noised`` context
    (drawn from its own seed, never the generated chunk's noise of that slot)."""
    seed = (noise_seed(stream_seed, slot) * 31 + 977) % (2**63)
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(state_numel(cfg), generator=gen, dtype=torch.float32)


def noise_context(
    cfg: ModelConfig, x: torch.Tensor, eps: torch.Tensor, sigma: float
) -> torch.Tensor:
    """x [..., X] observed chunk -> (1 - sigma) x + sigma eps on its state values (the video
    tokens, and predicted actions); commanded actions that condition the model stay as sent."""
    n = eps.shape[-1]
    state = (1.0 - sigma) * x[..., :n] + sigma * eps.to(x.device)
    return torch.cat([state, x[..., n:]], dim=-1)


def state_numel(cfg: ModelConfig) -> int:
    """Values of x that are denoised (video tokens, plus action values in predict mode)."""
    extra = cfg.action_horizon * cfg.action_dim if cfg.action_mode == "predict" else 0
    return cfg.video_tokens * cfg.patch_dim + extra


def initial_noise(
    cfg: ModelConfig, stream_seed: int, chunk: int, actions: torch.Tensor | None = None
) -> torch.Tensor:
    """x^(0) of a generated chunk, [X] float32 on the CPU (drawn on the CPU for every device).

    ``actions`` [H, A]: the commanded actions of a ``condition`` model (zeros if None)."""
    gen = torch.Generator().manual_seed(noise_seed(stream_seed, chunk))
    x = torch.randn(state_numel(cfg), generator=gen, dtype=torch.float32)
    if cfg.action_mode == "condition":
        x = torch.cat([x, _actions(cfg, actions)])
    elif actions is not None:
        raise ValueError(
            f"model {cfg.name} (action_mode {cfg.action_mode!r}) takes no commanded actions"
        )
    return x


def _actions(cfg: ModelConfig, actions: torch.Tensor | None) -> torch.Tensor:
    shape = (cfg.action_horizon, cfg.action_dim)
    if actions is None:
        return torch.zeros(shape[0] * shape[1])
    actions = torch.as_tensor(actions, dtype=torch.float32)
    if tuple(actions.shape) != shape:
        raise ValueError(
            f"actions have shape {tuple(actions.shape)}, model {cfg.name} needs {shape}"
        )
    if not torch.isfinite(actions).all():
        raise ValueError("actions contain NaN or inf")
    return actions.reshape(-1).cpu()


def latent_to_tokens(cfg: ModelConfig, latent: torch.Tensor) -> torch.Tensor:
    """[C, T, h, w] -> [Nv, C*pt*ph*pw] (the Conv3d patch flattening)."""
    c, t, hh, ww = latent.shape
    if (c, t, hh, ww) != (cfg.in_channels, cfg.latent_frames, cfg.latent_height, cfg.latent_width):
        raise ValueError(
            f"latent has shape {tuple(latent.shape)}, model {cfg.name} needs "
            f"{(cfg.in_channels, cfg.latent_frames, cfg.latent_height, cfg.latent_width)}"
        )
    pt, ph, pw = cfg.patch
    x = latent.reshape(c, t // pt, pt, hh // ph, ph, ww // pw, pw)
    return x.permute(1, 3, 5, 0, 2, 4, 6).reshape(cfg.video_tokens, cfg.patch_dim)


def tokens_to_latent(cfg: ModelConfig, tokens: torch.Tensor) -> torch.Tensor:
    """[Nv, P] -> [C, T, h, w]; inverse of latent_to_tokens."""
    pt, ph, pw = cfg.patch
    gt, gh, gw = cfg.grid
    x = tokens.reshape(gt, gh, gw, cfg.in_channels, pt, ph, pw)
    return x.permute(3, 0, 4, 1, 5, 2, 6).reshape(
        cfg.in_channels, cfg.latent_frames, cfg.latent_height, cfg.latent_width
    )


def pack_chunk(
    cfg: ModelConfig, latent: torch.Tensor, actions: torch.Tensor | None = None
) -> torch.Tensor:
    """latent [C, T, h, w] (+ actions [H, A]) -> x [X] float32."""
    x = latent_to_tokens(cfg, latent.float()).reshape(-1)
    if cfg.action_mode != "none":
        x = torch.cat([x, _actions(cfg, actions).to(x.device)])
    elif actions is not None:
        raise ValueError(f"model {cfg.name} has no actions")
    return x


def unpack_chunk(cfg: ModelConfig, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x [X] -> (latent [C, T, h, w], actions [H, A] or None)."""
    if x.numel() != chunk_numel(cfg):
        raise ValueError(f"chunk has {x.numel()} values, model {cfg.name} needs {chunk_numel(cfg)}")
    nvp = cfg.video_tokens * cfg.patch_dim
    latent = tokens_to_latent(cfg, x[:nvp].reshape(cfg.video_tokens, cfg.patch_dim))
    if cfg.action_mode == "none":
        return latent, None
    return latent, x[nvp:].reshape(cfg.action_horizon, cfg.action_dim)
