"""Episodes of any task (``physis_ros.sim.tasks``): the world-action models' data, and a
robot's episodes on a live clock.

What belongs here (numpy only): running one expert episode on the task clock
(``physis_ros.sim.base``) and keeping what the robot's topics would carry — camera frames,
the task's state values per frame, the commanded joint-target rows, which rows a
perturbation commanded — as an ``Episode``; the perturbations that teach a learned policy to
recover; writing/reading a set of episodes as one ``.npz`` file (arrays only, loaded with
``allow_pickle=False``); and ``GoalEpisodes``, one episode after another on a robot's clock
(``sim_robot``, ``physis-record``).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np

from physis_ros.sim.base import CONTROL_HZ, TICKS_PER_FRAME, TICKS_PER_ROW, Episode, Setup, TaskSim
from physis_ros.sim.tasks import get_task


class Perturbations:
    """Episodes of training data are disturbed now and then: for 0.3-0.8 s the commanded
    targets wander to a random nearby configuration (an external push, a bad command), then
    the expert takes over from wherever that left the arm (and what it moves): the
    recoveries a learned policy needs to have seen. Rows commanded during a perturbation are
    flagged (the model is never trained to produce them).

    Every episode also starts with the arm held still for 0-``MAX_START_HOLD_S``: a served
    policy's robot holds until its first chunk arrives, so its first requests show an arm at
    rest and committed rows that stand still, which an expert that moves from its first row
    never shows (the model trained without the hold planned its first 0.3 s at a third of
    the expert's reach, in a direction 0.42 cosine-close to the expert's)."""

    MEAN_GAP_S = 3.0
    SPEED_RAD_S = 1.5
    MAX_START_HOLD_S = 0.6

    def __init__(self, seed: int) -> None:
        self._rng = np.random.default_rng([seed, 0x5EED])
        self._next_s = 1.0 + float(self._rng.exponential(self.MEAN_GAP_S))
        self._end_s = -1.0
        self._goal: np.ndarray | None = None
        self._start_hold_s = float(self._rng.uniform(0.0, self.MAX_START_HOLD_S))
        self._holding = False

    def active(self, t_s: float, previous: np.ndarray) -> bool:
        self._holding = t_s < self._start_hold_s
        if self._holding:
            return True
        if t_s >= self._next_s and self._goal is None:
            self._goal = previous + self._rng.uniform(-0.6, 0.6, len(previous))
            self._end_s = t_s + float(self._rng.uniform(0.3, 0.8))
        if self._goal is not None and t_s >= self._end_s:
            self._goal = None
            self._next_s = t_s + 0.5 + float(self._rng.exponential(self.MEAN_GAP_S))
        return self._goal is not None

    def joint_targets(self, previous: np.ndarray, dt_s: float) -> np.ndarray:
        if self._holding:
            return previous.copy()
        assert self._goal is not None
        limit = self.SPEED_RAD_S * dt_s
        return previous + np.clip(self._goal - previous, -limit, limit)


def run_expert_episode(
    setup: Setup,
    *,
    perturb: bool = False,
    image_size: tuple[int, int] = (32, 32),
    time_limit_s: float | None = None,
    hold_after_goal_s: float = 1.0,
) -> Episode:
    """The expert of the setup's task from ``setup`` until ``hold_after_goal_s`` after the goal
    was reached (the expert then holds or backs off), or ``time_limit_s`` (default: the
    task's)."""
    task = get_task(setup.task)
    limit_s = task.time_limit_s if time_limit_s is None else time_limit_s
    sim = TaskSim(task, setup, image_size=image_size)
    expert = task.expert(setup)
    perturbations = Perturbations(setup.seed) if perturb else None
    dt_s = 1.0 / CONTROL_HZ
    rows = [sim.joint_positions()]
    flags = [False]
    frames, state = [], []
    while True:
        if sim.tick % TICKS_PER_FRAME == 0:
            frames.append(sim.render())
            state.append(sim.state())
        t_s = sim.time_s
        done = (sim.reached_s is not None and t_s >= sim.reached_s + hold_after_goal_s) or (
            t_s >= limit_s
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
    return task.episode_type(
        setup=setup,
        frames=np.stack(frames),
        state=np.stack(state),
        state_names=task.state_names,
        rows=np.asarray(rows, np.float32),
        perturbed=np.asarray(flags),
        task_values=task.task_values(setup),
        reached_s=sim.reached_s,
    )


def save_episodes(path: str | Path, episodes: list[Episode]) -> None:
    """All episodes in one compressed .npz (concatenated arrays + offsets + a JSON index).
    Their state columns must be the same (one task's episodes)."""
    names = {ep.state_names for ep in episodes}
    if len(names) != 1:
        raise ValueError(f"episodes of one file share their state columns, got {sorted(names)}")
    index = [
        {
            "task": ep.task,
            "setup": dataclasses.asdict(ep.setup),
            "task_values": ep.task_values,
            "state_names": list(ep.state_names),
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
        state=np.concatenate([ep.state for ep in episodes]),
        rows=np.concatenate([ep.rows for ep in episodes]),
        perturbed=np.concatenate([ep.perturbed for ep in episodes]),
    )


def load_episodes(path: str | Path) -> list[Episode]:
    with np.load(path, allow_pickle=False) as data:
        index = json.loads(data["index"].tobytes().decode())
        arrays = {k: data[k] for k in ("frames", "state", "rows", "perturbed")}
    out, f0, r0 = [], 0, 0
    for item in index:
        task = get_task(item["task"])
        nf, nr = item["frames"], item["rows"]
        out.append(
            task.episode_type(
                setup=task.setup_from_dict(item["setup"]),
                frames=arrays["frames"][f0 : f0 + nf],
                state=arrays["state"][f0 : f0 + nf],
                state_names=tuple(item["state_names"]),
                rows=arrays["rows"][r0 : r0 + nr],
                perturbed=arrays["perturbed"][r0 : r0 + nr],
                task_values=item["task_values"],
                reached_s=item["reached_s"],
            )
        )
        f0, r0 = f0 + nf, r0 + nr
    return out


class GoalEpisodes:
    """A task's episodes one after another on a robot's clock (ns): each starts the scene at
    the next seed's setup (``seed``, ``seed + 1``, ...), ends ``pause_s`` after its goal was
    reached or at the task's time limit, and the next one starts; counts what happened. The
    caller steps the scene (``after_step`` after each step)."""

    def __init__(self, seed: int, pause_s: float, task: str = "push") -> None:
        self.task = get_task(task)
        self.seed0, self.pause_ns = seed, int(pause_s * 1e9)
        self.index = 0
        self.started_ns = 0
        self.reached_ns: int | None = None
        self.finished = self.successes = 0
        self.times_to_goal_s: list[float] = []
        self.expert = None

    def start(self, scene, now_ns: int) -> None:
        setup = self.task.sample(self.seed0 + self.index)
        self.task.start(scene, setup)
        self.expert = self.task.expert(setup)
        self.started_ns, self.reached_ns = now_ns, None

    def after_step(self, scene, now_ns: int) -> str | None:
        """A line for the log when an episode ended (and the next one started), else None."""
        task = self.task
        elapsed_s = (now_ns - self.started_ns) / 1e9
        if self.reached_ns is None and task.succeeded(scene):
            self.reached_ns = now_ns
        done = self.reached_ns is not None and now_ns - self.reached_ns >= self.pause_ns
        if not done and not (self.reached_ns is None and elapsed_s >= task.time_limit_s):
            return None
        # Counted as the episode ends (after its pause), so successes never run ahead of
        # the finished episodes they are a share of.
        self.finished += 1
        if self.reached_ns is not None:
            self.successes += 1
            self.times_to_goal_s.append((self.reached_ns - self.started_ns) / 1e9)
        line = (
            f"{task.label} episode {self.index} (seed {self.seed0 + self.index}): "
            + (
                f"reached the goal in {self.times_to_goal_s[-1]:.2f} s"
                if self.reached_ns is not None
                else f"not within {task.time_limit_s:g} s ({task.moved} "
                f"{task.error_m(scene):.3f} m from the goal)"
            )
            + f"; {self.successes} of {self.finished} so far"
        )
        self.index += 1
        self.start(scene, now_ns)
        return line

    def report(self, scene) -> dict:
        return {
            "episode": self.index,
            "seed": self.seed0 + self.index,
            "finished": self.finished,
            "successes": self.successes,
            "median_time_to_goal_s": (
                f"{float(np.median(self.times_to_goal_s)):.2f}" if self.times_to_goal_s else "-"
            ),
            f"{self.task.moved.replace(' ', '_')}_to_goal_m": f"{self.task.error_m(scene):.3f}",
        }
