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
from physis_ros.eval.link_replay import LinkOptions, horizons, replay_bag
from physis_ros.eval.local_server import LocalServer
from physis_ros.link.client import Prediction

from .bagtools import record_small

# the front end's fake engine lives with the link tests
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "link"))
from link_fake_engine import FakeEngine


def _pred(chunk: int, seq: int, stream: int = 1) -> Prediction:
    return Prediction(
        stream_id=stream,
        chunk_index=chunk,
        frames=None,
        actions=None,
        observation_seq=seq,
        observation_stamp_ns=0,
        server_times_ns={},
        received_ns=0,
        hop_ms={},
    )


def test_horizon_is_chunks_after_the_context_chunk_and_unknown_after_a_loss():
    # stream 1: 0 unconditioned | ctx 1 | 2 3 4 (seq 5) | ctx 5 | 6 7 (seq 6) | ctx 8 | 9 (seq 7,
    # lost) | ctx 10 | 11 12 (seq 8) | ctx 13 | 14 15(lost) 16 (seq 9); stream 2: ctx 0 | 1 (seq 0)
    received = [(0, -1), (2, 5), (3, 5), (4, 5), (6, 6), (7, 6), (11, 8), (12, 8), (14, 9), (16, 9)]
    preds = [_pred(c, s) for c, s in received] + [_pred(1, 0, stream=2)]
    known, unscored = horizons(preds[::-1])  # arrival order does not matter
    got = sorted((p.stream_id, p.chunk_index, h) for p, h in known)
    assert got == [
        (1, 2, 1),
        (1, 3, 2),
        (1, 4, 3),
        (1, 6, 1),
        (1, 7, 2),
        (1, 14, 1),
        (1, 16, 3),
        (2, 1, 1),
    ]
    assert unscored == {
        "unconditioned (no observation yet)": 1,
        "horizon unknown (predictions before it were lost)": 2,
    }


@contextlib.contextmanager
def _fake_server(engine):
    from physis_ros.serve.frontend import FrontendConfig, ServerDescription, start_server
    from physis_ros.serve.session import EngineLoop

    loop = EngineLoop(engine)
    loop.start()
    handle = start_server(
        loop,
        config=FrontendConfig(port=0),
        description=ServerDescription(model="fake", steps=2, blocks=2),
    )
    try:
        yield handle
    finally:
        handle.stop()
        loop.stop()


def test_horizons_match_the_context_chunks_the_server_put_in():
    """Against the real front end: the chunk index the engine gave each observation's
    context chunk is the prediction's index minus its horizon, for every prediction."""
    n, period_ns = 16, 40_000_000  # the engine makes ~8 chunks per observation: h up to ~8
    frames = np.stack([np.full((16, 16, 3), i, np.uint8) for i in range(n)])
    ep = Episode(
        path="synthetic",
        storage="none",
        image_topic="/camera",
        frames=frames,
        frame_stamps_ns=np.arange(n, dtype=np.int64) * period_ns,
        source_size=(16, 16),
    )
    engine = FakeEngine(slots=1, chunk_ms=5.0)
    with _fake_server(engine) as handle:
        replay = replay_bag(
            ep,
            LinkOptions(target=f"127.0.0.1:{handle.port}", connect_timeout_s=5.0),
            EvalConfig(realtime=True, poll_timeout_s=10.0),
            seed=0,
            send_actions=False,
        )
    known, unscored = horizons(replay.predictions)
    # frame i is all i, so a context chunk's mean pixel names its observation
    ctx_chunk = {round(mean * 255): chunk for _s, chunk, mean in engine.contexts}
    assert known and max(h for _, h in known) >= 3
    for p, h in known:
        assert h >= 1 and ctx_chunk[p.observation_seq] == p.chunk_index - h
    lost = {k: v for k, v in replay.drops.items() if "slow" in k or "queue_full" in k}
    if not lost:  # nothing lost (as on loopback, normally): every horizon is known
        conditioned = sum(p.observation_seq >= 0 for p in replay.predictions)
        assert len(known) == conditioned
        assert set(unscored) <= {"unconditioned (no observation yet)"}


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
    assert link["predictions_scored"] > 0 and link["streams_opened"] == 1
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
