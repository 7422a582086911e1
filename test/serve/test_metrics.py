"""physis-serve's Prometheus metrics: a real server (tiny model on CPU, ephemeral ports, a given
cost profile so that admission does not depend on this machine's load) scraped over HTTP
while a stream runs: the figures move (chunks, latency histogram), the stream's gauges are
there and go when it closes, a refused OpenStream is counted by resource; without a metrics
port the server opens no port but its gRPC one; the flags and the YAML key are checked before
anything loads."""

from __future__ import annotations

import itertools
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from physis_ros.children import stop_child
from physis_ros.cli_errors import CliError, UsageError
from physis_ros.link.client import LinkClient, Observation
from physis_ros.link.wire import rgb_image
from physis_ros.serve.config import checked_frontend
from physis_ros.serve.main import parse_args
from physis_ros.serve.metrics import BusyFractions, WorkerSample

REPO_ROOT = Path(__file__).resolve().parents[2]
PROFILE = {  # tiny, K=4, W=2 (as test_serve_admission.py)
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
    """Starts physis-serve with the given flags; yields a function that does (-> the process,
    its gRPC target), and stops them."""
    procs = []

    def start(*flags: str) -> tuple[subprocess.Popen, str]:
        (tmp_path / "profile.json").write_text(json.dumps(PROFILE))
        config = tmp_path / "serve.yaml"
        config.write_text(
            "engine: {model: tiny, steps: 4, window: 2}\n"
            f"placement: {{workers: 1, profile: {tmp_path / 'profile.json'}}}\n"
            "pool: {max_utilization: 0.9, recalibrate: false}\n"
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
        return proc, f"127.0.0.1:{int(port_file.read_text())}"

    yield start
    for proc, log in procs:
        stop_child(proc)
        log.close()


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    """(sample name, sorted labels) -> value, from /metrics over HTTP."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def _open(target: str, seed: int, budget_ms: float = 0.0) -> tuple[LinkClient, str]:
    client = LinkClient(
        target,
        seed=seed,
        target_interval_ms=32.0,
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


def _feed(
    client: LinkClient, seqs: Iterator[int], predictions: int, timeout_s: float = 60.0
) -> None:
    """Send observations (numbered by ``seqs``) and take predictions until ``predictions``
    more came."""
    want = client.stats().predictions_received + predictions
    deadline = time.monotonic() + timeout_s
    while client.stats().predictions_received < want:
        seq = next(seqs)
        assert time.monotonic() < deadline, client.stats()
        client.send_observation(
            Observation(
                seq=seq,
                capture_stamp_ns=time.time_ns(),
                image=rgb_image(np.full((16, 16, 3), seq % 255, np.uint8)),
                action=np.zeros(4, np.float32),
            )
        )
        while client.get_prediction(0.0) is not None:
            pass
        time.sleep(0.03)


def test_metrics_move_while_a_stream_runs_and_refusals_are_counted(serve, tmp_path):
    metrics_file = tmp_path / "metrics.port"
    _, target = serve("--metrics-port", "0", "--metrics-port-file", str(metrics_file))
    port = int(metrics_file.read_text())
    idle = scrape(port)
    assert idle[("physis_streams_open", ())] == 0
    assert idle[("process_resident_memory_bytes", ())] > 0
    assert ("physis_worker_busy_seconds_total", (("worker", "0"),)) in idle
    assert idle[("physis_worker_queued_tasks", (("worker", "0"),))] >= 0
    assert idle[("physis_measured_slowdown_ratio", ())] == 1.0

    client, refused = _open(target, 0)
    assert not refused
    try:
        promise = client.stats().promise
        sid = (("stream", str(promise.stream_id)),)
        seqs = itertools.count()
        _feed(client, seqs, 3)
        first = scrape(port)
        _feed(client, seqs, 3)
        second = scrape(port)
        assert first[("physis_streams_open", ())] == 1
        assert second[("physis_chunks_total", ())] > first[("physis_chunks_total", ())] > 0
        assert (
            second[("physis_stream_chunks_total", sid)] > first[("physis_stream_chunks_total", sid)]
        )
        latency = "physis_stream_response_latency_seconds_count"
        assert second[(latency, sid)] > first[(latency, sid)] > 0
        assert second[("physis_stream_interval_seconds_count", sid)] > 0
        assert second[("physis_stream_promised_interval_seconds", sid)] == pytest.approx(
            client.stats().promise.expected_interval_ms / 1e3
        )
        assert second[("physis_stream_promised_response_latency_seconds", sid)] > 0
        assert 0.0 <= second[("physis_worker_busy_ratio", (("worker", "0"),))] <= 1.0

        _, refused = _open(target, 1, budget_ms=0.001)  # no placement answers that fast
        assert refused.startswith("RESOURCE_EXHAUSTED") and "latency" in refused
        after = scrape(port)
        assert after[("physis_admission_refusals_total", (("resource", "latency"),))] == 1
        assert after[("physis_refusals_total", (("code", "RESOURCE_EXHAUSTED"),))] == 1
        assert after[("physis_streams_open", ())] == 1
    finally:
        client.close()
    deadline = time.monotonic() + 30
    while (closed := scrape(port))[("physis_streams_open", ())] != 0:
        assert time.monotonic() < deadline, "the stream was not closed"
        time.sleep(0.1)
    assert closed[("physis_streams_closed_total", ())] == 1
    assert closed[("physis_chunks_total", ())] >= second[("physis_chunks_total", ())]
    assert not [key for key in closed if dict(key[1]).get("stream")]  # its series are gone


def _listening_ports(pid: int) -> set[int]:
    """TCP ports the process listens on (Linux /proc)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            link = os.readlink(fd)
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        if not Path(table).exists():
            continue
        for line in Path(table).read_text().splitlines()[1:]:
            cols = line.split()
            if cols[3] == "0A" and cols[9] in inodes:  # 0A: LISTEN
                ports.add(int(cols[1].rsplit(":", 1)[1], 16))
    return ports


@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="reads Linux /proc")
def test_without_a_metrics_port_only_the_grpc_port_listens(serve):
    proc, target = serve()
    assert _listening_ports(proc.pid) == {int(target.rsplit(":", 1)[1])}


def test_metrics_flags_and_the_yaml_key_are_checked_before_loading(tmp_path):
    frontend = {"frontend": {"metrics_port": 0}, "engine": {}}
    config, _ = checked_frontend(parse_args([]), frontend)
    assert config.metrics_port == 0
    config, _ = checked_frontend(parse_args(["--metrics-port", "9464"]), frontend)
    assert config.metrics_port == 9464
    config, _ = checked_frontend(parse_args([]), {"frontend": {}, "engine": {}})
    assert config.metrics_port is None  # off by default
    with pytest.raises(UsageError, match="--metrics-port-file without a metrics port"):
        checked_frontend(parse_args(["--metrics-port-file", "x"]), {"frontend": {}, "engine": {}})
    with pytest.raises(UsageError, match="metrics_port"):
        checked_frontend(parse_args([]), {"frontend": {"metrics_port": "9464"}, "engine": {}})
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = str(taken.getsockname()[1])
        with pytest.raises(CliError, match=r"metrics port: port .* is in use"):
            checked_frontend(parse_args(["--metrics-port", busy]), {"frontend": {}, "engine": {}})


def test_a_workers_busy_fraction_is_its_share_of_the_window_between_samples():
    busy = BusyFractions()
    assert busy.update("0", WorkerSample(wall_s=10.0, busy_s=1.0, queued=0)) is None
    # before a full window: the share since the first sample
    assert busy.update("0", WorkerSample(wall_s=10.5, busy_s=1.25, queued=0)) == 0.5
    assert busy.update("0", WorkerSample(wall_s=10.8, busy_s=1.8, queued=0)) == 0.5  # kept
    assert busy.update("0", WorkerSample(wall_s=12.0, busy_s=1.5, queued=0)) == 0.25
    assert busy.update("0", WorkerSample(wall_s=14.0, busy_s=9.0, queued=0)) == 1.0  # clamped
