"""physis-serve under torchrun: a robot client gets predictions through rank 0's front end
over 2 gloo ranks; SIGTERM to torchrun stops every rank and leaves no process behind."""

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


def _children(pid: int) -> set[int]:
    out: set[int] = set()
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            out |= {int(c) for c in (task / "children").read_text().split()}
        except OSError:
            continue
    for child in list(out):
        out |= _children(child)
    return out


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return (
        Path(f"/proc/{pid}").exists()
        and "Z" not in Path(f"/proc/{pid}/stat").read_text().split()[2]
    )


@pytest.mark.skipif(not TORCHRUN.exists(), reason="torchrun is not installed in this venv")
def test_torchrun_serves_predictions_and_stops_every_rank(tmp_path):
    from physis_ros.link.client import CameraImage, LinkClient, Observation

    port_file = tmp_path / "port"
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])),
    )
    cmd = [
        str(TORCHRUN),
        "--standalone",
        "--nproc-per-node",
        "2",
        "-m",
        "physis_ros.serve.main",
        "--model",
        "tiny",
        "--port",
        "0",
        "--port-file",
        str(port_file),
    ]
    log = open(tmp_path / "torchrun.log", "wb")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    ranks: set[int] = set()
    try:
        deadline = time.monotonic() + 90
        while not port_file.exists():
            assert proc.poll() is None, (tmp_path / "torchrun.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "physis-serve under torchrun never served"
            time.sleep(0.2)
        ranks = _children(proc.pid)
        assert len(ranks) >= 2  # two ranks (python) under the torchrun agent
        client = LinkClient(f"127.0.0.1:{port_file.read_text().strip()}", seed=3)
        client.start()
        image = np.full((16, 16, 3), 80, np.uint8)
        got, seq = [], 0
        deadline = time.monotonic() + 60
        while len(got) < 4 and time.monotonic() < deadline:
            seq += 1
            client.send_observation(
                Observation(
                    seq=seq,
                    capture_stamp_ns=time.time_ns(),
                    image=CameraImage(
                        encoding="rgb8", height=16, width=16, step=48, data=image.tobytes()
                    ),
                )
            )
            pred = client.get_prediction(0.2)
            if pred is not None:
                got.append(pred)
        stats = client.stats()
        client.close()
        assert len(got) == 4, stats
        assert stats.promise.model == "tiny" and stats.promise.steps == 4
        assert got[-1].frames.shape == (2, 16, 16, 3) and got[-1].actions.shape == (4, 4)
        assert np.isfinite(got[-1].actions).all()
    finally:
        term_s = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
            stop_s = time.monotonic() - term_s
        finally:
            if proc.poll() is None:
                proc.kill()
            log.close()
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in ranks) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in ranks if _alive(p)], "a rank outlived torchrun"
    text = (tmp_path / "torchrun.log").read_text(errors="replace")
    assert "rank 0 done" in text  # rank 0 went through DistEngine.shutdown
    assert stop_s < 15.0, f"SIGTERM to exit took {stop_s:.1f} s"
