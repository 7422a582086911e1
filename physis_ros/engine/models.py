"""What a served model name means: ``resolve_model(name_or_path)`` -> the model's config, its
weights and what the weights say about how to sample them; what the serving spec resolves.

It knows:

- a preset name (``tiny``, ``push-wm``, ``wan2.1-14b``, ...): the preset's config, with the
  shipped trained weights when the preset has them (``physis_ros.weights.SHIPPED``; when
  the install lacks them, an error naming the command that makes them, never random weights
  unasked), else none (random weights by seed);
- a ``.safetensors`` file written by ``physis-train``: its metadata names the preset and the
  window, steps and schedule shift it was trained for; a file trained elsewhere may carry its
  architecture instead (``model_config``: a ``ModelConfig`` as JSON), for a robot no preset
  describes (docs/byo_wam.md);
- a model directory (upstream Wan or diffusers): ``engine.checkpoints``, which holds its
  config and weights (loaded strictly from the directory).

Nothing is downloaded.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from physis_ros.cli_errors import UsageError
from physis_ros.contract.safetensors import read_metadata, read_shapes
from physis_ros.engine import checkpoints
from physis_ros.engine.config import PRESETS, ModelConfig
from physis_ros.engine.model import WanDiT, check_state_keys
from physis_ros.weights import DEFAULT_SHIFT, DEFAULT_STEPS, SHIPPED, missing_shipped_weights

RANDOM_WEIGHTS = "random"
"""``weights`` value that asks for random weights even where the preset ships trained ones."""


@dataclass(frozen=True, kw_only=True)
class ResolvedModel:
    """A model ready to build: its config, its weights and their sampling defaults."""

    config: ModelConfig
    weights: Path | None
    """Safetensors file with upstream key names; None: random weights (by seed)."""
    metadata: dict[str, str] = field(default_factory=dict)
    """The weights file's ``__metadata__`` (empty without weights)."""
    sampling: dict[str, float | int] = field(default_factory=dict)
    """``steps``, ``window``, ``shift`` the weights were trained for (those they record)."""
    directory: bool = False
    """A model directory: its weights are the directory's (``engine.checkpoints``)."""


def resolve_model(
    name_or_path: str,
    weights: str | None = None,
    *,
    latent_frames: int = 0,
    resolution: str = "",
    vae: str = "",
    variant: str = "",
    dtype: str = "",
) -> ResolvedModel:
    """Resolve a model name or checkpoint path (see the module docstring).

    ``weights``: a safetensors file to use instead of the default ones, or ``"random"``
    (``RANDOM_WEIGHTS``); None: the default (shipped weights of a preset, the checkpoint
    itself for a path). ``latent_frames``, ``resolution``, ``vae``: the chunk and codec;
    ``variant``, ``dtype``: which weights of a model directory (``engine.checkpoints.
    resolve_model``). Raises ValueError naming what is wrong (an
    unknown name, a missing file, a checkpoint without the metadata that says which model it
    is)."""
    layout = {"latent_frames": latent_frames, "resolution": resolution, "vae": vae}
    files = {"variant": variant, "dtype": dtype}  # which of a directory's weight variants
    text = str(name_or_path).strip()
    if not text:
        raise ValueError("model is empty: name a preset, a physis-train file or a directory")
    if text.endswith(".safetensors") or Path(text).is_file():
        path = Path(text)
        if not path.is_file():
            raise ValueError(f"model {text!r}: no such checkpoint file")
        _read_metadata(path)  # not safetensors: a usage error, said as one
        config = checkpoints.resolve_model(str(path), **layout).cfg
    elif text in PRESETS:
        config = checkpoints.resolve_model(text, **layout).cfg
        default = SHIPPED.get(text)
        path = default if default is not None and default.exists() else None
        if default is not None and path is None and not weights:
            raise UsageError(missing_shipped_weights(text))  # the line says the fix
    elif checkpoints.is_model_dir(text):
        if weights:
            raise ValueError(f"model {text} is a directory with its own weights: drop weights")
        config = checkpoints.resolve_model(text, **layout, **files).cfg
        return ResolvedModel(config=config, weights=None, directory=True)
    else:
        raise ValueError(
            f"model {text!r} is neither a preset ({', '.join(sorted(PRESETS))}), a "
            "physis-train checkpoint file nor a model directory"
        )
    if weights == RANDOM_WEIGHTS:
        return ResolvedModel(config=config, weights=None)
    if weights:
        path = Path(weights)
        if not path.is_file():
            raise ValueError(f"weights {weights!r}: no such file")
    if path is None:
        return ResolvedModel(config=config, weights=None)
    return _with_weights(config, path)


def _read_metadata(path: Path) -> dict[str, str]:
    """The file's safetensors metadata; a file that is not safetensors is a usage error."""
    try:
        return read_metadata(path)
    except (ValueError, OSError) as exc:
        raise UsageError(
            f"{path} is not a readable safetensors file ({exc})",
            "copy it again, or export it again (physis-train writes weights.safetensors)",
        ) from exc


def _with_weights(config: ModelConfig, path: Path) -> ResolvedModel:
    """The weights' metadata and the sampling settings they record."""
    meta = _read_metadata(path)
    if meta.get("model", config.name) != config.name:
        raise ValueError(f"{path} holds weights of model {meta['model']}, not {config.name}")
    sampling: dict[str, float | int | str] = {}
    if "window" in meta:
        try:
            train_cfg = json.loads(meta.get("train_config", "{}"))
            sampling = {
                "window": int(meta["window"]),
                "steps": int(meta.get("steps", DEFAULT_STEPS)),
                "shift": float(train_cfg.get("shift", DEFAULT_SHIFT)),
            }
            # the live timeline the weights were trained for (DESIGN.md §3.1), when recorded
            if "horizon" in meta:
                sampling["horizon"] = int(meta["horizon"])
            if "context_noise" in meta:
                sampling["context_noise"] = meta["context_noise"]
        except (ValueError, TypeError, AttributeError) as err:
            raise ValueError(f"{path}: unreadable physis-train metadata: {err}") from None
    return ResolvedModel(config=config, weights=path, metadata=meta, sampling=sampling)


def check_weights_fit(resolved: ResolvedModel) -> None:
    """Raise ValueError naming every missing, unexpected or mis-shaped key unless the weights
    file holds exactly the model's tensors. Reads the file's header only, against a model on
    the meta device (no memory), so rank 0 can check before any rank loads (a model
    directory's own loader checks its files the same way)."""
    if resolved.weights is None:
        return
    shapes = read_shapes(resolved.weights)
    with torch.device("meta"):
        model = WanDiT(resolved.config, device="meta")
    try:
        check_state_keys(model, shapes, source=f"weights {resolved.weights}")
    except ValueError as exc:
        raise UsageError(
            str(exc), "serve the weights with the model they were trained for (--model)"
        ) from exc
