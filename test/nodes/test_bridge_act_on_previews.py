"""The bridge acting on a world-action model's previews (parameter ``act_on_previews``), with
real processes: physis-serve serving ``tiny-wam`` (random weights with physis-train-wam's
metadata, K = 4: previews after steps 1..3), sim_robot following the bridge's trajectories
and the bridge, on an isolated ROS domain. Previews go out as action chunks
(SOURCE_MODEL_PREVIEW) and are executed as they come, each slot's before its chunk; what the
robot is told on joint_trajectory never starts before its publishing time and each
trajectory continues the previous one at the time it takes over (nothing commanded is taken
back, no jump);
/diagnostics counts the previews acted on and how much sooner they came."""

from __future__ import annotations

import itertools
import time

import numpy as np
import pytest

from physis_testing import adopt_discovery_env, reserved_ros_domain, restore_env

pytestmark = [pytest.mark.ros, pytest.mark.slow]
WAIT_S = 300.0  # a generous bound for a busy machine: no timing is asserted


def _weights(path) -> None:
    from safetensors.torch import save_file

    from physis_ros.engine.build import build_model
    from physis_ros.engine.config import get_preset
    from physis_ros.engine.model import to_upstream_state_dict
    from physis_ros.train.wam import WamTrainConfig, metadata

    cfg = WamTrainConfig(model="tiny-wam", window=2, max_obs=2, chunks=3, sample_steps=4, prompt="")
    model = build_model(get_preset("tiny-wam"), seed=3)
    save_file(to_upstream_state_dict(model), str(path), metadata=metadata(cfg, {}))


def _ns(t) -> int:
    return t.sec * 1_000_000_000 + t.nanosec


def _jumps(trajectories) -> list[float]:
    """For each trajectory after the first: max |its target at its stamp - the previous
    trajectory's target then| (0: it takes over exactly where the robot was commanded)."""
    out = []
    for old, new in itertools.pairwise(trajectories):
        t0 = _ns(old.header.stamp)
        times = np.array([t0 + _ns(p.time_from_start) for p in old.points], np.float64)
        rows = np.array([p.positions for p in old.points])
        at = _ns(new.header.stamp)
        before = np.array([np.interp(at, times, rows[:, j]) for j in range(rows.shape[1])])
        out.append(float(np.abs(np.asarray(new.points[0].positions) - before).max()))
    return out


def test_previews_are_executed_before_their_chunks_without_jumps(tmp_path):
    from physis_ros.demo import shipped_camera
    from physis_ros.msg import ActionChunk
    from physis_ros.nodes.monitor import Monitor, diagnostics_by_name
    from physis_ros.nodes.system import LocalSystem

    weights = tmp_path / "tiny_wam.safetensors"
    _weights(weights)
    camera = shipped_camera("tiny-wam", str(weights))
    with reserved_ros_domain() as domain_id:
        loop = LocalSystem(
            domain_id=domain_id, model="tiny-wam", weights=str(weights), log_dir=str(tmp_path)
        )
        saved = adopt_discovery_env(loop.env)
        monitor = Monitor(
            domain_id=domain_id, keep=("action_chunk", "joint_trajectory", "/diagnostics")
        )

        def sources() -> dict[int, int]:
            got: dict[int, int] = {}
            for _, m in monitor.messages("action_chunk"):
                got[m.source] = got.get(m.source, 0) + 1
            return got

        def output(after_s: float = 0.0) -> dict[str, str]:
            """The bridge's newest output status (sim_robot publishes on /diagnostics too),
            from a message that came after ``after_s`` (monotonic)."""
            for t, array in reversed(monitor.messages("/diagnostics")):
                status = diagnostics_by_name(array).get("bridge: output")
                if status is not None and t > after_s:
                    return status[2]
            return {}

        try:
            # task free, holding when no trajectory comes: the arm follows the bridge alone
            loop.start_sim_robot(
                **{k: camera[k] for k in ("image_height", "image_width", "camera_rate_hz")},
                idle_policy="hold",
            )
            loop.start_server(timeout_s=WAIT_S)
            loop.start_bridge(
                target_interval_ms=camera["chunk_ms"],
                command_joint_names=camera["action_names"],
                act_on_previews=True,
            )
            assert monitor.wait_for(
                lambda: (
                    sources().get(ActionChunk.SOURCE_MODEL_PREVIEW, 0) >= 10
                    and sources().get(ActionChunk.SOURCE_MODEL, 0) >= 5
                    and float(output().get("preview_action_sooner_slots", 0)) >= 3
                    and float(output().get("previews_acted", 0)) >= 10  # (once a second)
                    and monitor.count("joint_trajectory") >= 15
                ),
                timeout_s=WAIT_S,
            ), (sources(), output(), loop.log_dir)
            # what was published up to now, and the counts of a report published after it
            cut_s = time.monotonic()
            chunks = [m for t, m in monitor.messages("action_chunk") if t <= cut_s]
            trajectories = [m for t, m in monitor.messages("joint_trajectory") if t <= cut_s]
            assert monitor.wait_for(lambda: output(cut_s + 0.2), timeout_s=WAIT_S)
            values = output(cut_s + 0.2)
        finally:
            monitor.close()
            codes = loop.stop()
            restore_env(saved)
    assert all(code == 0 for code in codes.values()), codes

    # previews acted on, sooner than their chunks, the stale ones counted apart
    assert int(values["previews_acted"]) >= 10, values
    assert float(values["preview_action_sooner_median_ms"]) > 0, values
    assert "previews_ignored" in values and "join_max_step" in values, values
    # in admission order: chunks in slot order, no preview of a slot after its chunk, the
    # previews' slots never going back
    model = [m for m in chunks if m.source == ActionChunk.SOURCE_MODEL]
    previews = [m for m in chunks if m.source == ActionChunk.SOURCE_MODEL_PREVIEW]
    assert all(b.chunk_index > a.chunk_index for a, b in itertools.pairwise(model))
    assert all(b.chunk_index >= a.chunk_index for a, b in itertools.pairwise(previews))
    done: set[int] = set()
    for m in chunks:
        assert not (m.source == ActionChunk.SOURCE_MODEL_PREVIEW and m.chunk_index in done)
        if m.source == ActionChunk.SOURCE_MODEL:
            done.add(m.chunk_index)
    # never a time already past: each trajectory starts at its publishing time, in order
    assert len(trajectories) >= 15
    for m in trajectories:
        from_start = [_ns(p.time_from_start) for p in m.points]
        assert from_start[0] == 0 and all(np.diff(from_start) > 0)
    # each continues the previous at the time it takes over; a hold fallback (a machine so
    # busy chunks stopped) or a plan restarted from the robot's report may not
    breaks = int(values["fallbacks_published"]) * 2 + int(values["plan_resyncs"])
    jumps = _jumps(trajectories)
    assert sum(j > 1e-6 for j in jumps) <= breaks, (sorted(jumps)[-5:], values)


def test_demo_acts_on_previews_and_says_how_much_sooner(tmp_path, ros_env):
    """physis-demo --act-on-previews with a world-action model's checkpoint: the summary
    counts the previews acted on and the time each chunk's rows were started sooner."""
    import json
    import subprocess
    import sys

    weights = tmp_path / "tiny_wam.safetensors"
    _weights(weights)
    out = tmp_path / "demo"
    proc = subprocess.run(
        [sys.executable, "-m", "physis_ros.demo", "--model", "tiny-wam", "--weights",
         str(weights), "--act-on-previews", "--duration-s", "6", "--out", str(out),
         "--domain-id", ros_env["ROS_DOMAIN_ID"]],
        check=False, env=ros_env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "previews acted on" in proc.stdout, proc.stdout[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["children_exit_codes"] == {"server": 0, "sim_robot": 0, "bridge": 0}
    execution = summary["execution"]
    assert execution["previews_acted"] > 0 and execution["timed_chunks_executed"] > 0, execution
    assert execution["preview_action_sooner_median_ms"] > 0, execution
    assert sorted(summary["preview_sooner_median_ms"]) == ["1", "2", "3"], summary
