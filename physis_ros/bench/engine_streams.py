"""What both engine benchmarks (``physis-bench engine``, in-process and ``--ranks N``) run and
read: the streams' plans (an observation at chunk 0 and one in the middle, C generated chunks
each), and the steady-state figures read from their outputs."""

from __future__ import annotations

import argparse
import itertools
from collections.abc import Callable, Mapping

import numpy as np
import torch

from physis_ros.engine.codec import Codec
from physis_ros.engine.config import ModelConfig
from physis_ros.engine.sampler import pack_chunk


def stream_plans(cfg: ModelConfig, args: argparse.Namespace, codec: Codec) -> dict[int, list]:
    """Per stream (``args.streams``): [("context", x), ("generate", None) x C with a second
    observation halfway], observations of random frames seeded by ``args.seed``."""
    rng = np.random.default_rng(args.seed)
    h, w = cfg.image_size

    def obs() -> tuple[str, torch.Tensor]:
        frames = rng.integers(0, 256, (cfg.frames_per_chunk, h, w, 3), dtype=np.uint8)
        return ("context", pack_chunk(cfg, codec.encode(frames).cpu()))

    plans = {}
    for s in range(args.streams):
        plan = [obs()]
        for c in range(args.chunks):
            if c == args.chunks // 2:
                plan.append(obs())  # a mid-stream observation: measures response latency
            plan.append(("generate", None))
        plans[s] = plan
    return plans


def _elapsed_ms(t0: float, t1: float) -> float:
    return (t1 - t0) * 1e3


def steady_state_ms(
    plans: dict[int, list],
    outputs: Mapping[int, Mapping[int, object]],
    entered_s: Mapping[int, Mapping[int, float]],
    skip: int,
    span_ms: Callable[[float, float], float] = _elapsed_ms,
) -> tuple[list[float], list[float], list[float]]:
    """(gaps, fills, responses) in ms over every stream: the gaps between consecutive
    generated outputs after ``skip`` (none spanning an observation), each stream's first
    output's time in the pipeline, and each later observation's entry to the first output
    after it. ``outputs[s][c]`` has ``created_s`` and ``left_s``; ``entered_s[s][c]``: when
    observation c entered; ``span_ms(t0, t1)`` measures a span (the in-process bench cuts its
    own pauses out)."""
    gaps, fills, responses = [], [], []
    for s, plan in plans.items():
        res = outputs[s]
        gen = [c for c, (kind, _) in enumerate(plan) if kind == "generate"]
        ctx = [c for c, (kind, _) in enumerate(plan) if kind == "context"]
        fills.append(span_ms(res[gen[0]].created_s, res[gen[0]].left_s))
        for a, b in itertools.pairwise(gen[skip:]):
            if b == a + 1:  # no observation in between
                gaps.append(span_ms(res[a].left_s, res[b].left_s))
        for c in ctx[1:]:
            after = [g for g in gen if g > c]
            if after:
                responses.append(span_ms(entered_s[s][c], res[after[0]].left_s))
    return gaps, fills, responses
