"""In process and over the link, physis-eval scores one window set, fixed before either run,
and reports live minus in process per horizon with its spread."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from physis_ros.engine.api import ChunkOutput
from physis_ros.eval.bag import TopicChoice, read_episode
from physis_ros.eval.evaluate import (
    EvalConfig,
    ModelInfo,
    evaluate,
    frames_in_use,
    window_anchors,
)
from physis_ros.eval.link_eval import evaluate_link
from physis_ros.eval.link_replay import ReplayLink
from physis_ros.eval.metrics import psnr
from physis_ros.eval.paired import live_vs_in_process
from physis_ros.eval.report import write_report
from physis_ros.link.options import LinkOptions

from .bagtools import record_small

# the front end's fake engine lives with the link tests
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "link"))
from link_fake_engine import FakeEngine, served

FRAMES_PER_CHUNK = 2
CONFIG = dict(context_chunks=2, horizon_chunks=2, window_stride_chunks=1, poll_timeout_s=20.0)


def _model() -> ModelInfo:
    """The fake engine as the evaluator sees it: a 32x32 world model without actions."""
    return ModelInfo(
        name="fake",
        frames_per_chunk=FRAMES_PER_CHUNK,
        image_height=32,
        image_width=32,
        action_horizon=1,
        action_dim=0,
        action_mode="none",
    )


class _FakeWorldModel(FakeEngine):
    """The front end's fake engine as a world model without actions: its chunk k is k
    everywhere. In process a window's predicted chunk k counts from the window's own stream
    start, live from the bag's first frame, so the model's two scores differ window by window
    while copy-last, on the same anchors, cannot."""

    def __init__(self) -> None:
        super().__init__(
            slots=2, chunk_ms=1.0, height=32, width=32, action_dim=0, chunk_frames=FRAMES_PER_CHUNK
        )

    def poll(self, timeout_s: float) -> list[ChunkOutput]:
        return [dataclasses.replace(o, actions=None) for o in super().poll(timeout_s)]


@pytest.fixture(scope="module")
def bag(tmp_path_factory) -> Path:
    return record_small(tmp_path_factory.mktemp("same_windows") / "bag", duration_s=3.0, seed=21)


def test_the_window_set_follows_the_bag_and_the_window_flags_only(bag):
    ep = read_episode(bag, topics=TopicChoice(), image_size=(32, 32))
    model = _model()
    every = window_anchors(ep, model, EvalConfig(**CONFIG))
    # 2 observed + 2 predicted chunks of 2 frames, one chunk apart: anchors on odd frames
    assert every[0] == 3 and every == list(range(3, len(ep.frames) - 4, 2))
    first_second = EvalConfig(**CONFIG, max_seconds=1.0)  # frames 0..10 at 10 Hz
    assert frames_in_use(ep, FRAMES_PER_CHUNK, first_second) == 11
    assert window_anchors(ep, model, first_second) == [3, 5]  # 7: up to frame 11
    three = EvalConfig(**CONFIG, max_windows_per_bag=3)
    assert window_anchors(ep, model, three) == [3, 5, 7]
    # over the link the bag is replayed up to the end of the last window: frame 7 + 4
    assert frames_in_use(ep, FRAMES_PER_CHUNK, three) == 12


@pytest.mark.parametrize("realtime", [False, True], ids=["as-fast-as-taken", "realtime"])
def test_both_modes_score_the_same_anchors_and_the_report_pairs_them(bag, tmp_path, realtime):
    """Every anchor the in-process run scores is scored live and no other; copy-last differs
    by exactly 0 on each, the model by what the serving changes, with its spread."""
    cfg = EvalConfig(**CONFIG, max_seconds=2.0, realtime=realtime)
    from physis_ros.serve.frontend_config import ServerDescription

    description = ServerDescription(model="fake", steps=2, blocks=2, horizon=2)
    with served(_FakeWorldModel(), description=description) as (_loop, handle):
        opts = ReplayLink(
            target=f"127.0.0.1:{handle.port}", link=LinkOptions(connect_timeout_s=5.0)
        )
        live = evaluate_link(opts, [str(bag)], cfg, progress=False)
    in_process = evaluate(_FakeWorldModel(), _model(), [str(bag)], cfg, progress=False)

    anchors = window_anchors(
        read_episode(bag, topics=TopicChoice(), image_size=(32, 32)), _model(), cfg
    )
    assert live.window_set == in_process.window_set == {str(bag): anchors}
    scored = {(w.bag, w.anchor_frame) for w in live.windows}
    assert scored == {(w.bag, w.anchor_frame) for w in in_process.windows}
    assert scored == {(str(bag), a) for a in anchors} and len(anchors) == 7
    # a stream's other anchors (every observed slot is one) are counted, not scored
    assert live.link["unscored_predictions"]["anchored outside the window set"] > 0

    cmp = live_vs_in_process(live, in_process)
    assert cmp["same_anchors"] and cmp["windows_in_set"] == 7
    frames = read_episode(bag, topics=TopicChoice(), image_size=(32, 32)).frames
    for e in cmp["by_chunk"]:
        h = e["chunk"]
        assert e["windows"] == e["scored_live"] == e["scored_in_process"] == 7
        base = e["copy_last"]
        assert base["difference"] == base["difference_p10"] == base["difference_p90"] == 0.0
        assert base["difference_interval"] == [0.0, 0.0] and base["pooled_difference"] == 0.0
        # the fake's chunk k is all k: in process chunk context + h - 1, live slot a + h
        slots = [(a + 1) // FRAMES_PER_CHUNK - 1 for a in anchors]
        ahead = [
            range(a + 1 + (h - 1) * FRAMES_PER_CHUNK, a + 1 + h * FRAMES_PER_CHUNK) for a in anchors
        ]
        live_db = [
            np.mean([psnr(np.full_like(frames[j], s + h), frames[j]) for j in js])
            for s, js in zip(slots, ahead, strict=True)
        ]
        in_db = [
            np.mean(
                [psnr(np.full_like(frames[j], cfg.context_chunks + h - 1), frames[j]) for j in js]
            )
            for js in ahead
        ]
        d = np.array(live_db) - np.array(in_db)
        model = e["model"]
        assert model["live"] == pytest.approx(np.mean(live_db))
        assert model["in_process"] == pytest.approx(np.mean(in_db))
        assert model["difference"] == pytest.approx(d.mean()) and d.std() > 0
        assert model["difference_p10"] == pytest.approx(np.percentile(d, 10))
        assert model["difference_p90"] == pytest.approx(np.percentile(d, 90))
        lo, hi = model["difference_interval"]
        assert d.min() <= lo <= model["difference"] <= hi <= d.max()
        assert model["pooled_difference"] == pytest.approx(
            model["pooled_live"] - model["pooled_in_process"]
        )

    report = write_report(live, tmp_path / "report", live_vs_in_process=cmp)
    saved = json.loads((tmp_path / "report" / "report.json").read_text())
    assert saved["live_vs_in_process"]["by_chunk"][0]["model"]["difference"] == pytest.approx(
        report["live_vs_in_process"]["by_chunk"][0]["model"]["difference"]
    )
    assert saved["window_set"] == {str(bag): anchors}
    md = (tmp_path / "report" / "report.md").read_text()
    assert "## Live minus in process (the same windows)" in md
    assert "| Model: h | windows |" in md and "| Copy-last: h | windows |" in md
    assert "| 1 | 7 |" in md and "+0.00 / +0.00" in md


def test_runs_on_other_windows_are_not_compared(bag):
    cfg = EvalConfig(**CONFIG)
    one = evaluate(_FakeWorldModel(), _model(), [str(bag)], cfg, progress=False)
    other = evaluate(
        _FakeWorldModel(),
        _model(),
        [str(bag)],
        EvalConfig(**CONFIG, max_windows_per_bag=2),
        progress=False,
    )
    with pytest.raises(ValueError, match="different window sets"):
        live_vs_in_process(other, one)


def _eval(*args) -> tuple[int, dict, str]:
    proc = subprocess.run(
        [sys.executable, "-m", "physis_ros.eval.cli", *map(str, args), "--quiet"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    summary = json.loads(proc.stdout.strip().splitlines()[-1]) if proc.stdout.strip() else {}
    return proc.returncode, summary, proc.stderr


def test_compare_in_process_scores_the_live_windows_in_process_too(tmp_path):
    """physis-eval --serve-local --compare-in-process, the shipped push-wm: the live report
    carries live minus in process per horizon, the in-process report sits beside it, and
    both scored the same windows."""
    bag = record_small(tmp_path / "bag", duration_s=2.0, seed=22)
    out = tmp_path / "report"
    windows = ("--context-chunks", "2", "--horizon-chunks", "2", "--stride-chunks", "1")
    rc, summary, err = _eval(
        bag, "--serve-local", "--steps", "2", *windows, "--compare-in-process", "--out", out
    )
    assert rc == 0, err
    live = json.loads((out / "report.json").read_text())
    in_process = json.loads((out / "in_process" / "report.json").read_text())
    assert live["mode"] == "link" and in_process["mode"] == "in-process"
    # 20 frames, windows of 8 frames one chunk apart: anchors 3, 5, ..., 15
    assert live["window_set"] == in_process["window_set"] == {str(bag): list(range(3, 17, 2))}
    cmp = live["live_vs_in_process"]
    assert [e["chunk"] for e in cmp["by_chunk"]] == [1, 2]
    for e, line in zip(cmp["by_chunk"], summary["live_minus_in_process_db"], strict=True):
        assert e["windows"] == e["scored_in_process"] == 7
        assert e["copy_last"]["difference"] == 0.0 and line["copy_last"] == 0.0
        model = e["model"]
        assert line["model"] == model["difference"]
        assert model["live"] - model["in_process"] == pytest.approx(model["difference"])
        assert model["difference_p10"] <= model["difference_p90"]
        lo, hi = model["pooled_difference_interval"]
        assert lo <= hi and model["pooled_live"] - model["pooled_in_process"] == pytest.approx(
            model["pooled_difference"]
        )
    assert "## Live minus in process (the same windows)" in (out / "report.md").read_text()
    assert (out / "in_process" / "report.md").exists()
    rc, _, err = _eval(bag, "--compare-in-process", "--out", tmp_path / "alone")
    assert rc == 2 and "--compare-in-process compares a live run" in err
