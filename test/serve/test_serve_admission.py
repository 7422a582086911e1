"""Admission in the real server (physis-serve, one process, tiny model, a given cost profile so
that what is admitted does not depend on this machine's load): robot clients get promises
predicted for the pool with their stream, the streams already there are told their revised
promise when one joins or leaves, one too many is refused with RESOURCE_EXHAUSTED and the
reason, GetServerInfo reports promised against measured, the static policy is selectable, and
a response-latency budget is kept: a stream whose budget no placement meets is refused, and one
that would push an admitted stream past its budget is refused too.
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

    def start(*flags: str, profile: dict = PROFILE, recalibrate: bool = False) -> str:
        """``recalibrate`` False: the profile's costs throughout, whatever this host
        measures (the admissions below are the profile's)."""
        (tmp_path / "profile.json").write_text(json.dumps(profile))
        config = tmp_path / "serve.yaml"
        config.write_text(
            "engine: {model: tiny, steps: 4, window: 2}\n"
            f"placement: {{workers: 1, profile: {tmp_path / 'profile.json'}}}\n"
            f"pool: {{max_utilization: 0.9, recalibrate: {str(recalibrate).lower()}}}\n"
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


def _open(
    target: str, seed: int, target_ms: float, budget_ms: float = 0.0
) -> tuple[LinkClient, str]:
    client = LinkClient(
        target,
        seed=seed,
        target_interval_ms=target_ms,
        response_latency_budget_ms=budget_ms,
        connect_timeout_s=20,
    )
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


def test_a_promise_follows_the_latency_measured_while_serving(serve):
    """A profile 20x faster than this host: the first promise is far too optimistic; the
    chunks' measured latencies scale the pool's costs and the stream is told a new promise."""
    fast = {
        **PROFILE,
        "entries": [{**e, "ms_p50": e["ms_p50"] / 20, "ms_p99": e["ms_p99"] / 20}
                    for e in PROFILE["entries"]],
    }  # fmt: skip
    target = serve(profile=fast, recalibrate=True)
    client, refused = _open(target, 0, 100.0)
    try:
        assert not refused
        first = client.stats().promise
        _feed_until([client], lambda: client.stats().promise.revision >= 1)
        revised = client.stats().promise
        assert revised.expected_response_latency_ms > 2 * first.expected_response_latency_ms
        assert float(_info(target).engine["measured_slowdown"]) > 2.0
    finally:
        client.close()


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


def test_latency_budgets_are_admitted_only_where_the_promise_keeps_them(serve):
    """physis-serve's pool admits with the stream's response-latency budget: a budget under
    what any placement gives is refused (RESOURCE_EXHAUSTED, resource latency, the closest
    placement named); a budget over the promise is admitted with a promise within it; a later
    stream that would push that promise past its budget is refused, one without that effect
    is admitted."""
    target = serve()
    clients = []
    try:
        probe, refused = _open(target, 0, 32.0)
        assert not refused
        alone_ms = probe.stats().promise.expected_response_latency_ms
        probe.close()
        deadline = time.monotonic() + 30
        while _info(target).engine["open_streams"] != "0":
            assert time.monotonic() < deadline, "the probe's stream was not closed"
            time.sleep(0.05)
        _, refused = _open(target, 1, 32.0, budget_ms=alone_ms / 2)
        assert refused.startswith("RESOURCE_EXHAUSTED"), refused
        assert "latency" in refused and f"> budget {alone_ms / 2:.1f} ms" in refused
        assert "best:" in refused  # the placement that came closest
        # A budget just over the promise alone: admitted, promised within it.
        budget = alone_ms * 1.001
        kept, refused = _open(target, 2, 32.0, budget_ms=budget)
        assert not refused, refused
        clients.append(kept)
        assert kept.stats().promise.expected_response_latency_ms <= budget
        # Streams without a budget join beside it until one would queue ahead of its chunks
        # past its budget (the pool's compute alone takes three at 32 ms: test above).
        for seed in range(3, 6):
            other, refused = _open(target, seed, 32.0)
            if refused:
                break
            clients.append(other)
        assert refused.startswith("RESOURCE_EXHAUSTED"), refused
        assert "latency" in refused and "admitted stream" in refused and "its budget" in refused
        _feed_until(clients, lambda: kept.stats().predictions_received >= 3)
        assert kept.stats().promise.expected_response_latency_ms <= budget  # revised or not
    finally:
        for c in clients:
            c.close()
