"""The loss a world-action model trains on (``physis-train-wam``): each window's prompt, the
noise levels of the served sampler, and the velocity MSE of video, action rows and state
values over what counts (``wam_loss``). The windows: ``physis_ros.train.wam_data``."""

from __future__ import annotations

import torch

from physis_ros.contract.model import PromptSpec, prompt_features
from physis_ros.engine.config import SamplerConfig
from physis_ros.engine.forward import forward_sequence, make_cond, pad_text
from physis_ros.engine.sampler import chunk_layout, sigmas
from physis_ros.train.wam_data import WamBatch


def noise_levels(sample_steps: int, shift: float) -> torch.Tensor:
    """The noise levels of the ``sample_steps``-step sampler at ``shift`` (the last, 0, left
    out): the levels a generated chunk is trained at."""
    return torch.tensor(
        sigmas(SamplerConfig(steps=sample_steps, shift=shift))[:-1], dtype=torch.float32
    )


def window_cond(mcfg, prompt: PromptSpec, values: torch.Tensor) -> torch.Tensor:
    """[B, text_len, text_dim]: each window's prompt (made of its task values ``values``
    [B, P] as ``prompt`` says, or the fixed stand-in)."""
    if prompt.kind == "none":
        return make_cond(mcfg, 0).expand(len(values), -1, -1)
    tokens = [
        torch.from_numpy(prompt_features(v.tolist(), prompt.scale, mcfg.text_dim)) for v in values
    ]
    return pad_text(mcfg, torch.stack(tokens))


def wam_loss(
    model,
    batch: WamBatch,
    *,
    sigma: torch.Tensor,
    eps: torch.Tensor,
    cond: torch.Tensor,
    window: int,
    action_weight: float,
    state_weight: float,
) -> tuple[torch.Tensor, dict[str, float]]:
    """sigma [B] (one per window), eps [B, C, denoised] noise. Returns the loss and its parts
    (velocity MSE of video, action rows, state values over what counts)."""
    cfg = model.cfg
    lay = chunk_layout(cfg)
    x0 = batch.x0
    b, c, _ = x0.shape
    h, a = cfg.action_horizon, cfg.action_dim
    gen = torch.arange(c)[None, :] >= batch.n_obs[:, None]  # [B, C]
    sig = torch.where(gen, sigma[:, None], torch.zeros(()))
    d = lay.denoised
    x_in = x0.clone()
    noised = (1 - sig[..., None]) * x0[..., :d] + sig[..., None] * eps
    x_in[..., :d] = torch.where(gen[..., None], noised, x0[..., :d])
    # known rows stay clean; an observed chunk's unknown rows are 0, as pack_chunk sends them
    rows_in = x_in[..., lay.actions].view(b, c, h, a)
    rows0 = x0[..., lay.actions].view(b, c, h, a)
    unknown_obs = ~gen[..., None] & ~batch.known
    rows_in = torch.where(batch.known[..., None], rows0, rows_in)
    rows_in = torch.where(unknown_obs[..., None], torch.zeros(()), rows_in)
    x_in[..., lay.actions] = rows_in.reshape(b, c, h * a)
    v = forward_sequence(model, x_in, sig, cond, window=window)
    err = (v[..., :d] - (eps - x0[..., :d])).pow(2)
    chunk_mask = (gen & batch.trained_chunks).float()
    video = (err[..., lay.video].mean(-1) * chunk_mask).sum() / chunk_mask.sum().clamp_min(1)
    state = (err[..., lay.state].mean(-1) * chunk_mask).sum() / chunk_mask.sum().clamp_min(1)
    rows = err[..., lay.actions].view(b, c, h, a).mean(-1)
    row_mask = batch.trained_rows.float()
    action = (rows * row_mask).sum() / row_mask.sum().clamp_min(1)
    loss = video + action_weight * action + state_weight * state
    return loss, {"video": video.item(), "action": action.item(), "state": state.item()}
