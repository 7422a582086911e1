"""Frame and action metrics behave as their definitions say."""

import math

import numpy as np
import pytest

from physis_ros.eval.metrics import PSNR_CAP_DB, mse, psnr, ssim


def test_psnr_of_a_known_error():
    a = np.zeros((8, 8, 3), np.uint8)
    b = np.full((8, 8, 3), 10, np.uint8)
    assert mse(a, b) == 100.0
    assert psnr(a, b) == pytest.approx(10 * math.log10(255**2 / 100))
    assert psnr(a, a) == PSNR_CAP_DB
    with pytest.raises(ValueError, match="shapes differ"):
        mse(a, b[:4])


def test_ssim_is_one_for_equal_images_and_falls_with_noise():
    rng = np.random.default_rng(0)
    img = rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)
    assert ssim(img, img) == pytest.approx(1.0)
    scores = []
    for sigma in (5, 20, 60):
        noisy = np.clip(img + rng.normal(0, sigma, img.shape), 0, 255).astype(np.uint8)
        scores.append(ssim(img, noisy))
        assert ssim(img, noisy) == pytest.approx(ssim(noisy, img))
    assert scores[0] > scores[1] > scores[2]
    # a constant shift of brightness costs luminance only, structure is kept
    assert ssim(img // 2, img // 2 + 20) > 0.9
    with pytest.raises(ValueError, match="too small"):
        ssim(img[:8, :8], img[:8, :8])


def _ssim_by_the_formula(a: np.ndarray, b: np.ndarray) -> float:
    """Wang et al. 2004 written out (11x11 Gaussian window, sigma 1.5, population
    covariances, valid region, mean over channels): what ``ssim`` must compute."""
    x, y = a.astype(np.float64), b.astype(np.float64)
    k = np.exp(-((np.arange(11) - 5.0) ** 2) / (2 * 1.5**2))
    k /= k.sum()

    def filt(img):
        h, w = img.shape[:2]
        rows = sum(k[i] * img[i : h - 10 + i] for i in range(11))
        return sum(k[i] * rows[:, i : w - 10 + i] for i in range(11))

    c1, c2 = (0.01 * 255) ** 2, (0.03 * 255) ** 2
    mx, my = filt(x), filt(y)
    vx, vy, cov = filt(x * x) - mx * mx, filt(y * y) - my * my, filt(x * y) - mx * my
    num = (2 * mx * my + c1) * (2 * cov + c2)
    return float(np.mean(num / ((mx * mx + my * my + c1) * (vx + vy + c2))))


def test_ssim_is_scikit_images_with_wang_et_als_settings():
    rng = np.random.default_rng(1)
    for shape in ((32, 32, 3), (16, 24, 3), (40, 40)):
        a = rng.integers(0, 256, shape, dtype=np.uint8)
        b = np.clip(a + rng.normal(0, 25, shape), 0, 255).astype(np.uint8)
        assert ssim(a, b) == pytest.approx(_ssim_by_the_formula(a, b), abs=1e-9)
