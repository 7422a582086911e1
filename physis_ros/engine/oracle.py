"""The offline samplers every executor is tested against (no KV cache, no stages).

``sample_noisy``: DESIGN.md §3 literally: for each step k one masked block-causal forward
over the whole sequence (context chunks at sigma 0, generated chunks at sigma_k), then the
Euler update of the generated chunks. ``sample_clean``: chunk c is denoised with the clean
chunks < c (observations and earlier clean outputs) as sigma-0 context, one masked forward
over the prefix per step: the Self-Forcing/CausVid baseline that ``sequential-clean`` runs.
"""

from __future__ import annotations

import torch

from physis_ros.engine.config import SamplerConfig
from physis_ros.engine.model import WanDiT, forward_sequence
from physis_ros.engine.sampler import initial_noise, sigmas

Plan = list[tuple[str, torch.Tensor | None]]
"""("context", packed x [X]) or ("generate", commanded actions [H, A] or None), in chunk order."""


def _initial(model: WanDiT, plan: Plan, seed: int) -> tuple[torch.Tensor, list[bool]]:
    xs, is_gen = [], []
    for c, (kind, val) in enumerate(plan):
        if kind == "context":
            xs.append(torch.as_tensor(val, dtype=torch.float32).cpu())
            is_gen.append(False)
        elif kind == "generate":
            xs.append(initial_noise(model.cfg, seed, c, val))
            is_gen.append(True)
        else:
            raise ValueError(f"plan item kind {kind!r} is not 'context' or 'generate'")
    return torch.stack(xs).to(model.device), is_gen


@torch.inference_mode()
def sample_noisy(
    model: WanDiT, sampler: SamplerConfig, plan: Plan, *, seed: int, cond: torch.Tensor
) -> dict[int, torch.Tensor]:
    """Full-sequence noisy-history sampling on prompt embedding ``cond`` [n, text_dim].
    Returns chunk -> x^(K) [X] for generated chunks."""
    x, is_gen = _initial(model, plan, seed)
    gen = torch.tensor(is_gen, device=x.device)
    sig = sigmas(sampler)
    for k in range(sampler.steps):
        s = torch.where(gen, torch.tensor(sig[k]), torch.tensor(0.0)).to(x.device)
        v = forward_sequence(model, x, s, cond, window=sampler.window)
        x = torch.where(gen[:, None], x + (sig[k + 1] - sig[k]) * v, x)
    return {c: x[c] for c in range(len(plan)) if is_gen[c]}


@torch.inference_mode()
def sample_clean(
    model: WanDiT, sampler: SamplerConfig, plan: Plan, *, seed: int, cond: torch.Tensor
) -> dict[int, torch.Tensor]:
    """Clean-history sampling, chunk by chunk. Returns chunk -> x^(K) for generated chunks."""
    x0, is_gen = _initial(model, plan, seed)
    sig = sigmas(sampler)
    clean: list[torch.Tensor] = []
    out = {}
    for c in range(len(plan)):
        xc = x0[c]
        if is_gen[c]:
            for k in range(sampler.steps):
                seq = torch.stack([*clean, xc])
                s = torch.zeros(c + 1, device=seq.device)
                s[c] = sig[k]
                v = forward_sequence(model, seq, s, cond, window=sampler.window)[c]
                xc = xc + (sig[k + 1] - sig[k]) * v
            out[c] = xc
        clean.append(xc)
    return out


def sample(
    model: WanDiT, sampler: SamplerConfig, plan: Plan, *, mode: str, seed: int, cond: torch.Tensor
) -> dict[int, torch.Tensor]:
    """The oracle of executor ``mode``."""
    fn = sample_clean if mode == "sequential-clean" else sample_noisy
    return fn(model, sampler, plan, seed=seed, cond=cond)
