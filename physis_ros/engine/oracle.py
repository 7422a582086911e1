"""The offline samplers every executor is tested against (no KV cache, no stages).

A stream is a list of items in the order they enter the pipeline (DESIGN.md §3, live streams):
``("context", x)`` an observation of the next new time slot, ``("observe", slot, x)`` an
observation of ``slot`` (which may replace a chunk generated for it), ``("generate", actions)``
a chunk generated for the next new slot, ``("generate", actions, slot)`` one for ``slot`` (a
slot after the newest observation, possibly generated before: a rollout from each
observation); x is a packed chunk state [X], actions [H, A] or None.
Every item is one *version* of its slot: its anchor is the newest observed slot before it (an
observation's anchor is its own slot), and it reads slots s-W..s-1 as their observed version
if s <= anchor and one came before it, else their newest generated version.

``sample_noisy``: for each step k one masked forward over ALL versions (observations at sigma 0
or noised to sigma_k, generated chunks at sigma_k; a version attends to itself and what it
reads), then the Euler update of the generated ones. ``sample_clean``: versions in order; a
generated one is denoised by K masked forwards over the versions before it (clean: outputs at
sigma 0) and itself: the Self-Forcing/CausVid baseline that ``sequential-clean`` runs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from physis_ros.engine.config import SamplerConfig
from physis_ros.engine.forward import forward_sequence
from physis_ros.engine.model import WanDiT
from physis_ros.engine.sampler import context_noise, initial_noise, noise_context, sigmas

Plan = list[tuple]
"""("context", x) | ("observe", slot, x) | ("generate", actions or None[, slot]), in release
order."""


@dataclass(frozen=True)
class Version:
    """One item of a stream: a slot's observed or generated version."""

    slot: int
    observed: bool
    anchor: int
    """Newest observed slot when it entered (-1: none yet); its own slot if observed."""
    reads: tuple[int, ...]
    """Indices (into the version list) of the versions it attends to besides itself."""
    value: torch.Tensor | None
    """Observed: the packed state x [X]; generated: the commanded actions [H, A] or None."""


def versions(plan: Plan, window: int) -> list[Version]:
    """The plan's versions with anchors and read sets; ValueError for an impossible plan (an
    observation out of slot order, or a slot read before any version of it exists)."""
    out: list[Version] = []
    observed: dict[int, int] = {}
    generated: dict[int, int] = {}
    next_slot, anchor = 0, -1
    for item in plan:
        kind = item[0]
        if kind == "context":
            slot, value, is_obs = next_slot, item[1], True
        elif kind == "observe":
            slot, value, is_obs = int(item[1]), item[2], True
        elif kind == "generate":
            slot, value, is_obs = next_slot if len(item) < 3 else int(item[2]), item[1], False
            if not anchor < slot <= next_slot:
                raise ValueError(f"generate slot {slot} after slot {anchor}, next {next_slot}")
        else:
            raise ValueError(f"plan item kind {kind!r} is not context, observe or generate")
        if is_obs:
            if not anchor < slot <= next_slot:
                raise ValueError(
                    f"observation of slot {slot} after slot {anchor}, next {next_slot}"
                )
            anchor = slot
        reads = []
        for s in range(max(0, slot - window), slot):
            idx = observed.get(s) if s <= anchor else None
            idx = generated.get(s) if idx is None else idx
            if idx is None:
                raise ValueError(f"slot {slot} reads slot {s}, which has no version yet")
            reads.append(idx)
        (observed if is_obs else generated)[slot] = len(out)
        out.append(Version(slot, is_obs, anchor, tuple(reads), value))
        next_slot = max(next_slot, slot + 1)
    return out


def _mask(vs: list[Version], device: torch.device) -> torch.Tensor:
    """[V, V] bool: version i attends version j."""
    m = torch.eye(len(vs), dtype=torch.bool)
    for i, v in enumerate(vs):
        m[i, list(v.reads)] = True
    return m.to(device)


def _initial(model: WanDiT, vs: list[Version], seed: int) -> torch.Tensor:
    observed = {
        v.slot: torch.as_tensor(v.value, dtype=torch.float32).cpu() for v in vs if v.observed
    }
    xs = [
        observed[v.slot]
        if v.observed
        else initial_noise(model.cfg, seed, v.slot, v.value, observed.get(v.anchor))
        for v in vs
    ]
    return torch.stack(xs).to(model.device)


@torch.inference_mode()
def sample_noisy(
    model: WanDiT,
    sampler: SamplerConfig,
    plan: Plan,
    *,
    seed: int,
    cond: torch.Tensor,
    previews: dict[tuple[int, int], torch.Tensor] | None = None,
    by_anchor: bool = False,
) -> dict:
    """Full-sequence noisy-history sampling on prompt embedding ``cond`` [n, text_dim].
    Returns slot -> x^(K) [X] of generated chunks (a slot generated more than once: its
    newest version), or with ``by_anchor`` (slot, anchor) -> x^(K) of every generated
    version. ``previews``: filled with (slot, k) -> the x0 estimate x^(k-1) - sigma_(k-1) v
    after step k < K of every generated chunk."""
    cfg = model.cfg
    vs = versions(plan, sampler.window)
    x = _initial(model, vs, seed)
    dev = x.device
    gen = torch.tensor([not v.observed for v in vs], device=dev)
    slots = torch.tensor([v.slot for v in vs], device=dev)
    mask = _mask(vs, dev)
    noised = sampler.context_noise == "noised"
    eps = {
        i: context_noise(cfg, seed, v.slot).to(dev)
        for i, v in enumerate(vs)
        if v.observed and noised
    }
    sig = sigmas(sampler)
    for k in range(sampler.steps):
        obs_sigma = sig[k] if noised else 0.0
        s = torch.where(gen, torch.tensor(sig[k]), torch.tensor(obs_sigma)).to(dev)
        x_in = x.clone()
        for i, e in eps.items():
            x_in[i] = noise_context(cfg, x[i], e, sig[k])
        v = forward_sequence(
            model, x_in, s, cond, window=sampler.window, slots=slots, chunk_mask=mask
        )
        if previews is not None and k + 1 < sampler.steps:
            for i, ver in enumerate(vs):
                if not ver.observed:
                    previews[ver.slot, k + 1] = x[i] - sig[k] * v[i]
        x = torch.where(gen[:, None], x + (sig[k + 1] - sig[k]) * v, x)
    if by_anchor:
        return {(v.slot, v.anchor): x[i] for i, v in enumerate(vs) if not v.observed}
    return {v.slot: x[i] for i, v in enumerate(vs) if not v.observed}


@torch.inference_mode()
def sample_clean(
    model: WanDiT, sampler: SamplerConfig, plan: Plan, *, seed: int, cond: torch.Tensor
) -> dict[int, torch.Tensor]:
    """Clean-history sampling, version by version, on prompt embedding ``cond``. Returns
    slot -> x^(K) of generated chunks."""
    if sampler.context_noise != "clean":
        raise ValueError("clean history takes observations clean (context_noise 'clean')")
    vs = versions(plan, sampler.window)
    x = _initial(model, vs, seed)
    dev = x.device
    slots = torch.tensor([v.slot for v in vs], device=dev)
    mask = _mask(vs, dev)
    sig = sigmas(sampler)
    out = {}
    for i, v in enumerate(vs):
        if v.observed:
            continue
        for k in range(sampler.steps):
            s = torch.zeros(i + 1, device=dev)
            s[i] = sig[k]
            vel = forward_sequence(
                model,
                x[: i + 1],
                s,
                cond,
                window=sampler.window,
                slots=slots[: i + 1],
                chunk_mask=mask[: i + 1, : i + 1],
            )[i]
            x[i] = x[i] + (sig[k + 1] - sig[k]) * vel
        out[v.slot] = x[i].clone()
    return out


def sample(
    model: WanDiT, sampler: SamplerConfig, plan: Plan, *, mode: str, seed: int, cond: torch.Tensor
) -> dict[int, torch.Tensor]:
    """The oracle of executor ``mode``."""
    fn = sample_clean if mode == "sequential-clean" else sample_noisy
    return fn(model, sampler, plan, seed=seed, cond=cond)
