"""Training learns: on a short run of each trainer the loss falls and every trained weight
moves. (The reproducibility tests would pass with an optimizer that never stepped.)

Each run is 30 steps of 4 windows from the seeded initialisation, in process. The margins
hold with room across seeds: over seeds 0-5 the world-action model's mean training loss over
its last 6 steps was 0.11-0.53 of that over its first 6 and its validation loss fell to
0.24-0.72 of the first; over seeds 0-3 the world model's fell to 0.08-0.11 and 0.09-0.11.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file

from physis_ros.engine.build import build_model
from physis_ros.engine.model import to_upstream_state_dict

STEPS = 30
EDGE = 6
"""Steps averaged at each end of the run."""


def _moved(weights: Path, model, frozen: tuple[str, ...] = ()) -> list[str]:
    """The saved tensors equal to the seeded initialisation's (at the saved precision),
    leaving out ``frozen`` ones."""
    saved = load_file(str(weights))
    init = to_upstream_state_dict(model)
    assert saved.keys() == init.keys()
    return [k for k, v in saved.items() if k not in frozen and torch.equal(v, init[k].to(v.dtype))]


def _falls(losses: list[float]) -> float:
    """Mean loss over the last EDGE steps over that over the first EDGE."""
    assert len(losses) == STEPS and np.isfinite(losses).all()
    return float(np.mean(losses[-EDGE:]) / np.mean(losses[:EDGE]))


def test_the_world_action_trainer_lowers_its_loss_and_moves_every_weight(tmp_path):
    from physis_ros.engine.config import get_preset
    from physis_ros.train.wam import train_wam
    from physis_ros.train.wam_config import WamTrainConfig

    cfg = WamTrainConfig(
        episodes=4, val_episodes=2, steps=STEPS, batch_size=4, warmup_steps=5,
        checkpoint_every=0, val_every=1000, seed=0,
    )  # fmt: skip
    log = train_wam(cfg, tmp_path / "out", data_dir=tmp_path / "data", progress=False)
    assert _falls(log["train_loss"]) < 0.7, log["train_loss"]
    first_val, final_val = log["val"][0]["loss"], log["final_val"]["loss"]
    assert final_val < 0.9 * first_val, (first_val, final_val)
    assert log["final_val"]["action"] < log["val"][0]["action"]
    model = build_model(get_preset(cfg.model), seed=cfg.seed)
    assert _moved(tmp_path / "out" / "weights.safetensors", model) == []


def test_the_world_model_trainer_lowers_its_loss_and_moves_every_trained_weight(tmp_path):
    from physis_ros.sim.record import RecordConfig, record_episode
    from physis_ros.train.train import TrainConfig, train

    bag = tmp_path / "bag"
    record_episode(bag, RecordConfig(seed=11, duration_s=6.0, image_height=32, image_width=32))
    cfg = TrainConfig(
        steps=STEPS, batch_size=4, max_context=2, horizon=2, window=2, warmup_steps=5,
        val_every=1000, seed=0,
    )  # fmt: skip
    log = train(cfg, [bag], tmp_path / "out", val_paths=[bag], progress=False)
    assert _falls(log["train_loss"]) < 0.5, log["train_loss"]
    (_, first_val), (_, last_val) = log["val_loss"][0], log["val_loss"][-1]
    assert log["final_val_loss"] < 0.5 * first_val and last_val < 0.5 * first_val
    model = build_model(cfg.model_config, seed=cfg.seed)
    # the anchor gate is held at 1 by design (train.train: it passes the anchor through)
    frozen = ("head.anchor_gate",)
    assert _moved(tmp_path / "out" / "weights.safetensors", model, frozen) == []
