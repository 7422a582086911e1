"""Episodes of the goal-push task driven by the scripted expert: the world-action model's data.

What belongs here (numpy only): running one expert episode on the task clock
(``physis_ros.sim.task``) and keeping what the robot's topics would carry — camera frames,
proprioception per frame, the commanded joint-target rows, which rows a perturbation
commanded — plus the box path; and writing/reading a set of episodes as one ``.npz`` file
(arrays only, loaded with ``allow_pickle=False``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from physis_ros.sim.task import (
    CONTROL_HZ,
    TICKS_PER_FRAME,
    TICKS_PER_ROW,
    TIME_LIMIT_S,
    GoalPushExpert,
    Perturbations,
    TaskSetup,
    TaskSim,
)


@dataclass
class TaskEpisode:
    """One episode. Frame n is at n / FRAME_HZ s, row i at i / CONTROL_HZ s."""

    setup: TaskSetup
    frames: np.ndarray
    """[N, H, W, 3] uint8 camera frames."""
    proprio: np.ndarray
    """[N, S] float32 proprioception at each frame (STATE_NAMES)."""
    rows: np.ndarray
    """[M, 2] float32 commanded joint targets."""
    perturbed: np.ndarray
    """[M] bool: row commanded by a perturbation, not the expert."""
    box: np.ndarray
    """[N, 3] box pose (x, y, yaw) at each frame."""
    reached_s: float | None
    """When the box first came within the goal tolerance (None: never)."""


def run_expert_episode(
    setup: TaskSetup,
    *,
    perturb: bool = False,
    image_size: tuple[int, int] = (32, 32),
    time_limit_s: float = TIME_LIMIT_S,
    hold_after_goal_s: float = 1.0,
) -> TaskEpisode:
    """The expert from ``setup`` until ``hold_after_goal_s`` after the box reached the goal
    (the expert then backs off and holds), or ``time_limit_s``."""
    sim = TaskSim(setup, image_size=image_size)
    expert = GoalPushExpert(sim.goal)
    perturbations = Perturbations(setup.seed) if perturb else None
    dt_s = 1.0 / CONTROL_HZ
    rows = [sim.scene.joint_positions()]
    flags = [False]
    frames, proprio, box = [], [], []
    while True:
        if sim.tick % TICKS_PER_FRAME == 0:
            frames.append(sim.render())
            proprio.append(sim.proprio())
            box.append(sim.scene.box_pose())
        t_s = sim.time_s
        done = (sim.reached_s is not None and t_s >= sim.reached_s + hold_after_goal_s) or (
            t_s >= time_limit_s
        )
        if done and sim.tick % TICKS_PER_FRAME == 0:
            break
        previous = rows[-1]
        if perturbations is not None and perturbations.active(t_s, previous):
            nxt, flag = perturbations.joint_targets(previous, dt_s), True
        else:
            nxt, flag = expert.joint_targets(sim.scene, previous, dt_s), False
        rows.append(nxt)
        flags.append(flag)
        for j in range(1, TICKS_PER_ROW + 1):
            sim.step(previous + (nxt - previous) * (j / TICKS_PER_ROW))
    return TaskEpisode(
        setup=setup,
        frames=np.stack(frames),
        proprio=np.stack(proprio),
        rows=np.asarray(rows, np.float32),
        perturbed=np.asarray(flags),
        box=np.asarray(box, np.float32),
        reached_s=sim.reached_s,
    )


def save_episodes(path: str | Path, episodes: list[TaskEpisode]) -> None:
    """All episodes in one compressed .npz (concatenated arrays + offsets + a JSON index)."""
    index = [
        {
            "seed": ep.setup.seed,
            "joints": ep.setup.joints,
            "box_xy": ep.setup.box_xy,
            "box_yaw": ep.setup.box_yaw,
            "goal_xy": ep.setup.goal_xy,
            "reached_s": ep.reached_s,
            "frames": len(ep.frames),
            "rows": len(ep.rows),
        }
        for ep in episodes
    ]
    np.savez_compressed(
        path,
        index=np.frombuffer(json.dumps(index).encode(), np.uint8),
        frames=np.concatenate([ep.frames for ep in episodes]),
        proprio=np.concatenate([ep.proprio for ep in episodes]),
        rows=np.concatenate([ep.rows for ep in episodes]),
        perturbed=np.concatenate([ep.perturbed for ep in episodes]),
        box=np.concatenate([ep.box for ep in episodes]),
    )


def load_episodes(path: str | Path) -> list[TaskEpisode]:
    with np.load(path, allow_pickle=False) as data:
        index = json.loads(data["index"].tobytes().decode())
        arrays = {k: data[k] for k in ("frames", "proprio", "rows", "perturbed", "box")}
    out, f0, r0 = [], 0, 0
    for item in index:
        nf, nr = item["frames"], item["rows"]
        setup = TaskSetup(
            seed=item["seed"],
            joints=tuple(item["joints"]),
            box_xy=tuple(item["box_xy"]),
            box_yaw=item["box_yaw"],
            goal_xy=tuple(item["goal_xy"]),
        )
        out.append(
            TaskEpisode(
                setup=setup,
                frames=arrays["frames"][f0 : f0 + nf],
                proprio=arrays["proprio"][f0 : f0 + nf],
                rows=arrays["rows"][r0 : r0 + nr],
                perturbed=arrays["perturbed"][r0 : r0 + nr],
                box=arrays["box"][f0 : f0 + nf],
                reached_s=item["reached_s"],
            )
        )
        f0, r0 = f0 + nf, r0 + nr
    return out
