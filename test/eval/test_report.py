"""report.json's per-chunk summary, by hand on windows whose metrics the test sets."""

from __future__ import annotations

import pytest

from physis_ros.eval.evaluate import EvalConfig, EvalResult, ModelInfo, WindowResult
from physis_ros.eval.metrics import PSNR_CAP_DB
from physis_ros.eval.report import STILL_PSNR_DB, build_report, render_markdown

MODEL = ModelInfo(
    name="hand",
    frames_per_chunk=2,
    image_height=32,
    image_width=32,
    action_horizon=2,
    action_dim=2,
    action_mode="none",
)


def _window(psnr: list[float], baseline: list[float]) -> WindowResult:
    return WindowResult(
        bag="b",
        start_frame=0,
        psnr=psnr,
        ssim=[0.5] * len(psnr),
        baseline_psnr=baseline,
        baseline_ssim=[0.5] * len(baseline),
        frame_mse=[1.0] * len(psnr),
        baseline_frame_mse=[1.0] * len(baseline),
        action_mse=None,
        baseline_action_mse=None,
        response_latency_ms=1.0,
        output_times_s=[0.0, 0.1],
        chunk_latency_ms=[1.0, 1.0],
    )


def _result(windows: list[WindowResult]) -> EvalResult:
    return EvalResult(model=MODEL, config=EvalConfig(horizon_chunks=2), windows=windows)


def test_the_gain_splits_into_still_and_moving_frames_that_add_up():
    # chunk 1 = steps 1-2, chunk 2 = steps 3-4. Window a is still at step 1 (copy-last exact)
    # and the model is 1 level off there; window b moves everywhere.
    a = _window([60.0, 30.0, 24.0, 22.0], [PSNR_CAP_DB, 28.0, 25.0, 20.0])
    b = _window([25.0, 26.0, 23.0, 21.0], [23.0, 27.0, 22.0, STILL_PSNR_DB])
    chunks = build_report(_result([a, b]))["by_chunk"]
    one, two = chunks
    # step 1: still (60 - 100) / 2, moving (25 - 23) / 2; step 2: moving (2 - 1) / 2
    assert one["still_share"] == pytest.approx((1 / 2 + 0) / 2)
    assert one["gain_from_still_db"] == pytest.approx((-40 / 2 + 0) / 2)
    assert one["gain_from_moving_db"] == pytest.approx((2 / 2 + 1 / 2) / 2)
    # step 4: window b's copy-last scores exactly the threshold: still
    assert two["still_share"] == pytest.approx(0.25)
    assert two["gain_from_still_db"] == pytest.approx((21.0 - STILL_PSNR_DB) / 2 / 2)
    for e in chunks:
        assert e["gain_from_still_db"] + e["gain_from_moving_db"] == pytest.approx(
            e["psnr_gain_db"]
        )
    md = render_markdown(build_report(_result([a, b])))
    assert "| 1 | 25.0 | -10.00 | 0.75 |" in md


def test_a_model_without_frames_has_no_split():
    w = _window([], [PSNR_CAP_DB, 28.0, 25.0, 20.0])
    report = build_report(_result([w]))
    assert all(e["still_share"] is None for e in report["by_chunk"])
    assert "gain from still" not in render_markdown(report)
