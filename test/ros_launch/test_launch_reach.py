"""``ros2 launch physis_ros demo.launch.py model:=reach-wam drive:=true`` as a user runs it:
the shipped reach-wam weights alone decide the robot (their task: sim_robot's scene is the
3-joint reaching arm; their contract: the bridge opens its stream with each episode's target
from the reach episodes' goal topic and binds no tracked object). The model's chunks drive
the arm (sim_robot executes the bridge's trajectories), then Ctrl-C and every process ends
with exit 0.
"""

from __future__ import annotations

import pytest
from launching import LaunchRun

pytestmark = [pytest.mark.ros, pytest.mark.slow]

STREAMING_WITHIN_S = 240.0  # server start (torch import, weights) on a busy machine
DRIVING_WITHIN_S = 60.0


def _model_chunks(monitor) -> int:
    from physis_ros.msg import ActionChunk

    return sum(m.source == ActionChunk.SOURCE_MODEL for _, m in monitor.messages("action_chunk"))


def _reach_episodes(monitor) -> dict[str, str] | None:
    """sim_robot's newest reach-episodes status on /diagnostics, None before one."""
    from physis_ros.nodes.monitor import diagnostics_by_name

    for _, array in reversed(monitor.messages("/diagnostics")):
        status = diagnostics_by_name(array).get("sim_robot: reach")
        if status is not None:
            return status[2]
    return None


def test_demo_launch_drives_reach_wam_and_stops_cleanly(ros_launch_env, tmp_path):
    from physis_ros.nodes.monitor import Monitor

    domain_id = int(ros_launch_env["ROS_DOMAIN_ID"])
    args = ["demo.launch.py", "model:=reach-wam", "drive:=true", "port:=0",
            f"port_file:={tmp_path / 'port'}", "target_interval_ms:=0"]  # fmt: skip
    with LaunchRun(args, env=ros_launch_env, log_path=tmp_path / "demo.log") as run:
        monitor = Monitor(domain_id=domain_id, keep=("action_chunk", "/diagnostics"))
        try:
            # the stream opens only with the episode's target: model chunks show the binding
            monitor.wait_for(
                lambda: _model_chunks(monitor) > 0 or not run.running(), STREAMING_WITHIN_S
            )
            assert _model_chunks(monitor) > 0, f"no model chunk:\n{run.log()[-3000:]}"
            monitor.wait_for(
                lambda: (_reach_episodes(monitor) or {}).get("executing_trajectory") == "True",
                DRIVING_WITHIN_S,
            )
            episodes = _reach_episodes(monitor)
        finally:
            monitor.close()
        run.interrupt()
        names = run.assert_every_process_ended_cleanly(run.wait())
    print("demo.launch.py model:=reach-wam drive:=true, sim_robot's episodes:", episodes)
    assert episodes is not None, run.log()[-3000:]
    assert episodes["executing_trajectory"] == "True", episodes
    assert "tool_tip_to_goal_m" in episodes, episodes
    assert {n.rsplit("-", 1)[0] for n in names} == {"physis-serve", "sim_robot", "bridge"}
    # the bridge opened its stream with the episode's target, as the contract names its values
    opened = [line for line in run.log().splitlines() if "the stream opens with it" in line]
    assert opened and "target_x" in opened[0] and "target_y" in opened[0], run.log()[-3000:]
