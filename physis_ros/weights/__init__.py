"""The shipped weights: the push scene's world model (the embedded default that demos serve),
its world-action model, and the reach scene's world-action model.

What belongs here: the path of the default checkpoint, reading a checkpoint's metadata (the
safetensors header, parsed without torch so the robot side can read it too), and the engine
arguments the checkpoint was trained for. ``push_wm.safetensors`` comes from ``physis-train``
(see its metadata ``train_config`` for the exact command's settings).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from physis_ros.contract.safetensors import MODEL_CONFIG_KEY, read_metadata

DEFAULT_WEIGHTS = Path(__file__).resolve().parent / "push_wm.safetensors"
WAM_WEIGHTS = Path(__file__).resolve().parent / "push_wam.safetensors"
"""The goal-push world-action model (``physis-train-wam``; docs/push_wam/README.md)."""
REACH_WAM_WEIGHTS = Path(__file__).resolve().parent / "reach_wam.safetensors"
"""The reaching arm's world-action model (``physis-train-wam --task reach``;
docs/reach_wam/README.md)."""
DEFAULT_STEPS = 4
"""Denoising steps the default model is served with (measured in its eval report)."""
DEFAULT_SHIFT = 3.0
"""Schedule shift the default model is served with (the shift it was trained with)."""


TRAINED_KNOWN_ROWS_AHEAD = 8
"""What a world-action model's weights that do not say were trained with (every push-wam
run so far wrote 8: physis-train-wam's max_freeze_rows)."""


def trained_known_rows_ahead(meta: dict[str, str]) -> int:
    """How many rows past the newest frame a world-action model was trained to be told as
    committed: the most a request should give it (``max_known_rows_ahead`` in its metadata)."""
    return int(meta.get("max_known_rows_ahead", TRAINED_KNOWN_ROWS_AHEAD))


def min_committed_ms(meta: dict[str, str]) -> float:
    """How long after the newest frame a world-action model's requests commit the robot's
    plan at least, however soon the answer comes (``min_committed_ms`` in its metadata; 0:
    only what the response latency commits). A model trained to correct committed rows does
    better told a few of them than none: consecutive chunks then agree instead of switching
    plans (docs/push_wam)."""
    text = meta.get("min_committed_ms", "0")
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"metadata min_committed_ms must be a time >= 0 in ms, got {text!r}")
    return value


SHIPPED: dict[str, Path] = {
    "push-wm": DEFAULT_WEIGHTS,
    "push-wam": WAM_WEIGHTS,
    "reach-wam": REACH_WAM_WEIGHTS,
}
"""Model presets that come with trained weights: served with them unless told otherwise."""

TRAIN_COMMANDS: dict[str, str] = {
    "push-wm": "physis-train --out out/push_wm",
    "push-wam": "physis-train-wam --out out/push_wam",
    # 1389 steps of a 2000-step schedule (docs/reach_wam: how the run came to stop there)
    "reach-wam": (
        "physis-train-wam --task reach --out out/reach_wam --episodes 2000 --steps 2000 "
        "--stop-after-steps 1389 --action-weight 6 --start-fraction 0.35 "
        "--committed-drift-rad 0.3 --min-committed-ms 250 --checkpoint-every 500 --seed 21"
    ),
}
"""The command that makes each preset's shipped weights (into OUT/weights.safetensors, OUT its
--out)."""


def missing_shipped_weights(model: str | None) -> str | None:
    """One line saying how to get a preset's trained weights when the install lacks them
    (None when the preset ships none or they are there): serving such a preset on random
    weights without being asked would look like a model that does not work."""
    path = SHIPPED.get(model or "")
    if path is None or path.exists():
        return None
    command = TRAIN_COMMANDS[str(model)]
    made = f"{command.split('--out ', 1)[1].split()[0]}/weights.safetensors"
    return (
        f"{model}: its trained weights ({path.name}) are not in this install; make them with "
        f"`{command}` and pass --weights {made} (or --weights random)"
    )


def shipped_engine_defaults(model: str | None) -> dict:
    """``local_engine`` arguments (checkpoint, window, steps, shift) for a preset that ships with
    weights; empty for the others (random init) or when the weights file is missing."""
    path = SHIPPED.get(model or "")
    if path is None or not path.exists():
        return {}
    return engine_kwargs(path)


def engine_kwargs(path: str | Path = DEFAULT_WEIGHTS) -> dict:
    """``local_engine`` arguments for a checkpoint written by physis-train: model preset,
    checkpoint, attention window, schedule shift, the steps it was trained for (metadata
    ``steps``; DEFAULT_STEPS when it names none), and, when the metadata names them, the
    horizon its streams predict and how it takes observations (``context_noise``)."""
    meta = read_metadata(path)
    if "model" not in meta or "window" not in meta:
        raise ValueError(f"{path}: no physis-train metadata (model, window); pass them explicitly")
    train_cfg = json.loads(meta.get("train_config", "{}"))
    out = {
        # weights that carry their architecture are their own model (engine.models)
        "model": str(path) if MODEL_CONFIG_KEY in meta else meta["model"],
        "checkpoint": str(path),
        "window": int(meta["window"]),
        "steps": int(meta.get("steps", DEFAULT_STEPS)),
        "shift": float(train_cfg.get("shift", DEFAULT_SHIFT)),
    }
    if "horizon" in meta:
        out["horizon"] = int(meta["horizon"])
    if "context_noise" in meta:
        out["context_noise"] = meta["context_noise"]
    return out
