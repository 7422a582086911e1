"""The bridge's execution of timed chunks (nodes/wam_execution.py) and sim_robot's goal-push
episodes, without ROS processes: what goes back to the server with each observation, what
the controller is told, and when the plan restarts."""

from __future__ import annotations

import numpy as np
import pytest

from physis_ros.nodes.pairing import CommandHistory
from physis_ros.nodes.wam_execution import ActionExecution, ExecutionConfig

MS = 1_000_000


def _reported(history: CommandHistory, start_ms: int, end_ms: int, value) -> None:
    for t in range(start_ms, end_ms, 10):  # the robot reports its target at 100 Hz
        history.add(t * MS, np.asarray(value(t), np.float64))


def test_each_observation_carries_what_was_commanded_and_what_is_committed():
    history = CommandHistory(max_age_s=0.25)
    ex = ActionExecution(ExecutionConfig(), history)
    _reported(history, 0, 1001, lambda t: [t / 1000, -t / 1000])
    rows = np.stack([np.linspace(1.0, 1.55, 12), np.zeros(12)], axis=1)
    report = ex.accept(
        actions=rows, start_ns=1000 * MS, dt_ns=50 * MS, chunk_index=3, now_ns=1000 * MS
    )
    assert report.accepted
    commands, start_ns, dt_ns = ex.command_timeline(1000 * MS)
    times = start_ns + dt_ns * np.arange(len(commands))
    assert dt_ns == 50 * MS and times[0] == 0 and times[-1] == 1550 * MS
    past = times <= 1000 * MS
    np.testing.assert_allclose(commands[past, 0], times[past] / 1e9, atol=1e-6)  # reported
    np.testing.assert_allclose(commands[~past, 0], rows[1:, 0], atol=1e-6)  # committed
    # the trajectory for the controller: from now, times relative to now
    from_now, points = ex.trajectory(1000 * MS)
    assert from_now[0] == 0 and np.all(np.diff(from_now) > 0) and len(points) == 12


def test_naive_execution_sends_no_timeline_and_runs_row_zero_on_arrival():
    history = CommandHistory(max_age_s=0.25)
    _reported(history, 0, 501, lambda t: [0.5, 0.5])
    ex = ActionExecution(ExecutionConfig(execution="naive"), history)
    rows = np.full((12, 2), 0.9)
    ex.accept(actions=rows, start_ns=300 * MS, dt_ns=50 * MS, chunk_index=1, now_ns=500 * MS)
    assert ex.command_timeline(500 * MS) is None
    from_now, points = ex.trajectory(500 * MS)
    assert from_now[0] == 0 and len(points) == 12  # nothing skipped: row 0 is "now"


def test_the_plan_restarts_when_the_robot_is_not_following_it():
    """e.g. sim_robot reset the scene for the next episode: after three reports far from the
    plan, the plan starts over from what the robot reports."""
    history = CommandHistory(max_age_s=0.25)
    ex = ActionExecution(ExecutionConfig(), history)
    history.add(0, np.zeros(2))
    ex.accept(actions=np.zeros((12, 2)), start_ns=0, dt_ns=50 * MS, chunk_index=1, now_ns=0)
    for i, t in enumerate((100, 110, 120)):
        ex.on_command(t * MS, np.array([1.0, 1.0]))
        assert ex.stats.resyncs == (1 if i == 2 else 0)
    assert ex.executor.target_at(130 * MS) == pytest.approx([1.0, 1.0])
    # a new chunk numbering (the new plan takes chunk 1 again)
    assert ex.accept(actions=np.ones((12, 2)), start_ns=200 * MS, dt_ns=50 * MS,
                     chunk_index=1, now_ns=150 * MS).accepted  # fmt: skip


def test_goal_push_episodes_end_on_success_or_time_out_and_start_the_next():
    from physis_ros.nodes.sim_robot import GoalEpisodes
    from physis_ros.sim.scene import PushScene, SceneConfig
    from physis_ros.sim.task import TIME_LIMIT_S, sample_task

    scene = PushScene(SceneConfig(image_height=32, image_width=32))
    episodes = GoalEpisodes(seed=40, pause_s=1.0)
    episodes.start(scene, 0)
    assert np.allclose(scene.goal_xy, sample_task(40).goal_xy)
    assert episodes.after_step(scene, 1_000 * MS) is None
    scene.set_state(joints=scene.joint_positions(), box_xy=scene.goal_xy, box_yaw=0.0)
    assert episodes.after_step(scene, 2_000 * MS) is None  # reached: the pause starts
    # during the pause the success is not yet counted: never "1 of 0 finished"
    assert (episodes.report(scene)["successes"], episodes.report(scene)["finished"]) == (0, 0)
    line = episodes.after_step(scene, 3_000 * MS)
    assert "reached the goal in 2.00 s" in line and "1 of 1" in line
    assert np.allclose(scene.goal_xy, sample_task(41).goal_xy) and episodes.started_ns == 3_000 * MS
    line = episodes.after_step(scene, 3_000 * MS + int(TIME_LIMIT_S * 1e9))
    assert "not within" in line and episodes.report(scene)["successes"] == 1
