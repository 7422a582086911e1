"""physis-demo's picture: the observed and predicted views side by side, a few rows of them
stacked into strip.png."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image


def write_png(path: Path, rgb: np.ndarray) -> None:
    """[H, W, 3] uint8 -> an 8-bit RGB PNG."""

    Image.fromarray(np.ascontiguousarray(rgb, dtype=np.uint8)).save(path, "PNG")


def image_to_rgb(msg) -> np.ndarray:
    return (
        np.frombuffer(bytes(msg.data), np.uint8)
        .reshape(msg.height, msg.step)[:, : msg.width * 3]
        .reshape(msg.height, msg.width, 3)
    )


def strip(rows: list[np.ndarray], scale: int = 2) -> np.ndarray:
    """Rows (observed | predicted) stacked with 2-pixel gaps, upscaled ``scale`` times."""
    width = max(r.shape[1] for r in rows)
    padded = []
    for r in rows:
        canvas = np.full((r.shape[0] + 2, width, 3), 32, np.uint8)
        canvas[: r.shape[0], : r.shape[1]] = r
        padded.append(canvas)
    image = np.concatenate(padded, axis=0)
    return np.repeat(np.repeat(image, scale, axis=0), scale, axis=1)


STRIP_ROWS_KEPT = 64
"""Side-by-side views kept for strip.png, at most (one is offered a second)."""


class StripRows:
    """The side-by-side views offered once a second, thinned to at most ``limit`` evenly
    spaced ones (every 2nd, then every 4th, ...): memory stays flat however long the demo
    runs, and a run shorter than ``limit`` seconds keeps them all."""

    def __init__(self, limit: int = STRIP_ROWS_KEPT) -> None:
        self.rows: list[np.ndarray] = []
        self.limit = limit
        self._every = 1
        self._offered = 0

    def offer(self, row: np.ndarray) -> None:
        if self._offered % self._every == 0:
            self.rows.append(row)
            if len(self.rows) > self.limit:
                self.rows = self.rows[::2]
                self._every *= 2
        self._offered += 1
