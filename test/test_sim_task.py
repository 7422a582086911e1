"""The goal-push task: starts and goals from a seed, an expert that gets the box there (also
after perturbations), a goal the camera shows, and episodes that save and load exactly."""

from __future__ import annotations

import numpy as np

from physis_ros.sim.episodes import load_episodes, run_expert_episode, save_episodes
from physis_ros.sim.scene import GOAL_RGB
from physis_ros.sim.task import (
    GOAL_TOLERANCE_M,
    STATE_NAMES,
    TIME_LIMIT_S,
    GoalPushExpert,
    TaskSim,
    sample_task,
)


def test_starts_and_goals_come_from_the_seed_and_are_pushable():
    a, b = sample_task(3), sample_task(3)
    assert a == b and sample_task(4) != a
    for seed in range(30):
        s = sample_task(seed)
        dist = np.linalg.norm(np.subtract(s.goal_xy, s.box_xy))
        assert 0.12 <= dist <= 0.35


def test_the_expert_pushes_the_box_onto_the_goal_and_recovers_from_perturbations():
    perturbed = 0
    for seed, perturb in ((10_000, False), (10_001, False), (5, True), (6, True), (7, True)):
        ep = run_expert_episode(sample_task(seed), perturb=perturb)
        assert ep.reached_s is not None and ep.reached_s < TIME_LIMIT_S, (seed, perturb)
        final = np.linalg.norm(ep.box[-1, :2] - np.array(ep.setup.goal_xy))
        assert final <= 2 * GOAL_TOLERANCE_M  # it stays near (the box slides a little on)
        # rows: 20 Hz joint targets that move at a bounded speed
        assert np.abs(np.diff(ep.rows, axis=0)).max() <= 2.0 * 0.05 + 1e-6
        assert len(ep.rows) == 2 * (len(ep.frames) - 1) + 1
        assert ep.proprio.shape == (len(ep.frames), len(STATE_NAMES))
        assert perturb or not ep.perturbed.any()
        perturbed += int(ep.perturbed.any())
    assert perturbed >= 1  # and reached the goal all the same


def test_going_round_the_expert_backs_straight_out_from_a_box_it_is_too_near():
    """Near the box at its side, the expert heads straight out to its orbit (sliding round at
    that distance would catch the box's corners); far off, or behind the box, it does not."""
    box, goal = np.array([0.0, 0.4]), np.array([0.25, 0.4])  # push +x: behind is at -x
    side = np.array([0.0, -1.0])  # the pusher below the box: 90 degrees from behind
    for r in (0.106, 0.12, GoalPushExpert.BACK_OFF_M - 0.005):
        expert = GoalPushExpert(goal)
        way = expert.waypoint(box, box + side * r)
        assert expert.phase == "approach"
        np.testing.assert_allclose(way, box + side * GoalPushExpert._ORBIT_M, atol=1e-12)
    far = GoalPushExpert(goal).waypoint(box, box + side * (GoalPushExpert.BACK_OFF_M + 0.02))
    assert abs(float(np.linalg.norm(far - box)) - GoalPushExpert._ORBIT_M) < 0.06
    assert abs(far[0] - box[0]) > 0.05  # round the box, not straight out
    behind = np.array([-1.0, 0.0])
    way = GoalPushExpert(goal).waypoint(box, box + behind * 0.12)
    np.testing.assert_allclose(way, box + behind * GoalPushExpert._BEHIND_M, atol=1e-12)


def test_training_episodes_start_with_the_arm_held_as_a_served_robot_waits_for_its_first_chunk():
    """The held rows repeat the start, are flagged (never trained as output) and last
    0-0.6 s, different per seed; the expert's own episodes move from their second row."""
    holds = []
    for seed in range(8):
        ep = run_expert_episode(sample_task(seed), perturb=True)
        moving = np.abs(np.diff(ep.rows, axis=0)).max(axis=1) > 0
        first_move = int(np.argmax(moving)) + 1  # the first row that differs from the one before
        held = first_move - 1
        np.testing.assert_array_equal(ep.rows[:first_move], np.repeat(ep.rows[:1], first_move, 0))
        assert ep.perturbed[1:first_move].all() and not ep.perturbed[first_move]
        holds.append(held / 20)  # rows at 20 Hz
    assert max(holds) <= 0.6 and len(set(holds)) >= 4, holds
    plain = run_expert_episode(sample_task(3), perturb=False)
    assert np.abs(plain.rows[1] - plain.rows[0]).max() > 0 and not plain.perturbed.any()


def test_the_camera_shows_the_goal():
    sim = TaskSim(sample_task(2))
    with_goal = sim.render()
    sim.scene.goal_xy = None
    without = sim.render()
    changed = np.any(with_goal != without, axis=-1)
    assert 3 <= changed.sum() <= 30
    assert np.abs(with_goal[changed].astype(int) - GOAL_RGB).sum(-1).min() < 30


def test_episodes_save_and_load_exactly(tmp_path):
    eps = [run_expert_episode(sample_task(s), perturb=True) for s in (1, 2)]
    save_episodes(tmp_path / "eps.npz", eps)
    back = load_episodes(tmp_path / "eps.npz")
    for a, b in zip(eps, back, strict=True):
        assert a.setup == b.setup and a.reached_s == b.reached_s
        for name in ("frames", "proprio", "rows", "perturbed", "box"):
            np.testing.assert_array_equal(getattr(a, name), getattr(b, name))
