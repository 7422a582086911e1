"""physis-eval end to end: real engine, bags the test records, damaged and incomplete bags."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from PIL import Image

from physis_ros.sim.record import COMMAND_TOPIC, IMAGE_TOPIC

from .bagtools import record_small, rewrite_bag

HORIZON_KEYS = {
    "step",
    "chunk",
    "time_ahead_s",
    "psnr",
    "ssim",
    "baseline_psnr",
    "baseline_ssim",
    "action_mse",
    "baseline_action_mse",
    "psnr_of_mean_mse",
    "baseline_psnr_of_mean_mse",
    "psnr_gain_db",
    "windows",
}


def _env() -> dict:
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = "1"
    return env


@pytest.fixture(scope="module")
def bags(tmp_path_factory):
    root = tmp_path_factory.mktemp("evalbags")
    good = record_small(root / "good_mcap", duration_s=4.0, seed=7)
    jpeg = record_small(
        root / "jpeg_sqlite", duration_s=4.0, seed=8, encoding="jpeg", storage="sqlite3"
    )
    big = record_small(
        root / "bgr64", duration_s=4.0, seed=9, encoding="bgr8", image_height=64, image_width=64
    )

    def corrupt(topic, i, raw, store):
        return raw[:30] if topic == IMAGE_TOPIC and i in (3, 30) else raw

    bad = rewrite_bag(good, root / "corrupt", edit=corrupt)
    no_cmd = rewrite_bag(good, root / "no_command", drop_topics=(COMMAND_TOPIC,))
    garbage = root / "garbage.mcap"
    garbage.write_bytes(b"not a bag at all")
    return {
        "good": good,
        "jpeg": jpeg,
        "big": big,
        "bad": bad,
        "no_cmd": no_cmd,
        "garbage": garbage,
    }


def _run_eval(out, *args) -> tuple[int, dict, str]:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "physis_ros.eval.cli",
            *map(str, args),
            "--out",
            str(out),
            "--quiet",
            "--context-chunks",
            "2",
            "--horizon-chunks",
            "2",
            "--stride-chunks",
            "6",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env=_env(),
    )
    summary = json.loads(proc.stdout.strip().splitlines()[-1]) if proc.stdout.strip() else {}
    return proc.returncode, summary, proc.stderr


def test_eval_reports_every_bag_and_skips_bad_ones_with_reasons(bags, tmp_path):
    out = tmp_path / "report"
    rc, summary, err = _run_eval(
        out,
        bags["good"],
        bags["jpeg"],
        bags["big"],
        bags["bad"],
        bags["no_cmd"],
        bags["garbage"],
        "--random-weights",
        "--model",
        "push-wm",
        "--steps",
        "2",
    )
    assert rc == 0, err
    report = json.loads((out / "report.json").read_text())
    # 4 readable bags x 3 windows (41 frames; windows of 8 frames every 12)
    assert report["windows"] == 12 and summary["windows"] == 12
    assert len(report["horizon"]) == 4  # 2 chunks x 2 frames (2 actions per chunk)
    for entry in report["horizon"]:
        assert set(entry) == HORIZON_KEYS
        assert entry["psnr"] is not None and entry["baseline_psnr"] is not None
        assert entry["action_mse"] is None  # conditioned on the commands: nothing to score
        assert entry["baseline_action_mse"] is not None
    assert "predicts no actions" in report["not_measured"]["action_mse"]
    skipped = {os.path.basename(b["path"]): b["reason"] for b in report["skipped_bags"]}
    assert set(skipped) == {"no_command", "garbage.mcap"}
    assert "commanded action" in skipped["no_command"]
    assert "cannot open bag" in skipped["garbage.mcap"]
    by_name = {os.path.basename(b["path"]): b for b in report["bags"]}
    assert by_name["corrupt"]["skipped_messages"] == {f"{IMAGE_TOPIC}: corrupt_message": 2}
    assert by_name["jpeg_sqlite"]["storage"] == "sqlite3"
    assert any("resized from 64x64 to 32x32" in n for n in by_name["bgr64"]["notes"])
    assert "skipped bag" in err and "no_command" in err
    md = (out / "report.md").read_text()
    assert "## Skipped bags" in md and "corrupt_message" in md
    for png in ("strips.png", "error_vs_horizon.png", "latency_hist.png", "interval_timeline.png"):
        with Image.open(out / png) as img:
            assert img.size[0] > 100 and img.size[1] > 100
    lat = report["latency"]
    assert lat["response_latency_ms"]["count"] == 12 and lat["interval_ms"]["count"] == 12
    assert report["engine"]["steps"] == 2


def test_eval_with_nothing_usable_exits_1_and_says_why(bags, tmp_path):
    rc, summary, err = _run_eval(
        tmp_path / "r", bags["no_cmd"], "--random-weights", "--model", "push-wm"
    )
    assert rc == 1 and summary["windows"] == 0
    assert "commanded action" in err


def test_eval_bad_usage_exits_2(tmp_path):
    rc, _, err = _run_eval(
        tmp_path / "r", tmp_path, "--weights", str(tmp_path / "missing.safetensors")
    )
    assert rc == 2 and "do not exist" in err
