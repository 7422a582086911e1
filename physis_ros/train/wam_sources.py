"""Where a world-action model's training episodes come from (``physis-train-wam``): the
simulated task's scripted expert (training seeds 0.., validation seeds from ``VAL_SEED0``)
with each DAgger round's on-policy episodes, or a robot's rosbag2 bags read through a mapping
file onto the model's contract (``--bags``, ``--mapping``; validation on ``--val-bags``, else
on every ``BAG_VAL_EVERY``-th episode, held out of training).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from physis_ros.contract.model import WamContract
from physis_ros.engine.config import get_preset
from physis_ros.train.bag_episodes import Timing, read_bags
from physis_ros.train.bag_mapping import load_mapping
from physis_ros.train.wam_data import episodes_for
from physis_ros.train.wam_onpolicy import on_policy_episodes

VAL_SEED0 = 20_000
"""Validation episodes' seeds start here; held-out evaluation uses 10000.. (physis-eval)."""
BAG_VAL_EVERY = 10
"""Without validation bags, every 10th bag episode validates (and is not trained on)."""


@dataclass
class TrainingData:
    train: list
    """Training episodes (``sim.base.Episode`` or ``bag_episodes.RecordedEpisode``)."""
    val: list
    log: dict = field(default_factory=dict)
    """What the run's log says of its data."""


def split_paths(paths: str) -> list[str]:
    """The comma-separated bag paths of ``--bags`` / ``--val-bags``."""
    return [p for p in paths.split(",") if p]


def training_data(cfg, contract: WamContract, cache: Path, progress: bool) -> TrainingData:
    """The training and validation episodes of ``cfg`` (a ``WamTrainConfig``)."""
    if cfg.bags:
        return _from_bags(cfg, contract, progress)
    return _from_task(cfg, cache, progress)


def _from_task(cfg, cache: Path, progress: bool) -> TrainingData:
    """The task's expert episodes, then each on-policy round's, and its validation episodes,
    generated or taken from ``cache``."""
    train_eps = episodes_for(
        list(range(cfg.episodes)), perturb=True, cache_dir=cache, task=cfg.task
    )
    n_on = cfg.on_policy_episodes
    for r, checkpoint in enumerate(cfg.on_policy_checkpoints):  # round r: seeds of its own
        seeds = list(range(r * n_on, (r + 1) * n_on))
        train_eps += on_policy_episodes(
            checkpoint, seeds, cache_dir=cache, progress=progress, workers=cfg.threads
        )
    val_seeds = list(range(VAL_SEED0, VAL_SEED0 + cfg.val_episodes))
    val_eps = episodes_for(
        val_seeds, perturb=True, cache_dir=cache, progress=progress, task=cfg.task
    )
    success = float(np.mean([ep.reached_s is not None for ep in train_eps]))
    return TrainingData(train_eps, val_eps, {"expert_success_train": success})


def _from_bags(cfg, contract: WamContract, progress: bool) -> TrainingData:
    """The bags' episodes through the mapping; what could not be used is said on stderr."""
    mapping = load_mapping(cfg.mapping)
    mcfg = get_preset(cfg.model)
    timing = Timing(
        frame_hz=contract.frame_hz,
        rows_per_frame=round(contract.action_hz / contract.frame_hz),
        min_frames=cfg.chunks * mcfg.frames_per_chunk,
    )
    read = dict(image_size=mcfg.image_size, progress=progress)
    train, report = read_bags(split_paths(cfg.bags), mapping, contract, timing, **read)
    _say("", report.lines())
    log = {"bags": report.as_dict()}
    if cfg.val_bags:
        val, val_report = read_bags(split_paths(cfg.val_bags), mapping, contract, timing, **read)
        _say("validation ", val_report.lines())
        log.update(val_bags=val_report.as_dict(), validation="the validation bags")
    elif len(train) >= 2:
        held = set(range(BAG_VAL_EVERY - 1, len(train), BAG_VAL_EVERY)) or {len(train) - 1}
        val = [ep for i, ep in enumerate(train) if i in held]
        train = [ep for i, ep in enumerate(train) if i not in held]
        log["validation"] = f"{len(val)} of the bags' episodes, held out of training"
    else:
        val = train
        log["validation"] = "the one training episode (no --val-bags)"
    return TrainingData(train, val, log)


def _say(what: str, lines: list[str]) -> None:
    for line in lines:
        print(f"physis-train-wam: {what}{line}", file=sys.stderr)
