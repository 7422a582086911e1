"""The camera frames of one chunk as every codec takes them: uint8 [F, H, W, 3], at most a
chunk's worth, padded with the newest frame to a whole chunk."""

from __future__ import annotations

import numpy as np

from physis_ros.engine.config import ModelConfig


def check_frames(cfg: ModelConfig, frames: np.ndarray) -> np.ndarray:
    """Validate [F, H, W, 3] uint8 with F <= frames per chunk; pad with the newest frame."""
    h, w = cfg.image_size
    n = cfg.frames_per_chunk
    if not isinstance(frames, np.ndarray) or frames.dtype != np.uint8:
        raise ValueError(f"frames must be a uint8 numpy array, got {type(frames).__name__}")
    if frames.ndim != 4 or frames.shape[1:] != (h, w, 3) or frames.shape[0] < 1:
        raise ValueError(
            f"frames have shape {frames.shape}, model {cfg.name} needs [F<={n}, {h}, {w}, 3]"
        )
    if frames.shape[0] > n:
        raise ValueError(f"{frames.shape[0]} frames, a chunk holds at most {n}")
    if frames.shape[0] < n:
        frames = np.concatenate([frames, np.repeat(frames[-1:], n - frames.shape[0], axis=0)])
    return frames
