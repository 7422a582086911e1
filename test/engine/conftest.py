"""Engine tests: one torch thread (the machine is shared), tiny models built once per session."""

from __future__ import annotations

import pytest
import torch

from physis_ros.engine.build import build_model
from physis_ros.engine.config import get_preset

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny():
    """The tiny world-action model (action_mode="predict")."""
    return build_model(get_preset("tiny"), seed=0)


@pytest.fixture(scope="session")
def tiny_condition():
    """A tiny world model conditioned on commanded actions per chunk."""
    return build_model(get_preset("tiny", action_mode="condition"), seed=1)


@pytest.fixture(scope="session")
def tiny_video():
    """A tiny video-only world model (no actions)."""
    return build_model(get_preset("tiny", action_mode="none"), seed=2)


@pytest.fixture(scope="session")
def tiny_x0():
    """The tiny world-action model with an x0-predicting head (same weights as ``tiny``)."""
    return build_model(get_preset("tiny", prediction="x0"), seed=0)


@pytest.fixture(scope="session")
def tiny_anchor():
    """A tiny world model with commands whose x0 head predicts the change from its anchor
    (the newest observed frame), as push-wm's."""
    cfg = get_preset("tiny", action_mode="condition", prediction="x0", anchor_residual=True)
    return build_model(cfg, seed=4)
