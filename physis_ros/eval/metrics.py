"""Image and action metrics: MSE, PSNR, SSIM, per frame; and their summaries.

What belongs here: pure numpy functions on uint8 images ([H, W, 3] or [N, H, W, 3]) and
float actions. SSIM follows Wang et al. 2004 (11x11 Gaussian window, sigma 1.5, K1 0.01,
K2 0.03, data range 255, unbiased window covariances), computed per channel on the valid
region (no padding) and averaged over channels and positions.
"""

from __future__ import annotations

import math

import numpy as np

PSNR_CAP_DB = 100.0
"""PSNR of identical images (infinite) is reported as this cap, so means stay finite."""


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


def _gaussian_kernel(size: int = 11, sigma: float = 1.5) -> np.ndarray:
    x = np.arange(size) - (size - 1) / 2
    k = np.exp(-(x * x) / (2 * sigma * sigma))
    return k / k.sum()


def _filter_valid(img: np.ndarray, kernel: np.ndarray) -> np.ndarray:
    """Separable 'valid' correlation over the first two axes of [H, W, C]."""
    n = len(kernel)
    h, w = img.shape[:2]
    rows = sum(kernel[i] * img[i : h - n + 1 + i] for i in range(n))
    return sum(kernel[i] * rows[:, i : w - n + 1 + i] for i in range(n))


def ssim(a: np.ndarray, b: np.ndarray, data_range: float = 255.0) -> float:
    """Structural similarity of two [H, W, C] (or [H, W]) images, mean over channels."""
    if a.shape != b.shape:
        raise ValueError(f"shapes differ: {a.shape} vs {b.shape}")
    x = a.astype(np.float64)
    y = b.astype(np.float64)
    if x.ndim == 2:
        x, y = x[..., None], y[..., None]
    win = 11 if min(x.shape[:2]) >= 11 else (min(x.shape[:2]) // 2) * 2 - 1
    if win < 3:
        raise ValueError(f"image {a.shape} is too small for SSIM (needs at least 3x3)")
    kernel = _gaussian_kernel(win, 1.5)
    c1 = (0.01 * data_range) ** 2
    c2 = (0.03 * data_range) ** 2
    mu_x, mu_y = _filter_valid(x, kernel), _filter_valid(y, kernel)
    # unbiased (co)variances, as scikit-image's use_sample_covariance=True
    n_eff = win * win
    cov_norm = n_eff / (n_eff - 1)
    var_x = cov_norm * (_filter_valid(x * x, kernel) - mu_x * mu_x)
    var_y = cov_norm * (_filter_valid(y * y, kernel) - mu_y * mu_y)
    cov = cov_norm * (_filter_valid(x * y, kernel) - mu_x * mu_y)
    num = (2 * mu_x * mu_y + c1) * (2 * cov + c2)
    den = (mu_x * mu_x + mu_y * mu_y + c1) * (var_x + var_y + c2)
    return float(np.mean(num / den))


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
