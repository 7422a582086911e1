"""The reach task: a 3-joint arm puts its tool tip on a target that moves between episodes;
its expert gets there on held-out seeds (also after perturbations), its episodes come from
the seed alone, and what it reports and is conditioned on are its own names, not push's."""

from __future__ import annotations

import numpy as np
import pytest

from physis_ros.sim.base import TaskSim
from physis_ros.sim.episodes import GoalEpisodes, load_episodes, run_expert_episode, save_episodes
from physis_ros.sim.reach import (
    LINK_LENGTHS_M,
    REACH,
    TIME_LIMIT_S,
    TOLERANCE_M,
    forward_kinematics,
    inverse_kinematics,
    sample_reach,
)
from physis_ros.sim.table import GOAL_RGB
from physis_ros.sim.tasks import TASKS, get_task


def test_targets_come_from_the_seed_are_reachable_and_move_between_episodes():
    assert sample_reach(3) == sample_reach(3) and sample_reach(4) != sample_reach(3)
    targets = set()
    for seed in range(40):
        s = sample_reach(seed)
        q = inverse_kinematics(s.target_xy)
        assert q is not None
        np.testing.assert_allclose(forward_kinematics(q)[-1], s.target_xy, atol=1e-9)
        start_tip = forward_kinematics(np.array(s.joints))[-1]
        assert np.linalg.norm(start_tip - s.target_xy) >= 0.15
        targets.add(s.target_xy)
    assert len(targets) == 40
    xs = [t[0] for t in targets]
    assert min(xs) < -0.1 and max(xs) > 0.1  # both sides of the table
    assert sum(LINK_LENGTHS_M) == pytest.approx(0.70)


def test_the_expert_reaches_held_out_targets_and_recovers_from_perturbations():
    for seed, perturb in [(10_000 + i, False) for i in range(10)] + [(5, True), (6, True)]:
        ep = run_expert_episode(sample_reach(seed), perturb=perturb)
        assert ep.reached_s is not None and ep.reached_s < TIME_LIMIT_S, (seed, perturb)
        assert ep.rows.shape[1] == 3 and len(ep.rows) == 2 * (len(ep.frames) - 1) + 1
        # 20 Hz joint targets at a bounded speed (the expert's; a perturbation's is slower)
        assert np.abs(np.diff(ep.rows, axis=0)).max() <= 1.5 * 0.05 + 1e-6
        q = ep.values(["shoulder_pos", "elbow_pos", "wrist_pos"])[-1]
        assert np.linalg.norm(forward_kinematics(q)[-1] - ep.setup.target_xy) <= TOLERANCE_M
        assert perturb or not ep.perturbed.any()
    assert ep.perturbed.any()


def test_reach_episodes_are_the_same_for_the_same_seed():
    a, b = (run_expert_episode(sample_reach(7), perturb=True) for _ in range(2))
    other = run_expert_episode(sample_reach(8), perturb=True)
    for name in ("frames", "state", "rows", "perturbed"):
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name))
    assert a.reached_s == b.reached_s and a.task_values == b.task_values
    assert a.frames.shape[1:] == (32, 32, 3) and not np.array_equal(a.rows[:5], other.rows[:5])


def test_it_reports_its_own_state_and_task_values_not_pushs():
    push, reach = get_task("push"), get_task("reach")
    assert sorted(TASKS) == ["push", "reach"]
    assert reach.joint_names == ("shoulder", "elbow", "wrist")
    assert reach.state_names == tuple(f"{j}_{k}" for k in ("pos", "vel") for j in reach.joint_names)
    assert reach.task_value_names == ("target_x", "target_y")
    assert not reach.has_wrench and reach.objects == () and reach.goal_topic == "target"
    assert push.has_wrench and push.objects == ("box",)
    ep = run_expert_episode(sample_reach(2))
    assert ep.state.shape == (len(ep.frames), 6) and ep.state.dtype == np.float32
    assert ep.task_values == dict(
        zip(("target_x", "target_y"), sample_reach(2).target_xy, strict=True)
    )
    contract = reach.contract(
        state_names=reach.state_names + reach.task_value_names,
        prompted=True,
        rows_per_chunk=12,
        frames_per_chunk=2,
        image_size=(32, 32),
    )
    assert contract.action_names == reach.joint_names and contract.objects == ()
    assert contract.task_names == ("target_x", "target_y")
    assert {s.source for s in contract.state} == {"joint_position", "joint_velocity", "task"}
    reach.check_fits(contract)
    with pytest.raises(ValueError, match="does not fit task 'push'"):
        push.check_fits(contract)


def test_the_camera_shows_the_target():
    sim = TaskSim(REACH, sample_reach(2))
    with_target = sim.render()
    sim.scene.target_xy = None
    without = sim.render()
    changed = np.any(with_target != without, axis=-1)
    assert 2 <= changed.sum() <= 20
    assert np.abs(with_target[changed].astype(int) - GOAL_RGB).sum(-1).min() < 40


def test_reach_episodes_save_and_load_exactly(tmp_path):
    eps = [run_expert_episode(sample_reach(s), perturb=True) for s in (1, 2)]
    save_episodes(tmp_path / "eps.npz", eps)
    back = load_episodes(tmp_path / "eps.npz")
    for a, b in zip(eps, back, strict=True):
        assert a.setup == b.setup and a.reached_s == b.reached_s and a.task == "reach"
        assert a.state_names == b.state_names and a.task_values == b.task_values
        for name in ("frames", "state", "rows", "perturbed"):
            np.testing.assert_array_equal(getattr(a, name), getattr(b, name))
    push = run_expert_episode(get_task("push").sample(1))
    with pytest.raises(ValueError, match="share their state columns"):
        save_episodes(tmp_path / "mixed.npz", [eps[0], push])


def test_reach_episodes_on_a_clock_end_at_the_target_and_start_the_next():
    ms = 1_000_000
    scene = REACH.new_scene((32, 32), 0)
    episodes = GoalEpisodes(seed=40, pause_s=1.0, task="reach")
    episodes.start(scene, 0)
    np.testing.assert_allclose(scene.target_xy, sample_reach(40).target_xy)
    assert episodes.after_step(scene, 1_000 * ms) is None
    scene.set_state(joints=inverse_kinematics(scene.target_xy))  # on the target, at rest
    assert episodes.after_step(scene, 2_000 * ms) is None  # reached: the pause starts
    line = episodes.after_step(scene, 3_000 * ms)
    assert line.startswith("reach episode 0 (seed 40): reached the goal in 2.00 s")
    np.testing.assert_allclose(scene.target_xy, sample_reach(41).target_xy)
    assert episodes.report(scene)["tool_tip_to_goal_m"] != "0.000"


def test_physis_record_records_the_reach_scene_with_its_target(tmp_path):
    """physis-record --scene reach: the reach robot's topics (camera, joint states of its 3
    joints, commands) and each frame's target, no wrench; its expert reaches targets."""
    from rosbags.rosbag2 import Reader

    from physis_ros.sim.record import BAG_TASK_SEED0, RecordConfig, main, record_episode, typestore

    cfg = RecordConfig(scene="reach", seed=2, duration_s=6.0, image_height=32, image_width=32)
    summary = record_episode(tmp_path / "bag", cfg)
    assert summary.scene == "reach" and summary.goals_reached >= 1
    assert summary.contact_fraction == 0.0 and summary.box_travel_m == 0.0
    store = typestore()
    with Reader(tmp_path / "bag") as reader:
        topics = {c.topic: c.msgtype for c in reader.connections}
        assert topics == {
            "/camera/image_raw": "sensor_msgs/msg/Image",
            "/joint_states": "sensor_msgs/msg/JointState",
            "/joint_command": "trajectory_msgs/msg/JointTrajectory",
            "/target": "geometry_msgs/msg/PointStamped",
        }
        msgs: dict[str, list] = {t: [] for t in topics}
        for conn, _, raw in reader.messages():
            msgs[conn.topic].append(store.deserialize_cdr(raw, conn.msgtype))
    assert len(msgs["/target"]) == len(msgs["/camera/image_raw"]) == summary.camera_frames
    first = msgs["/target"][0].point
    assert (first.x, first.y) == pytest.approx(sample_reach(BAG_TASK_SEED0 + 2000).target_xy)
    assert len({(m.point.x, m.point.y) for m in msgs["/target"]}) >= 2  # the target moved
    assert {tuple(m.name) for m in msgs["/joint_states"]} == {("shoulder", "elbow", "wrist")}
    assert {len(m.points[0].positions) for m in msgs["/joint_command"]} == {3}
    # the command line: --scene reach
    assert main([str(tmp_path / "cli"), "--scene", "reach", "--duration-s", "1",
                 "--height", "16", "--width", "16"]) == 0  # fmt: skip
    assert (tmp_path / "cli" / "episode_00000" / "metadata.yaml").exists()
