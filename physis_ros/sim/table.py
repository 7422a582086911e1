"""The table every simulated robot stands at, and its top-down camera (numpy only).

What belongs here: the table frame ``table`` (origin at the table centre, x to the right, y
away from the robot: up in the image), where an arm's base sits on it, what the camera sees,
the colours both scenes draw in, and drawing shapes into a camera image by their signed
distance (anti-aliased over one pixel). The scenes (``scene``: the push arm and its box,
``reach``: the reaching arm and its target) draw themselves with it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

BASE_XY = (0.0, -0.5)
"""Where an arm's base (its first joint) stands, table frame, m."""
TABLE_HALF_M = 0.5
"""The table is [-TABLE_HALF_M, TABLE_HALF_M]^2 (a rim round it)."""
VIEW_HALF_M = 0.55
"""The camera sees [-VIEW_HALF_M, VIEW_HALF_M]^2 of the table."""

TABLE_RGB = (196, 186, 164)
TABLE_MARK_RGB = (176, 166, 146)
LINK_RGB = (40, 70, 170)
TOOL_RGB = (245, 200, 40)
BASE_RGB = (60, 60, 60)
GOAL_RGB = (70, 170, 80)
GOAL_RADIUS_M = 0.05
"""A goal marker is a disk of this radius."""


@dataclass(frozen=True, kw_only=True)
class SceneConfig:
    """Camera size and the seed of the initial state."""

    image_height: int = 64
    """Camera image height in pixels (rgb8)."""
    image_width: int = 64
    """Camera image width in pixels (rgb8)."""
    seed: int = 0
    """Seeds the scene's initial state."""

    def __post_init__(self) -> None:
        for name in ("image_height", "image_width"):
            value = getattr(self, name)
            if not isinstance(value, int) or not 8 <= value <= 4096:
                raise ValueError(f"{name} must be an int in [8, 4096], got {value!r}")
        if not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"seed must be a non-negative int, got {self.seed!r}")


class TopDownCamera:
    """The pixel centres of an [H, W] image of the table, and painting into it."""

    def __init__(self, height: int, width: int) -> None:
        xs = -VIEW_HALF_M + (np.arange(width) + 0.5) * (2 * VIEW_HALF_M / width)
        ys = VIEW_HALF_M - (np.arange(height) + 0.5) * (2 * VIEW_HALF_M / height)
        self.px, self.py = np.meshgrid(xs, ys)
        """[H, W] table coordinates (m) of each pixel's centre."""
        self.pixel_m = 2 * VIEW_HALF_M / min(height, width)

    def table(self) -> np.ndarray:
        """[H, W, 3] float32: the bare table with its fixed markings (a ring round the arm's
        base and the rim), so the background is not blank."""
        px, py = self.px, self.py
        img = np.empty((*px.shape, 3), dtype=np.float32)
        img[:] = TABLE_RGB
        ring = np.abs(np.hypot(px - BASE_XY[0], py - BASE_XY[1]) - 0.35) - 0.004
        self.paint(img, ring, TABLE_MARK_RGB)
        rim = TABLE_HALF_M - np.maximum(np.abs(px), np.abs(py))
        self.paint(img, rim, TABLE_MARK_RGB)
        return img

    def disk(self, centre_xy, radius_m: float) -> np.ndarray:
        """Signed distance (m) of each pixel to a disk."""
        return np.hypot(self.px - centre_xy[0], self.py - centre_xy[1]) - radius_m

    def segment(self, a: np.ndarray, b: np.ndarray, half_width_m: float) -> np.ndarray:
        """Signed distance (m) of each pixel to a thick segment a-b (a link)."""
        return segment_sdf(self.px, self.py, a, b) - half_width_m

    def paint(self, img: np.ndarray, sdf: np.ndarray, rgb: tuple[int, int, int]) -> None:
        """Cover ``img`` where ``sdf`` < 0 with ``rgb``, blended over the pixel at the edge."""
        alpha = np.clip(0.5 - sdf / self.pixel_m, 0.0, 1.0)[..., None]
        img *= 1.0 - alpha
        img += alpha * np.asarray(rgb, dtype=np.float32)

    @staticmethod
    def to_uint8(img: np.ndarray) -> np.ndarray:
        """The painted float image as the camera's [H, W, 3] uint8."""
        return np.clip(img + 0.5, 0, 255).astype(np.uint8)


def segment_sdf(px: np.ndarray, py: np.ndarray, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Distance of points (px, py) to the segment a-b."""
    ab = b - a
    t = np.clip(((px - a[0]) * ab[0] + (py - a[1]) * ab[1]) / max(float(ab @ ab), 1e-12), 0, 1)
    return np.hypot(px - (a[0] + t * ab[0]), py - (a[1] + t * ab[1]))
