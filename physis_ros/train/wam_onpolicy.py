"""On-policy episodes for a world-action model (a DAgger round): the model drives the task it
was trained on (metadata ``task``; push when it names none) in the closed loop
(``physis_ros.eval.closed_loop``), and the expert takes over now and then
(``Takeovers``). Each episode is kept as training data: the rows the model commanded are
known history, never a target; the expert's rows from the states the model's own actions
led to are the targets. An expert-only dataset never shows those states, and a model trained
on it alone compounds its small errors in the loop.

Episodes alternate the two served timelines by seed parity (no delay, and 150 ms: three
control periods of rows committed while the answer is on its way). Seeds are training seeds:
never the held-out closed-loop seeds nor the validation seeds.

``workers`` processes drive the seeds between them, one torch thread each: a batch-of-one
model step is too small for two threads to help (16 episodes on the 2-core development
machine: 22.5 s in one process with two threads, 19.1 s with one, 11.7 s in two workers).
They hand their episodes back as .npz files (arrays only, never pickle).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from tqdm import tqdm

from physis_ros.contract.safetensors import read_metadata
from physis_ros.engine.threads import local_engine
from physis_ros.eval.closed_loop import ClosedLoopConfig, ModelDecider, Takeovers, run_episode
from physis_ros.sim.base import Episode
from physis_ros.sim.episodes import load_episodes, save_episodes
from physis_ros.train.train import _sha256
from physis_ros.train.wam_data import DATA_VERSION, cached_episodes
from physis_ros.weights import engine_kwargs, min_committed_ms, trained_known_rows_ahead

DELAYS_MS = (0.0, 150.0)
AFTER_GOAL_S = 1.0
"""Kept after the goal was reached, as in the expert's episodes."""


def on_policy_episodes(
    weights: str | Path,
    seeds: list[int],
    *,
    cache_dir: Path | None,
    progress: bool = True,
    workers: int = 1,
) -> list[Episode]:
    """Episodes of ``seeds`` driven by the model in ``weights`` with expert takeovers (cached
    under ``cache_dir`` by the weights' hash and the seeds; the same, up to float rounding,
    however many ``workers`` drove them)."""
    takeovers = (Takeovers.MODEL_S, Takeovers.EXPERT_S)
    key_src = [DATA_VERSION, _sha256(str(weights)), seeds, DELAYS_MS, takeovers, AFTER_GOAL_S]
    key = hashlib.sha256(json.dumps(key_src).encode()).hexdigest()[:12]
    path = None if cache_dir is None else Path(cache_dir) / f"on_policy_{key}.npz"
    return cached_episodes(path, lambda: _drive_in_workers(weights, seeds, workers, progress))


def _drive_in_workers(
    weights: str | Path, seeds: list[int], workers: int, progress: bool
) -> list[Episode]:
    workers = min(workers, len(seeds))
    if workers <= 1:
        return _drive(weights, seeds, progress)
    with tempfile.TemporaryDirectory(prefix="physis_on_policy_") as tmp:
        parts = [Path(tmp) / f"part{w}.npz" for w in range(workers)]
        procs = [
            subprocess.Popen(
                [sys.executable, "-m", __name__, str(weights), str(parts[w])]
                + [str(s) for s in seeds[w::workers]]
                + ([] if progress and w == 0 else ["--quiet"])
            )
            for w in range(workers)
        ]
        try:
            failed = [w for w, proc in enumerate(procs) if proc.wait() != 0]
        finally:  # interrupted (Ctrl-C, an error): no worker outlives the run
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
        if failed:
            raise RuntimeError(f"on-policy workers {failed} of {workers} failed (see above)")
        driven = {ep.setup.seed: ep for part in parts for ep in load_episodes(part)}
    return [driven[s] for s in seeds]


def _drive(weights: str | Path, seeds: list[int], progress: bool) -> list[Episode]:
    meta = read_metadata(weights)
    kwargs = engine_kwargs(weights)
    episodes = []
    with local_engine(**kwargs) as engine:
        decider = ModelDecider(engine, meta=meta)
        bar = tqdm(seeds, desc="on-policy episodes", unit="ep", disable=not progress)
        for seed in bar:
            cfg = ClosedLoopConfig(
                task=meta.get("task", "push"),
                episodes=1,
                seed0=seed,
                delay_ms=DELAYS_MS[seed % len(DELAYS_MS)],
                context_chunks=min(3, kwargs["window"]),
                max_known_rows_ahead=trained_known_rows_ahead(meta),
                min_committed_ms=min_committed_ms(meta),
                after_goal_s=AFTER_GOAL_S,
            )
            result = run_episode(cfg, seed, decider, takeovers=Takeovers(seed, cfg.time_limit_s))
            episodes.append(result.record)
    return episodes


def main(argv: list[str] | None = None) -> None:
    """One worker of ``_drive_in_workers``: drives its seeds and saves them to OUT."""
    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("weights")
    ap.add_argument("out")
    ap.add_argument("seeds", type=int, nargs="+")
    ap.add_argument("--quiet", action="store_true")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    save_episodes(args.out, _drive(args.weights, args.seeds, progress=not args.quiet))


if __name__ == "__main__":
    main()
