"""Image and action metrics: MSE, PSNR, SSIM, per frame; and their summaries.

What belongs here: pure numpy functions on uint8 images ([H, W, 3] or [N, H, W, 3]) and
float actions. SSIM is scikit-image's (Wang et al. 2004 settings, see ``ssim``).
"""

from __future__ import annotations

import math

import numpy as np

PSNR_CAP_DB = 100.0
"""PSNR of identical images (infinite) is reported as this cap, so means stay finite."""
SSIM_WINDOW = 11
"""Side of SSIM's Gaussian window (sigma 1.5, truncated at 3.5 sigma): the smallest image."""


def mse(a: np.ndarray, b: np.ndarray) -> float:
    """Mean squared error over all elements (images: in 0..255 units)."""
    if a.shape != b.shape:
        raise ValueError(f"shapes differ: {a.shape} vs {b.shape}")
    d = a.astype(np.float64) - b.astype(np.float64)
    return float(np.mean(d * d))


def psnr(a: np.ndarray, b: np.ndarray, data_range: float = 255.0) -> float:
    """Peak signal-to-noise ratio in dB (capped at PSNR_CAP_DB for identical images)."""
    err = mse(a, b)
    if err <= 0:
        return PSNR_CAP_DB
    return min(PSNR_CAP_DB, 10.0 * math.log10(data_range * data_range / err))


def ssim(a: np.ndarray, b: np.ndarray, data_range: float = 255.0) -> float:
    """Structural similarity of two [H, W, C] (or [H, W]) images, mean over channels and
    positions: scikit-image's, with Wang et al. 2004's settings (11x11 Gaussian window, sigma
    1.5, K1 0.01, K2 0.03, population covariances), over the valid region."""
    from skimage.metrics import structural_similarity

    if a.shape != b.shape:
        raise ValueError(f"shapes differ: {a.shape} vs {b.shape}")
    if min(a.shape[:2]) < SSIM_WINDOW:
        raise ValueError(
            f"image {a.shape} is too small for SSIM (needs {SSIM_WINDOW}x{SSIM_WINDOW})"
        )
    return float(
        structural_similarity(
            a.astype(np.float64),
            b.astype(np.float64),
            data_range=data_range,
            channel_axis=-1 if a.ndim == 3 else None,
            gaussian_weights=True,
            sigma=1.5,
            use_sample_covariance=False,
        )
    )


def summarize(values: list[float] | np.ndarray) -> dict[str, float | int | None]:
    """count, mean, median, p99, min, max of a list (None entries when it is empty)."""
    arr = np.asarray(values, dtype=np.float64)
    if arr.size == 0:
        return {"count": 0, "mean": None, "median": None, "p99": None, "min": None, "max": None}
    return {
        "count": int(arr.size),
        "mean": float(arr.mean()),
        "median": float(np.median(arr)),
        "p99": float(np.percentile(arr, 99)),
        "min": float(arr.min()),
        "max": float(arr.max()),
    }
