"""The simulated push scene: deterministic, physical, and varied enough to learn from."""

import numpy as np
import pytest

from physis_ros.sim.scene import PushScene, SceneConfig, ScriptedPolicy, forward_kinematics


def _run(seed: int, steps: int, dt_s: float = 0.1):
    scene = PushScene(SceneConfig(seed=seed, image_height=32, image_width=48))
    policy = ScriptedPolicy(seed)
    frames, wrenches, targets = [], [], []
    for i in range(steps):
        target = policy.joint_targets(scene, i * dt_s)
        scene.step(dt_s, target)
        targets.append(target)
        wrenches.append(scene.wrench())
        frames.append(scene.render())
    return scene, np.stack(frames), np.stack(wrenches), np.stack(targets)


def test_same_seed_same_episode_and_different_seeds_differ():
    _, fa, wa, ta = _run(3, 40)
    _, fb, wb, tb = _run(3, 40)
    _, fc, _, _ = _run(4, 40)
    assert np.array_equal(fa, fb) and np.array_equal(wa, wb) and np.array_equal(ta, tb)
    assert not np.array_equal(fa, fc)
    assert fa.shape == (40, 32, 48, 3) and fa.dtype == np.uint8


def test_pd_tracks_targets_and_kinematics_are_consistent():
    scene = PushScene(SceneConfig(seed=0))
    target = scene.joint_positions() + np.array([0.3, -0.4])
    for _ in range(20):
        scene.step(0.05, target)
    assert np.allclose(scene.joint_positions(), target, atol=0.02)
    assert np.allclose(scene.end_effector_xy(), forward_kinematics(scene.joint_positions())[1])
    assert np.linalg.norm(scene.joint_velocities()) < 0.1


def test_scripted_policy_makes_contact_and_moves_the_box():
    moved, contact_steps = 0.0, 0
    for seed in range(3):
        scene, _, wrenches, targets = _run(seed, 150)
        contact_steps += int(np.sum(np.linalg.norm(wrenches[:, :2], axis=1) > 0.05))
        start = PushScene(SceneConfig(seed=seed)).box_pose()[:2]
        moved = max(moved, float(np.linalg.norm(scene.box_pose()[:2] - start)))
        # targets move at a bounded speed: smooth commanded actions
        assert (
            np.max(np.abs(np.diff(targets, axis=0)))
            <= ScriptedPolicy.MAX_TARGET_SPEED_RAD_S * 0.1 + 1e-9
        )
    assert contact_steps > 20
    assert moved > 0.1


def test_arm_never_stands_still_in_a_reach_or_push():
    # A waypoint out of reach (or blocked by the box against the rim) is given up after
    # STALL_S: the camera does not show the same frame for seconds, which would teach a
    # world model nothing and hand copy-last-frame exact (100 dB) frames.
    still, moving_modes = 0, 0
    for seed in range(3):
        scene = PushScene(SceneConfig(seed=seed, image_height=32, image_width=32))
        policy = ScriptedPolicy(seed)
        previous = scene.render()
        for i in range(1, 301):  # 30 s: physics at 50 Hz, camera at 10 Hz
            scene.step(0.02, policy.joint_targets(scene, i * 0.02))
            if i % 5 == 0:
                frame = scene.render()
                if policy.mode in ("reach", "push"):
                    moving_modes += 1
                    still += int(np.array_equal(frame, previous))
                previous = frame
    assert moving_modes > 100
    assert still / moving_modes < 0.05, f"{still} of {moving_modes} frames unchanged"


def test_bad_inputs_raise_value_error():
    scene = PushScene(SceneConfig())
    with pytest.raises(ValueError, match="joint_targets"):
        scene.step(0.1, np.array([np.nan, 0.0]))
    with pytest.raises(ValueError, match="joint_targets"):
        scene.step(0.1, np.zeros(3))
    with pytest.raises(ValueError, match="dt_s"):
        scene.step(0.0, np.zeros(2))
    with pytest.raises(ValueError, match="image_height"):
        SceneConfig(image_height=2)
    with pytest.raises(ValueError, match="seed"):
        ScriptedPolicy(-1)
