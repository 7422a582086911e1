"""The goal-push task: push the box onto a goal marker, with a scripted expert.

What belongs here (numpy only, no ROS, no torch): sampling an episode's start (arm, box) and
goal from a seed, the expert (a feedback pusher that re-approaches whenever the box slips off
its line), the robot's state by name (joint positions and velocities, the tip's wrench, the
box's pose from an object tracker) and ``PushTask``, the task as ``physis_ros.sim.base``
defines one (``PUSH``). The world-action model ``push-wam`` is trained on the expert's
episodes (``physis_ros.sim.episodes``) and driven by it in the closed loop
(``physis_ros.eval.closed_loop``). The clock is every task's (``physis_ros.sim.base``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from physis_ros.contract.model import PromptSpec, StateInput
from physis_ros.sim import base
from physis_ros.sim.scene import (
    BASE_XY,
    BOX_HALF_M,
    JOINT_LIMITS,
    LINK_LENGTHS_M,
    PUSHER_RADIUS_M,
    PushScene,
    ScriptedPolicy,
    forward_kinematics,
    in_push_region,
    inverse_kinematics,
)

GOAL_TOLERANCE_M = 0.05
"""An episode succeeds when the box centre comes within this distance of the goal ..."""
TIME_LIMIT_S = 15.0
"""... within this many seconds of simulated time."""
STATE_NAMES = (
    "shoulder_pos",
    "elbow_pos",
    "shoulder_vel",
    "elbow_vel",
    "force_x",
    "force_y",
    "force_z",
    "torque_x",
    "torque_y",
    "torque_z",
)
"""The proprioceptive vector per camera frame: joint_states positions and velocities, then
the wrench (force N, torque N·m), as the bridge forwards them."""
GOAL_STATE_NAMES = ("goal_x", "goal_y")
"""The task's values: its goal (table frame, m), the same in every frame. push-wam's state
columns after the proprioception; the server fills them from the stream's goal prompt; the
bridge sends no goal with an observation."""
BOX_STATE_NAMES = ("box_x", "box_y")
"""push-wam's last state columns: the box centre (table frame, m) at each frame, as an object
tracker on the robot (a fiducial tag, motion capture) publishes it. The camera shows the box
too, but one of its 32x32 pixels spans 3.4 cm of table: coarse for pushing the box onto a
goal 5 cm wide."""
BOX_POSE_NAMES = (*BOX_STATE_NAMES, "box_yaw")
"""The box's pose (m, m, rad) as the task reports it each frame (the yaw for plots only)."""
MODEL_STATE_NAMES = STATE_NAMES + GOAL_STATE_NAMES + BOX_STATE_NAMES
"""A model with state_dim S takes the first S of these (push-wam all of them; the wrench
ablation push-wam-nowrench all but WRENCH_SLICE: ``train.wam_data.state_names``)."""
WRENCH_SLICE = slice(4, 10)
GOAL_SCALE_M = 0.5
"""A goal's coordinates are divided by this (the table's half-width) in push-wam's prompt."""
CONTACT_M = BOX_HALF_M + PUSHER_RADIUS_M
"""Pusher centre to box centre when the pusher touches the middle of a face."""
_MIN_REACH_M, _MAX_REACH_M = 0.24, 0.62
"""Where the expert's waypoints may lie (the arm folds to 0.16 m and reaches 0.70 m)."""


def goal_prompt_name(goal_xy) -> str:
    """The prompt a goal-prompted model's stream is opened with for this goal (table frame, m;
    1 mm steps): ``engine.prompts.parse_goal_prompt_name`` reads it on the server."""
    return "goal_xy_{:.3f}_{:.3f}".format(*(float(v) for v in goal_xy))


@dataclass(frozen=True)
class TaskSetup:
    """One episode's start and goal (table frame, metres / radians)."""

    task: ClassVar[str] = "push"
    seed: int
    joints: tuple[float, float]
    box_xy: tuple[float, float]
    box_yaw: float
    goal_xy: tuple[float, float]


def _reachable(xy: np.ndarray) -> bool:
    """Whether the tip reaches ``xy`` with the elbow bent positive (the one branch the task
    uses: switching branches would sweep the arm through the scene), with some margin to the
    joint limits."""
    l1, l2 = LINK_LENGTHS_M
    dx, dy = float(xy[0]) - BASE_XY[0], float(xy[1]) - BASE_XY[1]
    reach = math.hypot(dx, dy)
    if not (_MIN_REACH_M <= reach <= _MAX_REACH_M and abs(float(xy[0])) <= 0.45):
        return False
    elbow = math.acos(max(-1.0, min(1.0, (reach**2 - l1**2 - l2**2) / (2 * l1 * l2))))
    shoulder = math.atan2(dy, dx) - math.atan2(l2 * math.sin(elbow), l1 + l2 * math.cos(elbow))
    (s_lo, s_hi), (_, e_hi) = JOINT_LIMITS
    return s_lo + 0.1 <= shoulder <= s_hi - 0.1 and elbow <= e_hi - 0.1


def sample_task(seed: int) -> TaskSetup:
    """A start and goal drawn from ``seed``: box and goal 0.12-0.35 m apart where the arm can
    push, the arm somewhere else. Held-out seeds give starts and goals never trained on."""
    if not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be a non-negative int, got {seed!r}")
    rng = np.random.default_rng([seed, 0x9A11])
    while True:
        box = np.array([rng.uniform(-0.3, 0.3), rng.uniform(-0.25, 0.2)])
        goal = np.array([rng.uniform(-0.3, 0.3), rng.uniform(-0.25, 0.2)])
        dist = float(np.linalg.norm(goal - box))
        if not (in_push_region(box) and in_push_region(goal) and 0.12 <= dist <= 0.35):
            continue
        d = (goal - box) / dist
        # the pusher must reach behind the box at the start and at the goal
        behind = CONTACT_M + 0.05
        if all(map(_reachable, (box, goal, box - d * behind, goal - d * behind))):
            break
    while True:
        ee = np.array([rng.uniform(-0.35, 0.35), rng.uniform(-0.3, 0.1)])
        if _reachable(ee) and np.linalg.norm(ee - box) > 0.2:
            break
    joints = inverse_kinematics(ee, np.array([1.2, 1.5]))  # the elbow-positive branch
    return TaskSetup(
        seed=seed,
        joints=(float(joints[0]), float(joints[1])),
        box_xy=(float(box[0]), float(box[1])),
        box_yaw=float(rng.uniform(-math.pi, math.pi)),
        goal_xy=(float(goal[0]), float(goal[1])),
    )


class TaskSim(base.TaskSim):
    """The push scene at an episode's start, stepped one physics tick at a time."""

    def __init__(self, setup: TaskSetup, *, image_size: tuple[int, int] = (32, 32)) -> None:
        super().__init__(PUSH, setup, image_size=image_size)


class GoalPushExpert:
    """A feedback pusher. ``approach``: to a point behind the box on the goal line, orbiting
    the box at a safe distance while the straight way would hit it; ``push``: through the box
    towards the goal while the pusher stays behind it and near the line, else approach again;
    ``done``: back off once the box is on the goal (and approach again if it leaves). The
    pusher moves in straight lines at a bounded speed (inverse kinematics of small steps), so
    the joint targets are smooth.

    Going round, it keeps clear of the box with a margin for a learned imitation's errors: a
    pusher nearer than BACK_OFF_M (and not behind the box) first backs straight out to the
    orbit instead of sliding round. A model trained on the expert that slid round from
    contact did the same from closer still and swept the box off (docs/push_wam)."""

    MAX_EE_SPEED_M_S = 0.35
    MIN_PUSH_SPEED_M_S = 0.06
    MAX_TARGET_SPEED_RAD_S = 2.0
    STOP_M = 0.015
    """The box counts as on the goal for the expert (tighter than GOAL_TOLERANCE_M)."""
    _BEHIND_M = CONTACT_M + 0.045
    _ORBIT_M = 0.19
    """Orbit radius round the box centre: clear of its corners (0.099 m), the pusher (0.035 m)
    and 5.6 cm more."""
    BACK_OFF_M = 0.145
    """Going round, a pusher centre nearer the box centre than this backs straight out first:
    at a corner the pusher touches the box at 0.134 m."""

    def __init__(self, goal_xy: np.ndarray) -> None:
        self.goal = np.asarray(goal_xy, dtype=np.float64)
        self.phase = "approach"
        self._direction = np.array([0.0, 1.0])

    def waypoint(self, box_xy: np.ndarray, ee_xy: np.ndarray) -> np.ndarray:
        """Where the pusher should head now (table frame, m); updates the phase."""
        to_goal = self.goal - box_xy
        dist = float(np.linalg.norm(to_goal))
        if dist < self.STOP_M or (self.phase == "done" and dist < 2 * GOAL_TOLERANCE_M / 3):
            self.phase = "done"
            return box_xy - self._direction * (self._BEHIND_M + 0.03)
        d = to_goal / dist
        self._direction = d
        n = np.array([-d[1], d[0]])
        rel = ee_xy - box_xy
        along, lateral = float(rel @ d), float(rel @ n)
        through = box_xy + d * min(0.06, dist + 0.01)
        if self.phase == "push":
            lost = abs(lateral) > 0.04 or along > -BOX_HALF_M or along < -(CONTACT_M + 0.09)
            if not lost:
                # aim through the box: the pusher stays in contact and drives it along d
                # (a short aim near the goal so that the box stops there)
                return through - n * lateral
        self.phase = "approach"
        behind = box_xy - d * self._BEHIND_M
        if np.linalg.norm(ee_xy - behind) < 0.02:
            self.phase = "push"
            return through
        at = math.atan2(rel[1], rel[0])
        gap = (math.atan2(-d[1], -d[0]) - at + math.pi) % (2 * math.pi) - math.pi
        if abs(gap) < math.radians(25):  # already behind the box: straight in
            return behind
        r = float(np.linalg.norm(rel))
        if 1e-6 < r < self.BACK_OFF_M:  # too near to go round: straight out to the orbit first
            return box_xy + rel / r * self._ORBIT_M
        far = box_xy - d * self._ORBIT_M
        if _segment_clearance(ee_xy, far, box_xy) >= self._ORBIT_M - 0.01:
            return far
        # orbit: a point on the circle, at most 50 degrees further round towards behind, the
        # way round that the arm can reach (near its base it cannot)
        radius = max(self._ORBIT_M, min(r, self._ORBIT_M + 0.05))
        arc = min(
            (gap, gap - math.copysign(2 * math.pi, gap)),
            key=lambda a: (not self._arc_reachable(box_xy, radius, at, a), abs(a)),
        )
        turn = at + math.copysign(min(abs(arc), math.radians(50)), arc)
        return box_xy + radius * np.array([math.cos(turn), math.sin(turn)])

    @staticmethod
    def _arc_reachable(centre: np.ndarray, radius: float, start: float, arc: float) -> bool:
        steps = max(2, int(abs(arc) / math.radians(15)) + 1)
        return all(
            _reachable(centre + radius * np.array([math.cos(a), math.sin(a)]))
            for a in np.linspace(start, start + arc, steps)[1:]
        )

    def joint_targets(self, scene: PushScene, previous: np.ndarray, dt_s: float) -> np.ndarray:
        """The next row: the commanded tip (forward kinematics of ``previous``, the row in
        force) moved at most MAX_EE_SPEED_M_S * dt_s towards the waypoint, by inverse
        kinematics near ``previous``."""
        box = scene.box_pose()[:2]
        goal = self.waypoint(box, scene.end_effector_xy())
        tip = forward_kinematics(previous)[1]
        step = goal - tip
        norm = float(np.linalg.norm(step))
        speed = self.MAX_EE_SPEED_M_S
        if self.phase == "push":  # slow down near the goal: the box slides on after a push
            remaining = float(np.linalg.norm(self.goal - box))
            speed = min(speed, max(self.MIN_PUSH_SPEED_M_S, 3.0 * remaining))
        limit_m = speed * dt_s
        if norm > limit_m:
            step *= limit_m / norm
        q = inverse_kinematics(tip + step, previous)
        limit = self.MAX_TARGET_SPEED_RAD_S * dt_s
        return previous + np.clip(q - previous, -limit, limit)


def _segment_clearance(a: np.ndarray, b: np.ndarray, p: np.ndarray) -> float:
    """Distance from point p to the segment a-b."""
    ab = b - a
    t = float(np.clip((p - a) @ ab / max(float(ab @ ab), 1e-12), 0.0, 1.0))
    return float(np.linalg.norm(a + t * ab - p))


class PushEpisode(base.Episode):
    """A push episode, with its robot's proprioception and the box's pose by push's names."""

    @property
    def proprio(self) -> np.ndarray:
        """[N, len(STATE_NAMES)] joint positions, velocities and the wrench at each frame."""
        return self.values(STATE_NAMES)

    @property
    def box(self) -> np.ndarray:
        """[N, 3] the box's pose (x, y, yaw) at each frame."""
        return self.values(BOX_POSE_NAMES)


class PushTask(base.Task):
    """The goal-push task (module docstring)."""

    name = "push"
    label = "goal_push"
    joint_names = PushScene.joint_names
    state_names = STATE_NAMES + BOX_POSE_NAMES
    task_value_names = GOAL_STATE_NAMES
    model_state = (
        *(StateInput(f"{j}_pos", "joint_position", j) for j in PushScene.joint_names),
        *(StateInput(f"{j}_vel", "joint_velocity", j) for j in PushScene.joint_names),
        *(StateInput(n, "wrench", n) for n in STATE_NAMES[WRENCH_SLICE]),
        *(StateInput(n, "task", n) for n in GOAL_STATE_NAMES),
        *(StateInput(n, "object", f"box.{n[-1]}") for n in BOX_STATE_NAMES),
    )
    prompt = PromptSpec("task_features", GOAL_STATE_NAMES, GOAL_SCALE_M)
    setup_type = TaskSetup
    scene_type = PushScene
    default_model = "push-wam"
    moved = "box"
    has_wrench = True
    objects = ("box",)
    goal_topic = "goal"
    episode_type = PushEpisode
    time_limit_s = TIME_LIMIT_S
    tolerance_m = GOAL_TOLERANCE_M

    @property
    def success_text(self) -> str:
        return f"box centre within {GOAL_TOLERANCE_M} m of the goal"

    def sample(self, seed: int) -> TaskSetup:
        return sample_task(seed)

    def start(self, scene: PushScene, setup: TaskSetup) -> None:
        scene.set_state(
            joints=np.array(setup.joints), box_xy=np.array(setup.box_xy), box_yaw=setup.box_yaw
        )
        scene.goal_xy = np.array(setup.goal_xy)

    def goal_xy(self, scene: PushScene) -> np.ndarray:
        return scene.goal_xy

    def moved_xy(self, scene: PushScene) -> np.ndarray:
        return scene.box_pose()[:2]

    def object_xy(self, scene: PushScene, name: str) -> np.ndarray:
        """The tracked object's position (table frame, m): the box centre."""
        return scene.box_pose()[:2]

    def state(self, scene: PushScene) -> np.ndarray:
        parts = [
            scene.joint_positions(),
            scene.joint_velocities(),
            scene.wrench(),
            scene.box_pose(),
        ]
        return np.concatenate(parts).astype(np.float32)

    def expert(self, setup: TaskSetup) -> GoalPushExpert:
        return GoalPushExpert(np.array(setup.goal_xy))

    def task_values(self, setup: TaskSetup) -> dict[str, float]:
        return dict(zip(GOAL_STATE_NAMES, (float(v) for v in setup.goal_xy), strict=True))

    def free_policy(self, seed: int) -> ScriptedPolicy:
        return ScriptedPolicy(seed)


PUSH = PushTask()
