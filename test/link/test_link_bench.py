"""`physis-bench link --json` runs end to end (short) and reports what it promises."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import numpy as np
import pytest
from link_server import REPO_ROOT, child_env

from physis_ros.bench.bare_grpc import BareClient
from physis_ros.bench.link import _start_child
from physis_ros.children import stop_child
from physis_ros.link.wire import Observation, rgb_image, serialize_observation

CHILD = """
import contextlib, io, json, sys
from physis_ros.bench.cli import main
out = io.StringIO()
with contextlib.redirect_stdout(out):
    rc = main(["link", "--json", "--samples", "40", "--warmup", "5", "--rate-hz", "50",
               "--rounds", "2", "--breakdown"])
print(json.dumps({"rc": rc, "result": json.loads(out.getvalue()),
                  "torch_loaded": "torch" in sys.modules}))
"""


def test_bench_link_json():
    proc = subprocess.run(
        [sys.executable, "-c", CHILD],
        cwd=REPO_ROOT,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["rc"] == 0
    assert not report["torch_loaded"], "the link bench must not need torch"
    result = report["result"]
    for payload, nbytes in (
        ("observation_rgb8_640x480", 640 * 480 * 3),
        ("actions_16x7", 16 * 7 * 4),
    ):
        r = result[payload]
        assert r["payload_bytes"] == nbytes
        assert r["samples"] >= 20
        for key in ("added_ms_median", "added_ms_p99", "inproc_ms_median"):
            assert math.isfinite(r[key]), (payload, key, r)
        assert r["inproc_ms_median"] > 0
        # The link path contains the in-process work, plus the wire: never faster than it.
        assert r["link_ms_median"] > r["inproc_ms_median"]
        assert r["added_ms_p99"] >= r["added_ms_median"] > 0
    assert isinstance(result["meets_target"], bool)
    actions = result["actions_16x7"]
    assert 0 < actions["server_ms_median"] < actions["link_ms_median"]
    # The observation -> action reply against the bare gRPC streams, side by side per round.
    trips = result["round_trip"]
    assert trips["target_ratio"] == 1.2
    for name in ("vs_bare_echo", "vs_bare_slotted", "vs_bare_read", "vs_bare_slotted_read"):
        rt = trips[name]
        assert len(rt["rounds"]) == 2, rt
        assert rt["bare_ms_median"] > 0 and rt["link_ms_median"] > 0
        assert rt["ratio_median_of_rounds"] > 0
        # the target is the issue's, against the streams that read nothing; the others bound
        assert ("meets_target_ratio" in rt) == (name in ("vs_bare_echo", "vs_bare_slotted"))
        for r in rt["rounds"]:
            assert r["ratio"] == pytest.approx(r["link_ms_median"] / r["bare_ms_median"], 0.01)
    floors = trips["floors_over_echo"]
    assert set(floors) == {"Read", "SlottedRead"}
    assert all(math.isfinite(f) and f > 0 for f in floors.values()), floors
    # Where the link's time goes: every step measured on most of the pairs.
    b = result["breakdown"]
    assert b["pairs"] >= 20
    assert len(b["segments_ms_median"]) == 6
    assert all(ms >= 0 for ms in b["segments_ms_median"].values())
    assert set(b["cpu_us_median_per_call"]) == set(b["cpu_us_warm_back_to_back"])
    # the same steps alone after a sleep: measured, each a positive processor time
    after_pause = b["cpu_us_alone_after_20ms_sleep"]
    assert set(after_pause) == set(b["cpu_us_warm_back_to_back"])
    assert all(us > 0 for us in after_pause.values())


def test_the_read_baselines_parse_what_they_are_sent_and_the_echo_does_not(tmp_path):
    """The bounds the link is held to: ``Read`` and ``SlottedRead`` read each message (a
    malformed one ends the call), ``Echo`` answers anything unread."""
    child, port = _start_child("--serve-bare", tmp_path / "bare")
    clients = {}
    try:
        image = rgb_image(np.zeros((480, 640, 3), np.uint8))
        raw = serialize_observation(
            Observation(seq=3, capture_stamp_ns=1, image=image), send_stamp_ns=2
        )
        head, pixels = raw[: len(raw) - len(image.data)], image.data
        assert head + pixels == raw
        for method in ("Echo", "Read", "SlottedRead"):
            clients[method] = BareClient(f"127.0.0.1:{port}", method)
        malformed = (b"\xff" * 64,)
        assert clients["Echo"].round_trip_ms(malformed, timeout_s=60) > 0
        for method in ("Read", "SlottedRead"):
            # the slotted reply's wait for its slot (<= 20 ms here) is left out
            assert clients[method].round_trip_ms((head, pixels), timeout_s=60) > 0
            with pytest.raises(RuntimeError, match="bare stream ended"):
                clients[method].round_trip_ms(malformed, timeout_s=60)
    finally:
        for client in clients.values():
            client.close()
        stop_child(child)
