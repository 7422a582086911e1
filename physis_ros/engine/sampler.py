"""The flow-matching schedule, seeded initial noise, and the packed chunk layout.

A chunk's state x is one flat float32 vector: the latent as video tokens [Nv, C*pt*ph*pw]
(token order (t, h, w) of the grid, feature order (c, pt, ph, pw)) followed by the action
values [H, A] when the model has actions. In ``predict`` mode the action values are state
(noised and denoised); in ``condition`` mode they are the commanded actions (never updated).
A predict-mode model may also carry state values [F, S] (proprioception per frame: observed
in context chunks, denoised in generated ones) and a flag per action row (1: the row is known
— reported by the robot in a context chunk, committed in a generated one — and clean; 0: it
is generated). Actions and states enter normalised by the config's centre and scale; pack and
unpack convert. A row of NaN in the actions given for such a model means "not known". An
``anchor_residual`` model's chunk ends with its anchor: the newest observed latent frame as
video tokens, which a generated chunk's x0 estimate starts from (zeros in observed chunks).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from physis_ros.engine.config import ModelConfig, SamplerConfig


@dataclass(frozen=True)
class ChunkLayout:
    """Where each part sits in a packed chunk state x [X] (``pack_chunk``)."""

    video: slice
    actions: slice
    """[H, A] action values (empty without actions)."""
    state: slice
    """[F, S] state values (empty without them)."""
    known: slice
    """[H] action-row flags (empty without committed actions)."""
    anchor: slice
    """[Nv, P] the newest observed latent frame as video tokens (``anchor_residual``; zeros
    in observed chunks)."""
    denoised: int
    """Values x[:denoised] are the generated part (the rest is conditioning)."""


def chunk_layout(cfg: ModelConfig) -> ChunkLayout:
    nvp = cfg.video_tokens * cfg.patch_dim
    na = cfg.action_horizon * cfg.action_dim if cfg.action_mode != "none" else 0
    ns = cfg.state_tokens * cfg.state_dim
    nk = cfg.action_horizon if cfg.committed_actions else 0
    a_end, s_end = nvp + na, nvp + na + ns
    k_end = s_end + nk
    return ChunkLayout(
        video=slice(0, nvp),
        actions=slice(nvp, a_end),
        state=slice(a_end, s_end),
        known=slice(s_end, k_end),
        anchor=slice(k_end, k_end + (nvp if cfg.anchor_residual else 0)),
        denoised=s_end if cfg.action_mode == "predict" else nvp,
    )


def chunk_numel(cfg: ModelConfig) -> int:
    """X: values in a packed chunk state (video tokens ++ action values ++ state values ++
    action-row flags ++ anchor tokens, as the config has them)."""
    return chunk_layout(cfg).anchor.stop


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
    """Values of x that are denoised (video tokens, plus action and state values in predict
    mode)."""
    return chunk_layout(cfg).denoised


def anchor_tokens(cfg: ModelConfig, observed: torch.Tensor | None) -> torch.Tensor:
    """The anchor of a chunk generated after the observed chunk ``observed`` [..., X]: its
    newest latent frame repeated over a chunk's latent frames, as video tokens [..., Nv*P]
    (copying the last frame, in latent space). None (no observation yet): zeros [Nv*P]."""
    nvp = cfg.video_tokens * cfg.patch_dim
    if observed is None:
        return torch.zeros(nvp)
    gt, gh, gw = cfg.grid
    pt, ph, pw = cfg.patch
    lead = observed.shape[:-1]
    video = observed[..., :nvp].reshape(*lead, gt, gh, gw, cfg.in_channels, pt, ph, pw)
    last = video[..., -1:, :, :, :, -1:, :, :]  # latent frame T-1: grid frame gt-1, pt-1
    return last.expand_as(video).reshape(*lead, nvp).clone()


def initial_noise(
    cfg: ModelConfig,
    stream_seed: int,
    chunk: int,
    actions: torch.Tensor | None = None,
    anchor: torch.Tensor | None = None,
) -> torch.Tensor:
    """x^(0) of a generated chunk, [X] float32 on the CPU (drawn on the CPU for every device).

    ``actions`` [H, A]: the commanded actions of a ``condition`` model (zeros if None); for a
    model with committed actions, the committed rows (NaN rows: generated), which replace the
    noise there (the noise drawn does not depend on them). ``anchor`` [X]: the newest observed
    chunk (``anchor_residual`` models; None: no observation yet)."""
    gen = torch.Generator().manual_seed(noise_seed(stream_seed, chunk))
    x = torch.randn(state_numel(cfg), generator=gen, dtype=torch.float32)
    if cfg.action_mode == "condition":
        x = torch.cat([x, _actions(cfg, actions)])
    elif cfg.committed_actions:
        values, known = _known_rows(cfg, actions)
        lay = chunk_layout(cfg)
        rows = x[lay.actions].view(cfg.action_horizon, cfg.action_dim)
        rows[known] = values[known]
        x = torch.cat([x, known.float()])
    elif actions is not None:
        raise ValueError(
            f"model {cfg.name} (action_mode {cfg.action_mode!r}) takes no commanded actions"
        )
    if cfg.anchor_residual:
        x = torch.cat([x, anchor_tokens(cfg, None if anchor is None else anchor.cpu())])
    return x


def _check_shape(name: str, value, shape: tuple[int, int], model: str) -> torch.Tensor:
    value = torch.as_tensor(value, dtype=torch.float32)
    if tuple(value.shape) != shape:
        raise ValueError(f"{name} have shape {tuple(value.shape)}, model {model} needs {shape}")
    return value.cpu()


def _normalize(values: torch.Tensor, center: tuple, scale: tuple) -> torch.Tensor:
    if center:
        values = values - torch.tensor(center, dtype=torch.float32)
    if scale:
        values = values / torch.tensor(scale, dtype=torch.float32)
    return values


def _denormalize(values: torch.Tensor, center: tuple, scale: tuple) -> torch.Tensor:
    if scale:
        values = values * torch.tensor(scale, dtype=torch.float32, device=values.device)
    if center:
        values = values + torch.tensor(center, dtype=torch.float32, device=values.device)
    return values


def _known_rows(cfg: ModelConfig, actions) -> tuple[torch.Tensor, torch.Tensor]:
    """(normalised rows [H, A] with 0 where unknown, known [H] bool) of actions whose unknown
    rows are NaN (None: none known)."""
    shape = (cfg.action_horizon, cfg.action_dim)
    if actions is None:
        return torch.zeros(shape), torch.zeros(shape[0], dtype=torch.bool)
    actions = _check_shape("actions", actions, shape, cfg.name)
    nan = torch.isnan(actions)
    known = ~nan.any(-1)
    if (nan.any(-1) != nan.all(-1)).any():
        raise ValueError("a row of actions is partly NaN (a whole row of NaN means unknown)")
    if torch.isinf(actions).any():
        raise ValueError("actions contain inf")
    values = _normalize(torch.where(nan, 0.0, actions), cfg.action_center, cfg.action_scale)
    return torch.where(known[:, None], values, 0.0), known


def _actions(cfg: ModelConfig, actions: torch.Tensor | None) -> torch.Tensor:
    shape = (cfg.action_horizon, cfg.action_dim)
    if actions is None:
        return torch.zeros(shape[0] * shape[1])
    actions = _check_shape("actions", actions, shape, cfg.name)
    if not torch.isfinite(actions).all():
        raise ValueError("actions contain NaN or inf")
    return _normalize(actions, cfg.action_center, cfg.action_scale).reshape(-1)


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
    cfg: ModelConfig,
    latent: torch.Tensor,
    actions: torch.Tensor | None = None,
    state: torch.Tensor | None = None,
) -> torch.Tensor:
    """latent [C, T, h, w] (+ actions [H, A], + state [F, S]) -> x [X] float32: an observed
    chunk. A model with committed actions takes unknown rows as NaN (flag 0)."""
    x = latent_to_tokens(cfg, latent.float()).reshape(-1)
    parts = [x]
    if cfg.committed_actions:
        values, known = _known_rows(cfg, actions)
        parts.append(values.reshape(-1))
    elif cfg.action_mode != "none":
        parts.append(_actions(cfg, actions))
    elif actions is not None:
        raise ValueError(f"model {cfg.name} has no actions")
    if cfg.state_dim:
        if state is None:
            raise ValueError(f"model {cfg.name} needs the state [F, S] of each observed frame")
        shape = (cfg.state_tokens, cfg.state_dim)
        state = _check_shape("state values", state, shape, cfg.name)
        if not torch.isfinite(state).all():
            raise ValueError("state values contain NaN or inf")
        parts.append(_normalize(state, cfg.state_center, cfg.state_scale).reshape(-1))
    elif state is not None:
        raise ValueError(f"model {cfg.name} takes no state values")
    if cfg.committed_actions:
        parts.append(known.float())
    if cfg.anchor_residual:  # an observed chunk has no anchor: it is never denoised
        parts.append(torch.zeros(cfg.video_tokens * cfg.patch_dim))
    return torch.cat([p.to(x.device) for p in parts])


def unpack_chunk(cfg: ModelConfig, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x [X] -> (latent [C, T, h, w], actions [H, A] in the robot's units, or None)."""
    if x.numel() != chunk_numel(cfg):
        raise ValueError(f"chunk has {x.numel()} values, model {cfg.name} needs {chunk_numel(cfg)}")
    lay = chunk_layout(cfg)
    latent = tokens_to_latent(cfg, x[lay.video].reshape(cfg.video_tokens, cfg.patch_dim))
    if cfg.action_mode == "none":
        return latent, None
    actions = x[lay.actions].reshape(cfg.action_horizon, cfg.action_dim)
    return latent, _denormalize(actions, cfg.action_center, cfg.action_scale)


def unpack_state(cfg: ModelConfig, x: torch.Tensor) -> torch.Tensor | None:
    """x [X] -> the state values [F, S] in the robot's units (None: the model has none)."""
    if not cfg.state_dim:
        return None
    values = x[chunk_layout(cfg).state].reshape(cfg.state_tokens, cfg.state_dim)
    return _denormalize(values, cfg.state_center, cfg.state_scale)


def request_actions(cfg: ModelConfig, actions, *, context: bool) -> torch.Tensor | None:
    """Checks the actions an engine caller passes (numpy or torch, [H, A]) and returns them
    as a CPU tensor. Observed chunks take actions when the model has any; generate requests
    take them for a ``condition`` model (commanded) and a model with committed actions (NaN
    rows: generated)."""
    if actions is None:
        return None
    allowed = (
        cfg.action_mode != "none"
        if context
        else (cfg.action_mode == "condition" or cfg.committed_actions)
    )
    if not allowed:
        raise ValueError(
            f"model {cfg.name} (action_mode {cfg.action_mode!r}) takes no "
            + (
                "actions with observations"
                if context
                else "commanded actions with generate requests"
            )
        )
    arr = torch.as_tensor(np.asarray(actions, dtype=np.float32)).clone()
    shape = (cfg.action_horizon, cfg.action_dim)
    if tuple(arr.shape) != shape:
        raise ValueError(f"actions have shape {tuple(arr.shape)}, model {cfg.name} needs {shape}")
    if cfg.committed_actions:
        _known_rows(cfg, arr)  # NaN rows allowed, partial rows and inf are not
    elif not torch.isfinite(arr).all():
        raise ValueError("actions contain NaN or inf")
    return arr


def request_state(cfg: ModelConfig, state) -> torch.Tensor | None:
    """Checks an observed chunk's state values [F', S] (F' <= frames per chunk; the newest
    row is repeated to fill, as the codec does with frames)."""
    if state is None:
        if cfg.state_dim:
            raise ValueError(f"model {cfg.name} needs the state [F, S] of each observed frame")
        return None
    if not cfg.state_dim:
        raise ValueError(f"model {cfg.name} takes no state values")
    arr = torch.as_tensor(np.asarray(state, dtype=np.float32)).clone()
    f = cfg.state_tokens
    if arr.dim() != 2 or arr.shape[1] != cfg.state_dim or not 1 <= arr.shape[0] <= f:
        raise ValueError(
            f"state values have shape {tuple(arr.shape)}, model {cfg.name} needs "
            f"[F<={f}, {cfg.state_dim}]"
        )
    if not torch.isfinite(arr).all():
        raise ValueError("state values contain NaN or inf")
    if arr.shape[0] < f:
        arr = torch.cat([arr, arr[-1:].expand(f - arr.shape[0], -1)])
    return arr
