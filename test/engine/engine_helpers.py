"""Plans and comparisons shared by the engine tests."""

from __future__ import annotations

import torch

from physis_ros.engine import oracle
from physis_ros.engine.config import SamplerConfig
from physis_ros.engine.forward import make_cond
from physis_ros.engine.pipeline import run_plan
from physis_ros.engine.sampler import chunk_numel
from physis_ros.engine.threads import InProcRuntime

SAMPLER = SamplerConfig(steps=3, window=2)
"""K=3, W=2: with 7 chunks the KV rings wrap around."""
TOL = 1e-5


def context_x(model, seed: int) -> torch.Tensor:
    """A packed observation chunk with values in the latent range."""
    gen = torch.Generator().manual_seed(seed)
    return torch.rand(chunk_numel(model.cfg), generator=gen) * 2 - 1


def actions(model, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(model.cfg.action_horizon, model.cfg.action_dim, generator=gen)


def plan_for(model, stream: int, *, with_actions: bool = False) -> list:
    """Observation, 3 generated chunks, observation, 2 generated (7 chunks)."""

    def gen(i: int):
        return ("generate", actions(model, 1000 * stream + i) if with_actions else None)

    return [
        ("context", context_x(model, 10 * stream)),
        gen(1),
        gen(2),
        gen(3),
        ("context", context_x(model, 10 * stream + 1)),
        gen(5),
        gen(6),
    ]


def run_and_compare(
    model,
    layout,
    *,
    mode: str,
    batching: bool,
    streams: int = 1,
    with_actions: bool = False,
    threads: bool = False,
    sampler=SAMPLER,
    max_in_flight: int = 0,
) -> float:
    """Max abs diff over every generated chunk of every stream against the mode's oracle."""
    rt = InProcRuntime(model, sampler, layout, batching=batching)
    plans = {s: plan_for(model, s, with_actions=with_actions) for s in range(streams)}
    out = run_plan(
        rt,
        plans,
        mode=mode,
        threads=threads,
        max_in_flight=max_in_flight,
        seeds={s: 7 + s for s in plans},
        conds={s: make_cond(model.cfg, 70 + s) for s in plans},
    )
    worst = 0.0
    for s, plan in plans.items():
        ref = oracle.sample(
            model, sampler, plan, mode=mode, seed=7 + s, cond=make_cond(model.cfg, 70 + s)
        )
        assert sorted(out[s]) == sorted(ref), (
            f"stream {s}: chunks {sorted(out[s])} != {sorted(ref)}"
        )
        for c, x in ref.items():
            worst = max(worst, (out[s][c].x - x).abs().max().item())
    assert all(not w.stats.drops for w in rt.workers), [w.stats.drops for w in rt.workers]
    return worst
