"""physis-replay publishes a recorded bag into live ROS 2 at the recorded timing."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from physis_ros.children import stop_child
from physis_ros.eval.replay import restamp, supervise
from physis_ros.sim.record import EPOCH_S

from .bagtools import record_small, rewrite_bag

SUB = str(Path(__file__).parent / "replay_sub.py")


def test_restamp_moves_only_the_header_stamp():
    raw = (
        bytes([0, 1, 0, 0])
        + (5).to_bytes(4, "little")
        + (999_999_999).to_bytes(4, "little")
        + b"rest"
    )
    out = restamp(raw, 2)
    assert out[:4] == raw[:4] and out[12:] == b"rest"
    assert int.from_bytes(out[4:8], "little") == 6 and int.from_bytes(out[8:12], "little") == 1
    with pytest.raises(ValueError, match="too short"):
        restamp(b"\x00\x01\x00\x00", 0)


def test_a_replay_whose_ros_teardown_hangs_is_stopped_and_its_result_stands():
    """The worker printed its result, then hangs (as Fast DDS's node teardown once did in
    CI): the command stops it after the teardown timeout, says so and keeps the result."""
    result = {"published": {"/camera/image_raw": 3}}
    hanging = [
        sys.executable,
        "-c",
        f"import time; print({json.dumps(result)!r}, flush=True); time.sleep(3600)",
    ]
    t0 = time.monotonic()
    status, line = supervise(hanging, teardown_timeout_s=1.0)
    assert status == 0 and json.loads(line) == result
    assert time.monotonic() - t0 < 600  # stopped, not waited out


def test_a_worker_that_fails_before_its_result_keeps_its_status():
    status, line = supervise([sys.executable, "-c", "import sys; sys.exit(3)"])
    assert (status, line) == (3, "")


def _run_replay(cmd: list[str], env: dict, timeout_s: float) -> subprocess.CompletedProcess:
    """``cmd`` run to its end; one still running after ``timeout_s`` fails the test with every
    thread's stack (faulthandler on SIGABRT), so a hang says where it hung."""
    proc = subprocess.Popen(
        cmd,
        env={**env, "PYTHONFAULTHANDLER": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGABRT)
        try:
            out, err = proc.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
        pytest.fail(f"{cmd[0]} still running after {timeout_s} s; its stacks:\n{err[-6000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def _replay(bag: Path, env: dict, *extra: str) -> tuple[dict, dict]:
    sub = subprocess.Popen(
        [sys.executable, SUB, "21", "30"], env=env, stdout=subprocess.PIPE, text=True
    )
    try:
        assert sub.stdout.readline().strip() == "ready"
        t_start = time.monotonic()
        rep = _run_replay(
            [
                sys.executable,
                "-m",
                "physis_ros.eval.replay",
                str(bag),
                "--reliable",
                "--wait-subscribers-s",
                "15",
                *extra,
            ],
            env,
            timeout_s=60,
        )
        assert rep.returncode == 0, rep.stderr
        out, _ = sub.communicate(timeout=40)
    finally:
        stop_child(sub, timeout_s=20)  # SIGTERM: the subscriber destroys its node
    got = json.loads(out.strip().splitlines()[-1])
    got["t_start"] = t_start
    return json.loads(rep.stdout.strip().splitlines()[-1]), got


@pytest.mark.ros
def test_replay_publishes_every_message_at_recorded_timing_and_restamps(tmp_path, ros_env):
    bag = record_small(tmp_path / "bag", duration_s=2.0, seed=4)
    stats, got = _replay(bag, ros_env)
    assert stats["published"] == {
        "/camera/image_raw": 21,
        "/wrench": 101,
        "/joint_states": 101,
        "/joint_command": 100,
    }
    assert got["counts"] == stats["published"]
    recv = np.array([t for t, _ in got["images"]])
    stamps = np.array([s for _, s in got["images"]])
    # 10 Hz camera: receive spacing ~100 ms, total ~2 s; stamps keep the recorded 100 ms spacing
    assert abs(np.median(np.diff(recv)) - 0.1) < 0.03
    assert 1.5 < recv[-1] - recv[0] < 2.6  # 2.0 s recorded; a loaded host delays the first
    assert np.all(np.diff(stamps) == 100_000_000)
    # restamped: the first image carries roughly "now" (wall clock), not the recording's epoch
    assert abs(stamps[-1] - got["now_ns"]) < 10e9
    assert stamps[0] != (EPOCH_S + 3600 * 4) * 1_000_000_000


@pytest.mark.ros
def test_replay_keep_stamps_and_rate(tmp_path, ros_env):
    bag = record_small(tmp_path / "bag", duration_s=2.0, seed=4)
    stats, got = _replay(
        bag, ros_env, "--keep-stamps", "--rate", "4", "--topics", "/camera/image_raw"
    )
    assert stats["published"] == {"/camera/image_raw": 21}
    assert got["counts"]["/wrench"] == 0
    stamps = np.array([s for _, s in got["images"]])
    # the recording's own stamps (seed 4's epoch, 10 Hz), not "now"
    recorded = (EPOCH_S + 3600 * 4) * 1_000_000_000 + 100_000_000 * np.arange(21)
    assert len(stamps) >= 20 and np.all(np.isin(stamps, recorded)), stamps - recorded[0]
    assert np.all(np.diff(stamps) == 100_000_000)
    recv = np.array([t for t, _ in got["images"]])
    assert 0.4 < recv[-1] - recv[0] < 0.9  # 2 s at 4x


def _replay_raw(bag: Path, env: dict, *extra: str, image_topic: str, images: int):
    """(physis-replay's CompletedProcess, what the subscriber got) with the subscriber's
    camera topic ``image_topic``; it waits for ``images`` images (0: its report is not read)."""
    sub = subprocess.Popen(
        [sys.executable, SUB, str(max(images, 1)), "60", image_topic],
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    )
    got = {}
    try:
        assert sub.stdout.readline().strip() == "ready"
        rep = _run_replay(
            ["physis-replay", str(bag), "--reliable", "--wait-subscribers-s", "10", *extra],
            env,
            timeout_s=90,
        )
        if images:
            got = json.loads(sub.communicate(timeout=70)[0].strip().splitlines()[-1])
    finally:
        stop_child(sub, timeout_s=20)  # SIGTERM: the subscriber destroys its node
    return rep, got


@pytest.mark.ros
def test_replay_skips_a_corrupt_message_and_says_so(tmp_path, ros_env):
    """A truncated image record in the bag: not published (it would reach every subscriber
    as garbage), counted in the JSON and named on stderr; every other message goes out."""
    src = record_small(tmp_path / "bag", duration_s=1.0, seed=5)

    def truncate_third_image(topic, i, raw, _store):
        return raw[: len(raw) // 2] if topic == "/camera/image_raw" and i == 2 else raw

    bag = rewrite_bag(src, tmp_path / "damaged", edit=truncate_third_image)
    rep, got = _replay_raw(bag, ros_env, image_topic="/camera/image_raw", images=10)
    assert rep.returncode == 0, rep.stderr
    stats = json.loads(rep.stdout.strip().splitlines()[-1])
    (reason,) = [k for k in stats["skipped"] if k.startswith("/camera/image_raw")]
    assert "corrupt message" in reason and stats["skipped"][reason] == 1
    assert "/camera/image_raw: skipped a message: corrupt message" in rep.stderr
    assert "Traceback" not in rep.stderr
    assert stats["published"]["/camera/image_raw"] == 10  # 11 recorded, one skipped
    assert got["counts"]["/camera/image_raw"] == 10


@pytest.mark.ros
def test_replay_names_the_remap_when_the_camera_topic_differs(tmp_path, ros_env):
    """The bag's /camera/image_raw and a consumer on /camera/image: replay says that nobody
    listens and which remap reaches the consumer; with that remap the images arrive."""
    bag = record_small(tmp_path / "bag", duration_s=1.0, seed=6)
    rep, _ = _replay_raw(bag, ros_env, image_topic="/camera/image", images=0)
    assert rep.returncode == 0, rep.stderr
    assert "--remap /camera/image_raw:=/camera/image" in rep.stderr, rep.stderr
    stats = json.loads(rep.stdout.strip().splitlines()[-1])
    assert "/camera/image_raw" in stats["unheard"]
    rep, got = _replay_raw(
        bag,
        ros_env,
        "--remap",
        "/camera/image_raw:=/camera/image",
        image_topic="/camera/image",
        images=11,
    )
    assert rep.returncode == 0, rep.stderr
    # every topic heard; the one warning allowed is the middleware's teardown hang, which
    # this test's sequence (a subscriber leaving as the replay ends) met in 2 CI-like runs
    warnings = [w for w in rep.stderr.splitlines() if "warning" in w]
    assert all("ROS teardown did not end" in w for w in warnings), rep.stderr
    assert got["counts"]["/camera/image"] == 11


@pytest.mark.ros
def test_replay_that_publishes_nothing_fails_in_one_line(tmp_path, ros_env):
    """Every image of the bag is corrupt: each is skipped and named, and a replay that put
    nothing on the wire exits 1 with one line saying so (not 0 with an empty count)."""
    src = record_small(tmp_path / "bag", duration_s=0.5, seed=7)
    bag = rewrite_bag(src, tmp_path / "all_corrupt", edit=lambda _t, _i, raw, _s: raw[:10])
    rep = _run_replay(
        ["physis-replay", str(bag), "--topics", "/camera/image_raw", "--wait-subscribers-s", "0"],
        ros_env,
        timeout_s=90,
    )
    assert rep.returncode == 1, rep.stderr
    assert "Traceback" not in rep.stderr
    assert (
        rep.stderr.strip()
        .splitlines()[-1]
        .startswith(f"physis-replay: error: nothing was published from {bag}")
    ), rep.stderr
    stats = json.loads(rep.stdout.strip().splitlines()[-1])
    assert stats["published"] == {} and sum(stats["skipped"].values()) == 6, stats
