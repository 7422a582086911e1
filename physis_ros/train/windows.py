"""A training window of ``physis-train`` and its loss: ``n_obs`` observed chunks then
``horizon`` predicted ones, all at one noise level, laid out and masked the way a served
stream's chunk sees them (``train`` draws the windows and runs the steps)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from physis_ros.engine.forward import forward_sequence
from physis_ros.engine.sampler import anchor_tokens, chunk_layout

LOSSES = ("mse", "log_mse")
DEFAULT_LOG_FLOOR = 1e-8
"""log_mse's floor: about 86 dB PSNR (an RMS error of 0.013 levels of 255). The per-window
PSNR a user sees counts a frame copy-last-frame gets exactly as 100 dB; with a floor of 2e-5
(53 dB) the loss could not tell a still scene reproduced exactly from one off by a level in
a few pixels, and on the held-out bags those frames alone cost 0.4-0.6 dB of the mean
(docs/push_wm)."""


def shifted(u: torch.Tensor, shift: float) -> torch.Tensor:
    return shift * u / (1.0 + (shift - 1.0) * u)


@dataclass(frozen=True)
class Windows:
    """A batch of training windows: ``x0`` [B, C, X] packed clean chunks, the first C - h of
    them observed positions (row b's observations are its last ``n_obs[b]`` of those, the
    earlier ones unused), the last h predicted; ``sigma`` [B] each row's noise level; ``eps``
    [B, C, S] noise over the state values (S = sampler.state_numel)."""

    x0: torch.Tensor
    n_obs: torch.Tensor
    sigma: torch.Tensor
    eps: torch.Tensor
    horizon: int


def as_served(cfg, x0: torch.Tensor, first_predicted: int) -> torch.Tensor:
    """x0 [B, C, X] with every predicted chunk given what the server gives it: the newest
    observed command (the last action row of chunk first_predicted - 1) held over it, and
    that chunk as its anchor (``anchor_residual``)."""
    out = x0.clone()
    lay = chunk_layout(cfg)
    newest = x0[:, first_predicted - 1]  # [B, X]
    if cfg.action_mode == "condition":
        held = newest[:, lay.actions][:, -cfg.action_dim :]  # [B, A]
        out[:, first_predicted:, lay.actions] = held[:, None, :].repeat(1, 1, cfg.action_horizon)
    if cfg.anchor_residual:
        out[:, first_predicted:, lay.anchor] = anchor_tokens(cfg, newest)[:, None, :]
    return out


def window_mask(n_obs: torch.Tensor, chunks: int, horizon: int, window: int) -> torch.Tensor:
    """[B, C, C] bool: block-causal with window W, unused leading positions attended by none
    (each attends only itself, so its row stays finite)."""
    i = torch.arange(chunks)
    causal = (i[None, :] <= i[:, None]) & (i[None, :] >= i[:, None] - window)
    used = i[None, :] >= (chunks - horizon - n_obs)[:, None]  # [B, C]
    mask = causal[None] & used[:, None, :] & used[:, :, None]
    return mask | torch.eye(chunks, dtype=torch.bool)[None]


def noisy_history_loss(
    model,
    w: Windows,
    *,
    cond,
    window: int,
    context_noise: str = "clean",
    loss: str = "mse",
    log_floor: float = DEFAULT_LOG_FLOOR,
):
    """Mean squared velocity error over the predicted chunks' video values of windows ``w``
    (``loss`` ``log_mse``: the mean of log(x0 MSE + log_floor) over the predicted chunks;
    TrainConfig.loss)."""
    cfg = model.cfg
    b, c, _ = w.x0.shape
    nvp = cfg.video_tokens * cfg.patch_dim
    predicted = torch.arange(c)[None, :].expand(b, -1) >= c - w.horizon  # [B, C]
    noised = predicted | torch.full_like(predicted, context_noise == "noised")
    sig = torch.where(noised, w.sigma[:, None], torch.zeros(()))  # [B, C]
    x0 = as_served(cfg, w.x0, c - w.horizon)
    video = x0[..., :nvp]
    x_in = x0.clone()
    x_in[..., :nvp] = (1 - sig[..., None]) * video + sig[..., None] * w.eps[..., :nvp]
    mask = window_mask(w.n_obs, c, w.horizon, window)
    v = forward_sequence(model, x_in, sig, cond, window=window, chunk_mask=mask)[..., :nvp]
    err = (v - (w.eps[..., :nvp] - video)).pow(2).mean(-1)  # [B, C]
    if loss == "log_mse":  # v error = x0 error / sigma: back to the x0 error of each chunk
        err = torch.log(err * sig.pow(2) + log_floor)
    return (err * predicted).sum() / predicted.sum()
