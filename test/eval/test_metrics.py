"""Frame and action metrics behave as their definitions say."""

import math

import numpy as np
import pytest

from physis_ros.eval.metrics import PSNR_CAP_DB, mse, psnr, ssim, summarize


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
        ssim(img[:2, :2], img[:2, :2])


def test_summarize():
    s = summarize([1.0, 2.0, 3.0, 100.0])
    assert s["count"] == 4 and s["median"] == 2.5 and s["max"] == 100.0
    assert summarize([])["median"] is None
