"""physis-serve under torchrun: a robot client gets predictions through rank 0's front end
over 2 gloo ranks; a hung rank is reported to the client within the fault timeout; a killed
rank ends the job and its streams with an error at once; SIGTERM to torchrun stops every rank
and leaves no process behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
TORCHRUN = Path(sys.executable).parent / "torchrun"
FAULT_TIMEOUT_S = 5.0  # 2 s declared live ranks dead on a busy machine
CONFIG = f"""
engine: {{model: tiny}}
placement: {{plan: even}}  # every stream over both ranks: a hung rank 1 is every stream's fault
distributed:
  heartbeat_interval_s: 0.2
  fault_timeout_s: {FAULT_TIMEOUT_S}
  comm_timeout_s: 30.0
"""

pytestmark = pytest.mark.skipif(not TORCHRUN.exists(), reason="torchrun is not in this venv")


def _descendants(pid: int) -> set[int]:
    """Every process below ``pid``, from the parent pid of each process in /proc.

    Not /proc/<pid>/task/*/children: that lists a child under the thread that forked it, and
    a child whose forking thread exited moves to another thread's list while we read."""
    parent_of = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            # "pid (comm) state ppid ...": comm may hold spaces and parentheses
            parent_of[int(stat.parent.name)] = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
    out, frontier = set(), {pid}
    while frontier:
        frontier = {child for child, parent in parent_of.items() if parent in frontier} - out
        out |= frontier
    return out


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split()[2]
    except OSError:
        return False
    return state != "Z"


def _rank_pids(agent_pid: int) -> dict[int, int]:
    """rank -> pid of the ranks under the torchrun agent."""
    out = {}
    for pid in _descendants(agent_pid):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        for item in env:
            if item.startswith(b"RANK="):
                out[int(item[5:])] = pid
    return out


@pytest.fixture
def server(tmp_path):
    """(port, torchrun process, rank -> pid); stops everything and checks nothing is left."""
    port_file = tmp_path / "port"
    (tmp_path / "serve.yaml").write_text(CONFIG)
    pythonpath = os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=pythonpath)
    cmd = [
        str(TORCHRUN),
        "--standalone",
        "--nproc-per-node",
        "2",
        "-m",
        "physis_ros.serve.main",
        "--config",
        str(tmp_path / "serve.yaml"),
        "--port",
        "0",
        "--port-file",
        str(port_file),
    ]
    log_path = tmp_path / "torchrun.log"
    log = open(log_path, "wb")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    ranks: dict[int, int] = {}
    try:
        deadline = time.monotonic() + 90
        while not port_file.exists():
            assert proc.poll() is None, log_path.read_text(errors="replace")[-3000:]
            assert time.monotonic() < deadline, "physis-serve under torchrun never served"
            time.sleep(0.2)
        ranks = _rank_pids(proc.pid)
        deadline = time.monotonic() + 30
        while sorted(ranks) != [0, 1] and time.monotonic() < deadline:
            time.sleep(0.2)
            ranks = _rank_pids(proc.pid)
        assert sorted(ranks) == [0, 1], (ranks, sorted(_descendants(proc.pid)))
        yield int(port_file.read_text()), proc, ranks
    finally:
        term_s = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            # a rank did not leave: its threads' stacks (faulthandler on SIGUSR1) go to the log
            for pid in ranks.values():
                if _alive(pid):
                    os.kill(pid, signal.SIGUSR1)
            time.sleep(1.0)
            proc.kill()
            proc.wait(timeout=10)
            log.close()
            raise AssertionError(
                "torchrun outlived SIGTERM by 30 s; log with stacks:\n"
                + log_path.read_text(errors="replace")[-6000:]
            ) from None
        finally:
            if proc.poll() is None:
                proc.kill()
            log.close()
        stop_s = time.monotonic() - term_s
        deadline = time.monotonic() + 10
        while any(_alive(p) for p in ranks.values()) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [p for p in ranks.values() if _alive(p)], "a rank outlived torchrun"
        assert "rank 0 done" in log_path.read_text(errors="replace")  # the rank executor shut down
        assert stop_s < 15.0, f"SIGTERM to exit took {stop_s:.1f} s"


def _send_frame(client, seq: int) -> None:
    from physis_ros.link.client import CameraImage, Observation

    image = np.full((16, 16, 3), 80, np.uint8)
    client.send_observation(
        Observation(
            seq=seq,
            capture_stamp_ns=time.time_ns(),
            image=CameraImage(encoding="rgb8", height=16, width=16, step=48, data=image.tobytes()),
        )
    )


def _stream(port: int, count: int, timeout_s: float):
    from physis_ros.link.client import LinkClient

    client = LinkClient(f"127.0.0.1:{port}", seed=3)
    client.start()
    got, seq = [], 0
    deadline = time.monotonic() + timeout_s
    while len(got) < count and time.monotonic() < deadline:
        seq += 1
        _send_frame(client, seq)
        pred = client.get_prediction(0.2)
        if pred is not None:
            got.append(pred)
    return client, got


def test_torchrun_serves_predictions_and_stops_every_rank(server):
    port, _, _ = server
    client, got = _stream(port, 4, 60)
    stats = client.stats()
    client.close()
    assert len(got) == 4, stats
    assert stats.promise.model == "tiny" and stats.promise.steps == 4
    assert got[-1].frames.shape == (2, 16, 16, 3) and got[-1].actions.shape == (4, 4)
    assert np.isfinite(got[-1].actions).all()


def test_hung_rank_is_reported_to_the_client_within_the_timeout(server):
    port, _, ranks = server
    client, got = _stream(port, 2, 60)
    assert len(got) == 2
    os.kill(ranks[1], signal.SIGSTOP)
    try:
        hung_s = time.monotonic()
        seq = 1000
        while "rank 1" not in client.stats().last_error and time.monotonic() - hung_s < 60:
            seq += 1
            _send_frame(client, seq)  # the robot's camera goes on: chunks go in, none out
            client.get_prediction(0.1)
        reported_s = time.monotonic() - hung_s
        error = client.stats().last_error
        client.close()
        assert "rank 1" in error, error
        assert reported_s < 2 * FAULT_TIMEOUT_S, f"reported after {reported_s:.1f} s: {error}"
    finally:
        os.kill(ranks[1], signal.SIGKILL)  # a stopped process cannot act on SIGTERM


def test_killed_rank_ends_its_streams_with_an_error_and_the_server_exits_cleanly(server):
    """Fault injection: SIGKILL one rank mid-stream. torchrun sees its worker die and stops
    the job; rank 0 ends every stream with UNAVAILABLE (the client is told, and reconnects
    to whatever serves next) and exits; no rank is left behind (the fixture checks)."""
    port, proc, ranks = server
    client, got = _stream(port, 2, 60)
    assert len(got) == 2
    killed_s = time.monotonic()
    os.kill(ranks[1], signal.SIGKILL)
    try:
        while client.stats().state == "streaming" and time.monotonic() - killed_s < 60:
            client.get_prediction(0.05)
        told_s = time.monotonic() - killed_s
        stats = client.stats()
    finally:
        client.close()
    assert stats.state != "streaming", "the stream of a dead rank's job never ended"
    assert "UNAVAILABLE" in stats.last_error, stats.last_error
    # Within two fault intervals (the runtime's own bound for noticing a silent rank);
    # measured 0.16 s on an idle machine: torchrun's agent sees the exit at once.
    assert told_s < 2 * FAULT_TIMEOUT_S, f"told after {told_s:.1f} s"
    proc.wait(timeout=60)  # the job ends: no hang
    exited_s = time.monotonic() - killed_s
    print(
        f"killed rank 1: client told after {told_s:.2f} s, torchrun exited after {exited_s:.2f} s"
    )
    assert proc.returncode != 0
