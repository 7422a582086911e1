"""Test helper: random stream plans (observed context chunks, then generated chunks),
running them on an engine that takes raw chunk states (the engine core over ranks, a pool
gate over it), and comparing what came back with the oracle."""

from __future__ import annotations

import random
import time

import torch

from physis_ros.engine.build import build_model
from physis_ros.engine.config import ModelConfig
from physis_ros.engine.forward import make_cond
from physis_ros.engine.oracle import sample_noisy
from physis_ros.engine.sampler import chunk_numel


def random_plan(cfg: ModelConfig, seed: int, chunks: int, context_at: tuple[int, ...] = (0,)):
    """[(kind, x)]: a random context chunk at each index of ``context_at``, else generate."""
    gen = torch.Generator().manual_seed(1000 + seed)
    return [
        ("context", torch.randn(chunk_numel(cfg), generator=gen) * 0.5)
        if c in context_at
        else ("generate", None)
        for c in range(chunks)
    ]


def tiny_cond(seed: int, cfg: ModelConfig | None = None):
    """A random prompt embedding [text_len, text_dim] (numpy) for StreamSpec.prompt_embedding."""
    from physis_ros.engine.config import get_preset

    return make_cond(cfg or get_preset("tiny"), seed).numpy()


def live_skeleton(seed: int, *, horizon: int, observations: int) -> list[tuple]:
    """A served stream's timeline (DESIGN.md §3) as ("observe", slot) / ("generate",) items:
    observe slot 0, then item by item either observe the next slot (replacing its prediction,
    or a new slot when generation fell behind) or generate the next slot within the horizon;
    ends with ``observations`` observed slots and generation up to the horizon. Seeded."""
    rng = random.Random(1234 + seed)
    items: list[tuple] = [("observe", 0)]
    newest, next_slot = 0, 1
    while newest < observations - 1 or next_slot - newest < horizon:
        can_generate = next_slot - newest < horizon
        if can_generate and (newest == observations - 1 or rng.random() < 0.6):
            items.append(("generate",))
            next_slot += 1
        else:
            newest += 1
            items.append(("observe", newest))
            next_slot = max(next_slot, newest + 1)
    return items


def rollout_skeleton(seed: int, *, horizon: int, observations: int) -> list[tuple]:
    """A served stream with rollouts (DESIGN.md §3.1): each observed slot, then slots
    o+1..o+h generated again from it, as ("observe", slot) / ("generate", slot) items; now and
    then the next observation comes before its rollout is complete (a busy engine), or skips
    a slot. Seeded."""
    rng = random.Random(4321 + seed)
    items: list[tuple] = []
    newest = -1
    while newest < observations - 1:
        newest += 2 if newest >= 0 and rng.random() < 0.15 else 1
        items.append(("observe", newest))
        last = horizon if newest == observations - 1 else rng.choice([horizon] * 4 + [1])
        items.extend(("generate", newest + j) for j in range(1, last + 1))
    return items


def live_random_plan(
    cfg: ModelConfig, seed: int, *, horizon: int, observations: int = 6, rollouts: bool = False
):
    """``live_skeleton`` (``rollout_skeleton`` with ``rollouts``) with random observed
    chunks: an ``oracle.Plan``."""
    gen = torch.Generator().manual_seed(1000 + seed)
    skeleton = rollout_skeleton if rollouts else live_skeleton
    return [
        ("observe", item[1], torch.randn(chunk_numel(cfg), generator=gen) * 0.5)
        if item[0] == "observe"
        else ("generate", None, *item[1:])
        for item in skeleton(seed, horizon=horizon, observations=observations)
    ]


def run_live_plans(engine, plans: dict, timeout_s: float = 90.0, seed: int = 0) -> tuple:
    """Submit the plans item by item, a random stream at a time, polling 0-3 ms between
    items, so observations arrive while earlier chunks are in flight. Returns (sid -> (slot,
    anchor) -> x, items submitted while the engine still owed results)."""
    rng = random.Random(seed)
    todo = {sid: list(plan) for sid, plan in plans.items()}
    expected = sum(1 for plan in plans.values() for item in plan if item[0] == "generate")
    got: dict[int, dict[tuple[int, int], torch.Tensor]] = {sid: {} for sid in plans}
    mid_flight = submitted_gen = 0
    deadline = time.monotonic() + timeout_s
    while sum(map(len, got.values())) < expected:
        assert time.monotonic() < deadline, f"{sum(map(len, got.values()))} of {expected} back"
        live = [sid for sid, items in todo.items() if items]
        if live:
            sid = rng.choice(live)
            item = todo[sid].pop(0)
            mid_flight += submitted_gen > sum(map(len, got.values()))
            if item[0] == "observe":
                engine.submit_context_x(sid, item[2], slot=item[1])
            else:
                engine.submit_generate(sid, slot=item[2] if len(item) > 2 else None)
                submitted_gen += 1
        for res in engine.poll_results(rng.random() * 0.003 if live else 0.1):
            assert (res.chunk, res.anchor) not in got[res.stream_id], "a version came twice"
            got[res.stream_id][res.chunk, res.anchor] = res.x.cpu()
    return got, mid_flight


def run_plans(engine, plans: dict, timeout_s: float = 90.0) -> dict[int, dict[int, torch.Tensor]]:
    """Submit every plan at once (so streams are in flight together); sid -> chunk -> x."""
    expected = 0
    for sid, plan in plans.items():
        for kind, val in plan:
            if kind == "context":
                engine.submit_context_x(sid, val)
            else:
                engine.submit_generate(sid)
                expected += 1
    got: dict[int, dict[int, torch.Tensor]] = {sid: {} for sid in plans}
    deadline = time.monotonic() + timeout_s
    while sum(map(len, got.values())) < expected:
        assert time.monotonic() < deadline, f"{sum(map(len, got.values()))} of {expected} back"
        for res in engine.poll_results(0.1):
            got[res.stream_id][res.chunk] = res.x.cpu()
    return got


def worst_oracle_error(
    cfg, plans: dict, specs: dict, got: dict, device: str = "cpu", *, by_anchor: bool = False
) -> float:
    """Max |streamed - oracle| over every chunk of every stream; ``cfg`` a RuntimeConfig (the
    weights seed and sampler the engine ran with), ``specs`` sid -> StreamSpec; ``got`` sid
    -> slot -> x, or with ``by_anchor`` sid -> (slot, anchor) -> x."""
    model = build_model(cfg.model_config, seed=cfg.weights_seed, device=device)
    worst = 0.0
    for sid, plan in plans.items():
        cond = torch.from_numpy(specs[sid].prompt_embedding)
        ref = sample_noisy(
            model, cfg.sampler_config, plan, seed=specs[sid].seed, cond=cond, by_anchor=by_anchor
        )
        assert sorted(got[sid]) == sorted(ref)
        for c, x in ref.items():
            worst = max(worst, (got[sid][c] - x.cpu()).abs().max().item())
    return worst


def observed_plan(cfg: ModelConfig, seed: int, pairs: int):
    """[(kind, value)]: ``pairs`` times an observation (random camera frames and commanded
    actions, encoded by the codec into a context chunk's state) then a generate request
    (with those actions when the model is conditioned on them)."""
    from physis_ros.engine.codec import Codec
    from physis_ros.engine.sampler import pack_chunk

    codec = Codec(cfg, device="cpu")
    gen = torch.Generator().manual_seed(2000 + seed)
    plan = []
    for _ in range(pairs):
        frames = torch.randint(0, 256, (cfg.frames_per_chunk, *cfg.image_size, 3), generator=gen)
        actions = None
        if cfg.action_mode != "none":
            actions = torch.rand(cfg.action_horizon, cfg.action_dim, generator=gen) * 2 - 1
        latent = codec.encode(frames.to(torch.uint8).numpy()).cpu()
        plan.append(("context", pack_chunk(cfg, latent, actions)))
        plan.append(("generate", actions if cfg.action_mode == "condition" else None))
    return plan
