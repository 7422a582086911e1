"""The bridge executing a world-action model's timed chunks in a real ROS process
(helpers/timed_bridge.py): chunks answer observations taken three and six control periods
before they arrive, and continue one ramp of joint targets. What goes out on
joint_trajectory: never a time already past (late rows trimmed, never published whole),
time_from_start measured from the publishing time, and a commanded trajectory that never
goes back; the naive baseline, executing row 0 on arrival, does go back."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

HELPER = str(Path(__file__).parent / "helpers" / "timed_bridge.py")
RUN_S = 4.0
ROW_NS = 50_000_000


def _run(ros_env, monkeypatch, execution: str, join: str):
    from physis_ros.nodes.monitor import Monitor

    for key in ("ROS_AUTOMATIC_DISCOVERY_RANGE", "FASTDDS_DEFAULT_PROFILES_FILE"):
        monkeypatch.setenv(key, ros_env[key])
    monitor = Monitor(
        domain_id=int(ros_env["ROS_DOMAIN_ID"]), keep=("joint_trajectory", "action_chunk")
    )
    child = subprocess.Popen(
        [sys.executable, HELPER, str(RUN_S), execution, join],
        env=ros_env,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        out, _ = child.communicate(timeout=90)
        time.sleep(0.3)
        trajectories = [m for _, m in monitor.messages("joint_trajectory")]
        chunks = [m for _, m in monitor.messages("action_chunk")]
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        monitor.close()
    assert child.returncode == 0
    return json.loads(out.strip().splitlines()[-1]), trajectories, chunks


def _stamp_ns(t) -> int:
    return t.sec * 1_000_000_000 + t.nanosec


def _commanded(trajectories, step_ns: int = 10_000_000) -> np.ndarray:
    """The shoulder target a follower commands (each trajectory replaces the last from its
    stamp on), sampled every 10 ms."""
    t0 = _stamp_ns(trajectories[0].header.stamp)
    starts = [_stamp_ns(m.header.stamp) - t0 for m in trajectories]  # ns since the first
    values = []
    for t in range(0, starts[-1], step_ns):
        i = max(k for k, s in enumerate(starts) if s <= t)
        m = trajectories[i]
        times = np.array([starts[i] + _stamp_ns(p.time_from_start) for p in m.points], float)
        values.append(np.interp(float(t), times, [p.positions[0] for p in m.points]))
    return np.asarray(values)


@pytest.mark.ros
@pytest.mark.slow
def test_late_chunks_are_trimmed_and_the_trajectory_never_goes_back(ros_env, monkeypatch):
    result, trajectories, chunks = _run(ros_env, monkeypatch, "delay_aware", "crossfade")
    assert result["accepted"] >= 10 and len(trajectories) >= 10 and not result["refused"]
    # rows 150 ms late: the first two of 12 are past (300 ms: five); never published whole
    assert result["rows_skipped"] >= 2 * result["accepted"]
    assert all(0 < c.horizon < 12 for c in chunks)
    for m in trajectories:
        from_start = [_stamp_ns(p.time_from_start) for p in m.points]
        # from now: the target now, then the rows ahead, in order
        assert from_start[0] == 0 and all(np.diff(from_start) > 0)
    for c in chunks:  # the chunk's first published row is not in the past of its stamp
        assert _stamp_ns(c.header.stamp) >= _stamp_ns(c.observation_stamp) + 2 * ROW_NS
    commanded = _commanded(trajectories)
    assert np.all(np.diff(commanded) >= -1e-6)  # forward along the ramp, never back


@pytest.mark.ros
@pytest.mark.slow
def test_the_naive_baseline_executes_late_rows_and_goes_back(ros_env, monkeypatch):
    result, trajectories, chunks = _run(ros_env, monkeypatch, "naive", "replace")
    assert result["rows_skipped"] == 0 and all(c.horizon == 12 for c in chunks)
    commanded = _commanded(trajectories)
    assert np.diff(commanded).min() < -0.02  # each late chunk sends the arm back
