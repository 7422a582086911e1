"""Admission in the real server (physis-serve, one process, tiny model, a given cost profile so
that what is admitted does not depend on this machine's load): robot clients get promises
predicted for the pool with their stream, the streams already there are told their revised
promise when one joins or leaves, one too many is refused with RESOURCE_EXHAUSTED and the
reason, GetServerInfo reports promised against measured, and the static policy is selectable.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import grpc
import numpy as np
import pytest

from physis_ros.children import stop_child
from physis_ros.link.client import LinkClient, Observation
from physis_ros.link.proto_gen import physis_pb2 as pb
from physis_ros.link.proto_gen import physis_pb2_grpc as pb_grpc
from physis_ros.link.wire import rgb_image

REPO_ROOT = Path(__file__).resolve().parents[2]
PROFILE = {  # tiny, K=4, W=2: one block forward 1 ms alone, 1.6 ms for 4 tasks
    "device": "test",
    "model": "tiny",
    "steps": 4,
    "window": 2,
    "dtype": "float32",
    "entries": [
        {"tasks": 1, "ms_p50": 1.0, "ms_p99": 1.2},
        {"tasks": 4, "ms_p50": 1.6, "ms_p99": 2.0},
        {"tasks": 16, "ms_p50": 4.0, "ms_p99": 5.0},
    ],
    "hop_ms": 0.05,
    "task_overhead_ms": 0.1,
}


@pytest.fixture
def serve(tmp_path):
    """Start physis-serve with the given flags; yields a function that does, and stops them."""
    procs = []

    def start(*flags: str) -> str:
        (tmp_path / "profile.json").write_text(json.dumps(PROFILE))
        config = tmp_path / "serve.yaml"
        config.write_text(
            "engine: {model: tiny, steps: 4, window: 2}\n"
            f"placement: {{workers: 1, profile: {tmp_path / 'profile.json'}}}\n"
            "pool: {max_utilization: 0.9}\n"
        )
        port_file = tmp_path / f"port{len(procs)}"
        log = open(tmp_path / f"serve{len(procs)}.log", "wb")  # noqa: SIM115 - closed below
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO_ROOT))
        cmd = [sys.executable, "-m", "physis_ros.serve.main", "--config", str(config)]
        cmd += ["--port", "0", "--port-file", str(port_file), *flags]
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
        procs.append((proc, log))
        deadline = time.monotonic() + 120
        while not port_file.exists():
            assert proc.poll() is None, (tmp_path / f"serve{len(procs) - 1}.log").read_text()
            assert time.monotonic() < deadline, "physis-serve did not start"
            time.sleep(0.1)
        return f"127.0.0.1:{int(port_file.read_text())}"

    yield start
    for proc, log in procs:
        stop_child(proc)
        log.close()


def _open(target: str, seed: int, target_ms: float) -> tuple[LinkClient, str]:
    client = LinkClient(target, seed=seed, target_interval_ms=target_ms, connect_timeout_s=20)
    client.start()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        stats = client.stats()
        if stats.state == "streaming":
            return client, ""
        if stats.last_error:
            client.close()
            return client, stats.last_error
        time.sleep(0.02)
    raise AssertionError(f"stream {seed} neither admitted nor refused: {client.stats()}")


def _feed_until(clients: list[LinkClient], done, timeout_s: float = 60.0) -> None:
    """Send observations and take predictions until ``done()``."""
    seq = 0
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, [c.stats() for c in clients]
        for c in clients:
            c.send_observation(
                Observation(
                    seq=seq,
                    capture_stamp_ns=time.time_ns(),
                    image=rgb_image(np.full((16, 16, 3), seq % 255, np.uint8)),
                    action=np.zeros(4, np.float32),
                )
            )
            while c.get_prediction(0.0) is not None:
                pass
        seq += 1
        time.sleep(0.03)


def _info(target: str) -> pb.ServerInfo:
    with grpc.insecure_channel(target) as channel:
        return pb_grpc.PhysisStub(channel).GetServerInfo(pb.ServerInfoRequest(), timeout=10)


def test_promises_are_revised_for_everyone_and_one_too_many_is_refused(serve):
    target = serve()
    clients = []
    try:
        for seed in range(3):
            client, refused = _open(target, seed, 32.0)
            assert not refused
            clients.append(client)
            if seed == 0:
                first = client.stats().promise
        assert first.target_interval_ms == 32.0 and first.expected_interval_ms >= 32.0
        # the third joined: the two before it are told their new promise on their streams
        _feed_until(clients, lambda: all(c.stats().promise.revision >= 1 for c in clients[:2]))
        assert clients[2].stats().promise.revision == 0
        revised = clients[0].stats().promise
        assert revised.expected_response_latency_ms > first.expected_response_latency_ms
        _, refused = _open(target, 9, 32.0)
        assert refused.startswith("RESOURCE_EXHAUSTED")
        assert "compute" in refused and "32.0 ms" in refused
        # promised against measured, per stream
        _feed_until(clients, lambda: all(s.response_latency_ms > 0 for s in _info(target).streams))
        streams = {s.stream_id: s for s in _info(target).streams}
        mine = streams[first.stream_id]
        assert mine.promised_interval_ms == pytest.approx(revised.expected_interval_ms)
        assert mine.promised_response_latency_ms == pytest.approx(
            revised.expected_response_latency_ms
        )
        assert mine.promise_revision == 1
        # the third leaves: the others are told again
        clients.pop().close()
        _feed_until(clients, lambda: all(c.stats().promise.revision >= 2 for c in clients))
    finally:
        for c in clients:
            c.close()


def test_static_policy_is_selectable_and_gives_each_stream_its_own_worker(serve):
    target = serve("--policy", "static", "--plan", "even")
    info = _info(target)
    assert info.engine["policy"] == "static"
    assert "by hand (even)" in info.placement
    client, refused = _open(target, 0, 200.0)
    try:
        assert not refused
        busy = [k for k, v in _info(target).engine.items() if k.startswith("device")]
        assert busy == ["device0"]  # one worker (placement workers: 1)
        assert not _info(target).engine["device0"].startswith("utilization 0%")
    finally:
        client.close()
