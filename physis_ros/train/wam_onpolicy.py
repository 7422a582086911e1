"""On-policy episodes for push-wam (a DAgger round): the model drives the goal-push task in
the closed loop (``physis_ros.eval.closed_loop``), and the expert takes over now and then
(``Takeovers``). Each episode is kept as training data: the rows the model commanded are
known history, never a target; the expert's rows from the states the model's own actions
led to are the targets. An expert-only dataset never shows those states, and a model trained
on it alone compounds its small errors in the loop.

Episodes alternate the two served timelines (no delay, and 150 ms: three control periods of
rows committed while the answer is on its way). Seeds are training seeds: never the held-out
closed-loop seeds nor the validation seeds.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from physis_ros.sim.episodes import TaskEpisode
from physis_ros.train.train import _sha256
from physis_ros.train.wam_data import DATA_VERSION, cached_episodes

DELAYS_MS = (0.0, 150.0)
AFTER_GOAL_S = 1.0
"""Kept after the box reached the goal, as in the expert's episodes."""


def on_policy_episodes(
    weights: str | Path, seeds: list[int], *, cache_dir: Path | None, progress: bool = True
) -> list[TaskEpisode]:
    """Episodes of ``seeds`` driven by the model in ``weights`` with expert takeovers (cached
    under ``cache_dir`` by the weights' hash and the seeds)."""
    from physis_ros.eval.closed_loop import Takeovers

    takeovers = (Takeovers.MODEL_S, Takeovers.EXPERT_S)
    key_src = [DATA_VERSION, _sha256(str(weights)), seeds, DELAYS_MS, takeovers, AFTER_GOAL_S]
    key = hashlib.sha256(json.dumps(key_src).encode()).hexdigest()[:12]
    path = None if cache_dir is None else Path(cache_dir) / f"on_policy_{key}.npz"
    return cached_episodes(path, lambda: _drive(weights, seeds, progress))


def _drive(weights: str | Path, seeds: list[int], progress: bool) -> list[TaskEpisode]:
    from tqdm import tqdm

    from physis_ros.engine.local import LocalEngine
    from physis_ros.eval.closed_loop import ClosedLoopConfig, ModelDecider, Takeovers, run_episode
    from physis_ros.weights import engine_kwargs, read_metadata

    meta = read_metadata(weights)
    kwargs = engine_kwargs(weights)
    episodes = []
    with LocalEngine(**kwargs) as engine:
        decider = ModelDecider(engine, meta=meta)
        bar = tqdm(seeds, desc="on-policy episodes", unit="ep", disable=not progress)
        for seed in bar:
            cfg = ClosedLoopConfig(
                episodes=1,
                seed0=seed,
                delay_ms=DELAYS_MS[seed % len(DELAYS_MS)],
                context_chunks=min(3, kwargs["window"]),
                max_known_rows_ahead=int(meta.get("max_known_rows_ahead", 8)),
                after_goal_s=AFTER_GOAL_S,
            )
            result = run_episode(cfg, seed, decider, takeovers=Takeovers(seed, cfg.time_limit_s))
            episodes.append(result.record)
    return episodes
