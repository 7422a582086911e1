"""physis-eval over the link: horizons from the server's chunk counter, a real physis-serve
on an ephemeral port, and an unreachable one."""

from __future__ import annotations

import contextlib
import json
import math
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from physis_ros.eval.bag import Episode
from physis_ros.eval.evaluate import EvalConfig
from physis_ros.eval.link_replay import ReplayLink, replay_bag
from physis_ros.eval.local_server import LocalServer
from physis_ros.link.client import Prediction
from physis_ros.link.options import LinkOptions

from .bagtools import record_small

# the front end's fake engine lives with the link tests
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "link"))
from link_fake_engine import FakeEngine


def _episode(n: int, frames_hz: float = 25.0) -> Episode:
    """Frame i is all i: a prediction's or context chunk's pixels name their frame."""
    frames = np.stack([np.full((16, 16, 3), i, np.uint8) for i in range(n)])
    return Episode(
        path="synthetic",
        storage="none",
        image_topic="/camera",
        frames=frames,
        frame_stamps_ns=np.arange(n, dtype=np.int64) * int(1e9 / frames_hz),
        source_size=(16, 16),
    )


def _pred(chunk: int, anchor: int, frames_per_chunk: int = 2) -> Prediction:
    first = chunk * frames_per_chunk
    return Prediction(
        stream_id=1,
        chunk_index=chunk,
        frames=np.stack([np.full((16, 16, 3), first + i, np.uint8) for i in range(2)]),
        actions=None,
        observation_seq=-1 if anchor < 0 else (anchor + 1) * frames_per_chunk - 1,
        observation_stamp_ns=0,
        server_times_ns={"entered": 0, "decoded": 1_000_000},
        received_ns=10**9,
        hop_ms={},
        anchor_slot=anchor,
        horizon=chunk - anchor if anchor >= 0 else 0,
        first_frame_seq=first,
    )


def _world_model(frames_per_chunk: int):
    """A 16x16 world model without actions, as the evaluator sees it."""
    from physis_ros.eval.evaluate import ModelInfo

    return ModelInfo(
        name="m",
        frames_per_chunk=frames_per_chunk,
        image_height=16,
        image_width=16,
        action_horizon=0,
        action_dim=0,
        action_mode="none",
    )


def test_predictions_are_scored_at_their_horizon_against_the_frames_they_stand_for():
    """Each prediction goes to its anchor's window at horizon step (j-1)F + i, compared with
    frame first_frame_seq + i; copy-last is the anchor's newest frame."""
    from physis_ros.eval.link_eval import anchoring, score_bag
    from physis_ros.eval.link_replay import BagReplay

    ep = _episode(20)
    model = _world_model(2)
    # horizon 2: anchor 0 -> chunks 1, 2; anchor 1 -> 3; anchor 2 -> 4; one unanchored; one
    # beyond the evaluated horizon; one past the end of the bag
    preds = [_pred(3, -1), _pred(1, 0), _pred(2, 0), _pred(3, 1), _pred(4, 2)]
    preds += [_pred(6, 2), _pred(10, 8)]
    replay = BagReplay(
        horizon=2,
        frames_sent=20,
        sent_ns={i: 10**9 - 5_000_000 for i in range(20)},
        predictions=preds,
        newest_sent=[5, 3, 3, 5, 7, 9, 19],
    )
    windows, unscored, _ = score_bag(ep, replay, model, EvalConfig(horizon_chunks=2))
    assert [w.start_frame for w in windows] == [1, 3, 5]  # anchors' newest frames
    first = windows[0]
    # the frames are what they stand for: exact predictions (capped PSNR) at every step
    assert first.psnr == [100.0] * 4
    assert first.baseline_psnr[0] == pytest.approx(psnr_of(1, 2))
    assert windows[1].psnr == [None, None, 100.0, 100.0]  # anchor 1: chunk 3 only, j = 2
    assert unscored == {
        "no anchor (no observation yet)": 1,
        "beyond the evaluated horizon (2 chunks)": 1,
        "predicts past the end of the bag": 1,
    }
    lag = anchoring(replay)
    assert lag["frames"][:2] == [2.0, 2.0] and lag["ms"][0] == pytest.approx(5.0)


def psnr_of(a: int, b: int) -> float:
    return 10 * math.log10(255**2 / (a - b) ** 2)


@contextlib.contextmanager
def _fake_server(engine):  # a world model with horizon 3: rollouts unless a stream says no
    from physis_ros.serve.engine_loop import EngineLoop
    from physis_ros.serve.frontend_config import FrontendConfig, ServerDescription
    from physis_ros.serve.server import start_server

    loop = EngineLoop(engine)
    loop.start()
    handle = start_server(
        loop,
        config=FrontendConfig(port=0),
        description=ServerDescription(model="fake", steps=2, blocks=2, horizon=3),
    )
    try:
        yield handle
    finally:
        handle.stop()
        loop.stop()


@pytest.mark.parametrize("realtime", [False, True], ids=["as-fast-as-taken", "realtime"])
def test_anchors_are_the_slots_the_server_observed(realtime):
    """Against the real front end: each prediction's anchor is the slot whose observation
    the engine got last before it, its frames stand for first_frame_seq on, and every slot
    up to the horizon is predicted (3 chunks at the start, then one per observed slot)."""
    ep = _episode(16)
    engine = FakeEngine(slots=1, chunk_ms=2.0, chunk_frames=2)
    with _fake_server(engine) as handle:
        replay = replay_bag(
            ep,
            ReplayLink(
                target=f"127.0.0.1:{handle.port}",
                link=LinkOptions(connect_timeout_s=5.0, rollouts=False),
            ),
            EvalConfig(realtime=realtime, poll_timeout_s=20.0),
            seed=0,
            send_actions=False,
        )
    assert not replay.notes, replay.notes
    observed = [slot for _s, slot, _mean in engine.contexts]
    assert observed == list(range(8))  # 16 frames, 2 per slot, each slot once, in order
    # the context chunk of slot t is frames 2t and 2t + 1
    got = [[int(f[0, 0, 0]) for f in frames] for _s, frames in engine.context_frames]
    assert got == [[2 * t, 2 * t + 1] for t in range(8)]
    chunks = sorted(p.chunk_index for p in replay.predictions)
    assert chunks == list(range(1, 8 + 3))  # slots 1..10: up to the last observed + 3
    for p in replay.predictions:
        assert 1 <= p.horizon <= 3 and p.horizon == p.chunk_index - p.anchor_slot
        assert p.observation_seq == 2 * p.anchor_slot + 1 and p.first_frame_seq == 2 * p.chunk_index
    # after the start, each observed slot released exactly the slot 3 ahead of it
    assert sorted(p.horizon for p in replay.predictions).count(3) == 8
    assert not replay.drops


def test_with_rollouts_every_anchor_is_scored_at_every_horizon():
    """The server's default for a world model: each observed slot gets slots +1..+3 from it,
    so one stream fills every horizon of every window it scores."""
    ep = _episode(16)
    engine = FakeEngine(slots=1, chunk_ms=2.0, chunk_frames=2)
    with _fake_server(engine) as handle:
        replay = replay_bag(
            ep,
            ReplayLink(target=f"127.0.0.1:{handle.port}", link=LinkOptions(connect_timeout_s=5.0)),
            EvalConfig(poll_timeout_s=20.0),
            seed=0,
            send_actions=False,
        )
    assert not replay.notes and not replay.drops, (replay.notes, replay.drops)
    by_anchor: dict = {}
    for p in replay.predictions:
        by_anchor.setdefault(p.anchor_slot, []).append(p.horizon)
        assert p.chunk_index == p.anchor_slot + p.horizon
    assert by_anchor == {a: [1, 2, 3] for a in range(8)}
    from physis_ros.eval.link_eval import score_bag

    windows, unscored, _ = score_bag(ep, replay, _world_model(2), EvalConfig(horizon_chunks=3))
    full = [w for w in windows if all(v is not None for v in w.psnr)]
    # 8 slots: the rollouts of anchors 5, 6, 7 reach 1, 2, 3 slots past the end of the bag
    # (anchor 7's lies past it whole: no window)
    assert len(full) == 5 and len(windows) == 7
    assert unscored == {"predicts past the end of the bag": 1 + 2 + 3}


def _env() -> dict:
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = "1"
    return env


def _eval(*args, timeout_s: float = 120.0) -> tuple[int, dict, str]:
    proc = subprocess.run(
        [sys.executable, "-m", "physis_ros.eval.cli", *map(str, args), "--quiet"],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
        env=_env(),
    )
    summary = json.loads(proc.stdout.strip().splitlines()[-1]) if proc.stdout.strip() else {}
    return proc.returncode, summary, proc.stderr


@pytest.fixture(scope="module")
def push_wm_server(tmp_path_factory):
    """physis-serve with the shipped push-wm (32x32) on an ephemeral 127.0.0.1 port."""
    from physis_ros.weights import engine_kwargs

    log = tmp_path_factory.mktemp("serve") / "serve.log"
    with LocalServer(engine_kwargs(), log) as server:
        yield server
    assert server.proc.returncode is not None  # stopped


def test_eval_over_the_link_scores_every_horizon_step(push_wm_server, tmp_path):
    bag = record_small(tmp_path / "bag", duration_s=4.0, seed=11)
    out = tmp_path / "report"
    rc, summary, err = _eval(
        bag,
        tmp_path / "missing_bag",
        "--link",
        push_wm_server.target,
        "--realtime",
        "--horizon-chunks",
        "2",
        "--horizons",
        "1,2",
        "--out",
        out,
    )
    assert rc == 0, err
    assert summary["mode"] == "link" and summary["windows"] > 0
    report = json.loads((out / "report.json").read_text())
    assert report["mode"] == "link" and report["engine"]["served_by"] == push_wm_server.target
    assert len(report["horizon"]) == 4  # 2 chunks x 2 frames
    # Live semantics: horizon h is scored when the server makes h chunks from one observation
    # before the next one (10 Hz, --realtime) replaces it. An idle machine makes several; on
    # a busy one a chunk can take longer than a frame period, and only horizon 1 is reached.
    # So what must be scored follows from the interval measured in this run.
    frame_ms = 100.0
    interval_ms = report["latency"]["interval_ms"]["median"]
    for entry in report["horizon"]:
        if entry["chunk"] == 1 or entry["chunk"] * interval_ms < 0.5 * frame_ms:
            assert entry["windows"] > 0, (entry, interval_ms)
        if entry["windows"] == 0:
            continue
        assert math.isfinite(entry["psnr"]) and math.isfinite(entry["baseline_psnr"])
        assert entry["ssim"] is not None and entry["baseline_action_mse"] is not None
        assert entry["action_mse"] is None  # push-wm is conditioned on the commands
    link = report["link"]
    # one stream per horizon: every step is scored whatever the machine's load
    assert link["predictions_scored"] > 0 and link["streams_opened"] == 2
    assert link["horizons"] == [1, 2]
    assert link["anchoring_lag_frames"]["count"] > 0 and link["rate"]["predictions_per_s"] > 0
    assert link["promise"]["model"] == "push-wm"
    hops = report["latency"]["hop_ms"]
    for hop in ("uplink", "server_queue", "pipeline", "downlink", "capture_to_received"):
        assert hops[hop]["count"] > 0 and hops[hop]["median"] >= 0, hop
    assert isinstance(link["drops"], dict)
    assert report["latency"]["interval_ms"]["count"] > 0
    assert "missing_bag" in report["skipped_bags"][0]["path"] and "skipped bag" in err
    md = (out / "report.md").read_text()
    assert "Over the link" in md and "## Link" in md


def test_unreachable_server_is_a_clear_error_and_exit_1(tmp_path):
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    bag = record_small(tmp_path / "bag", duration_s=1.0, seed=12)
    t0 = time.monotonic()
    rc, summary, err = _eval(
        bag, "--link", f"127.0.0.1:{port}", "--connect-timeout", "1", "--out", tmp_path / "r"
    )
    assert rc == 1 and summary["windows"] == 0
    assert f"127.0.0.1:{port}" in err and "no stream from physis-serve" in err
    assert time.monotonic() - t0 < 20


def test_serve_local_as_fast_as_the_server_takes_them(tmp_path):
    """--serve-local: a physis-serve child with the in-process settings, stopped afterwards;
    without --realtime each observation goes out once the previous one was used."""
    bag = record_small(tmp_path / "bag", duration_s=2.0, seed=13)
    out = tmp_path / "report"
    rc, _, err = _eval(bag, "--serve-local", "--steps", "2", "--out", out)
    assert rc == 0, err
    report = json.loads((out / "report.json").read_text())
    assert report["mode"] == "link" and report["engine"]["steps"] == 2
    assert "--serve-local" in report["engine"]["served_by"]
    assert report["horizon"][0]["windows"] > 0 and math.isfinite(report["horizon"][0]["psnr"])
    # fast replay: no observation was superseded, on either side
    assert not any("superseded" in k for k in report["link"]["drops"]), report["link"]["drops"]
    assert "capture_to_received" not in report["latency"]["hop_ms"]  # not at capture timing
    assert "shutting down" in (out / "serve.log").read_text()  # the child was stopped


def test_refused_stream_is_a_clear_error_and_exit_1(tmp_path):
    """A server that wants a token the client lacks: its reason, at once (no retrying)."""
    from physis_ros.weights import engine_kwargs

    (tmp_path / "token").write_text("s3cret\n")
    (tmp_path / "wrong").write_text("guess\n")
    bag = record_small(tmp_path / "bag", duration_s=1.0, seed=14)
    server_args = ("--token-file", str(tmp_path / "token"))
    with LocalServer(engine_kwargs(), tmp_path / "serve.log", extra_args=server_args) as server:
        t0 = time.monotonic()
        rc, summary, err = _eval(
            bag, "--link", server.target, "--token-file", tmp_path / "wrong", "--out", tmp_path
        )
        took_s = time.monotonic() - t0
    assert rc == 1 and summary["windows"] == 0
    assert "refused the stream: UNAUTHENTICATED" in err
    assert took_s < 15  # not retried until --connect-timeout (5 s) and beyond


def test_previews_are_scored_by_step_apart_from_the_chunks(tmp_path):
    """--previews: the stream asks for each chunk's x0 estimate after steps 1..K-1; the report
    scores them per step against the chunk and the recorded frames, and says how much sooner
    they came; the chunks themselves are scored as without previews."""
    bag = record_small(tmp_path / "bag", duration_s=2.0, seed=13)
    out = tmp_path / "report"
    rc, _, err = _eval(bag, "--serve-local", "--steps", "4", "--previews", "--out", out)
    assert rc == 0, err
    report = json.loads((out / "report.json").read_text())
    pv = report["link"]["previews"]
    assert pv["steps"] == 4 and sorted(pv["by_step"]) == ["1", "2", "3"]
    chunks = report["link"]["predictions_received"]
    vs_chunk = []
    for _k, e in sorted(pv["by_step"].items()):
        assert 0 < e["vs_chunk_db"]["count"] <= chunks  # previews are not counted as chunks
        assert e["earlier_ms"]["min"] > 0  # every preview came before its chunk
        assert e["vs_recorded_db"]["count"] == e["chunk_vs_recorded_db"]["count"] > 0
        vs_chunk.append(e["vs_chunk_db"]["mean"])
    assert vs_chunk == sorted(vs_chunk)  # later steps are closer to the chunk
    # the later the preview, the less sooner it is
    sooner = [pv["by_step"][k]["earlier_ms"]["median"] for k in ("1", "2", "3")]
    assert sooner == sorted(sooner, reverse=True)
    assert report["horizon"][0]["windows"] > 0 and math.isfinite(report["horizon"][0]["psnr"])
    assert "## Previews (x0 estimate after k of 4 steps)" in (out / "report.md").read_text()
    rc, _, err = _eval(bag, "--previews", "--out", tmp_path / "in_process")
    assert rc == 2 and "--previews scores what a physis-serve streams" in err
