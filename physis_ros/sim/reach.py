"""The reach task: a 3-joint planar arm puts its tool tip on a target marker that moves
between episodes (numpy only, no ROS, no torch).

What belongs here: the reaching arm (``ReachScene``: PD-driven shoulder, elbow and wrist on
the table of ``physis_ros.sim.table``, nothing to touch, seen by the same top-down camera),
drawing an episode's start and target from a seed, the scripted expert (``ReachExpert``) and
``ReachTask``, the task as ``physis_ros.sim.base`` defines one (``REACH``). Its robot reports
joint positions and velocities only (no wrench, no tracked object); its task values are the
target's coordinates, which condition its model as a ``task_features`` prompt and enter its
state, as push's goal does.

The arm's inverse kinematics is made unique: the tool points radially away from the base
(the wrist on the line from the base to the tip) and the elbow bends positive; the expert
moves the joint targets straight towards that configuration, at a bounded speed that falls
near it, so it recovers from wherever a perturbation left the arm.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from physis_ros.contract.model import PromptSpec, StateInput
from physis_ros.sim import base
from physis_ros.sim.table import (
    BASE_RGB,
    BASE_XY,
    GOAL_RGB,
    LINK_RGB,
    TOOL_RGB,
    SceneConfig,
    TopDownCamera,
)

JOINT_NAMES = ("shoulder", "elbow", "wrist")
LINK_LENGTHS_M = (0.30, 0.25, 0.15)
JOINT_LIMITS = ((0.05, math.pi - 0.05), (-2.6, 2.6), (-2.2, 2.2))  # rad
JOINT_INERTIA = (0.06, 0.025, 0.008)  # kg·m², effective, decoupled
JOINT_KP = (9.0, 4.0, 1.5)  # N·m/rad
JOINT_KD = (1.2, 0.5, 0.18)  # N·m·s/rad: damping ratio about 0.8, settles in ~0.3 s
JOINT_TORQUE_LIMIT = 4.0  # N·m
SUBSTEP_S = 0.002
TARGET_RADIUS_M = 0.04
TOOL_RADIUS_M = 0.02
LINK_HALF_WIDTHS_M = (0.025, 0.02, 0.015)

TOLERANCE_M = 0.04
"""An episode succeeds when the tool tip is within this distance of the target ..."""
SETTLED_M_S = 0.1
"""... moving slower than this (placed there, not swept through) ..."""
TIME_LIMIT_S = 10.0
"""... within this many seconds of simulated time."""
TARGET_SCALE_M = 0.5
"""The target's coordinates are divided by this (the table's half-width) in its prompt."""
STATE_NAMES = (
    *(f"{j}_pos" for j in JOINT_NAMES),
    *(f"{j}_vel" for j in JOINT_NAMES),
)
TARGET_NAMES = ("target_x", "target_y")
_TARGET_REACH_M = (0.34, 0.62)
"""Targets lie this far from the base (the arm folds to about 0.3 m and reaches 0.70 m)."""
_LIMIT_MARGIN_RAD = 0.1


def forward_kinematics(q: np.ndarray) -> np.ndarray:
    """[4, 2] the base, elbow, wrist and tool tip (table frame, m) for joint angles ``q`` [3]."""
    points = [np.array(BASE_XY, dtype=np.float64)]
    angle = 0.0
    for qi, length in zip(q, LINK_LENGTHS_M, strict=True):
        angle += float(qi)
        points.append(points[-1] + length * np.array([math.cos(angle), math.sin(angle)]))
    return np.stack(points)


def inverse_kinematics(xy) -> np.ndarray | None:
    """The joint angles [3] that put the tool tip at ``xy`` with the tool pointing away from
    the base and the elbow bent positive; None where that is out of reach or beyond a joint
    limit (with a margin)."""
    l1, l2, l3 = LINK_LENGTHS_M
    dx, dy = float(xy[0]) - BASE_XY[0], float(xy[1]) - BASE_XY[1]
    phi = math.atan2(dy, dx)
    wrist = math.hypot(dx, dy) - l3
    cos_elbow = (wrist**2 - l1**2 - l2**2) / (2 * l1 * l2)
    if wrist <= 0 or abs(cos_elbow) > 1:
        return None
    elbow = math.acos(cos_elbow)
    shoulder = phi - math.atan2(l2 * math.sin(elbow), l1 + l2 * math.cos(elbow))
    q = np.array([shoulder, elbow, phi - shoulder - elbow])
    lo = np.array([a for a, _ in JOINT_LIMITS]) + _LIMIT_MARGIN_RAD
    hi = np.array([b for _, b in JOINT_LIMITS]) - _LIMIT_MARGIN_RAD
    return q if bool(np.all((q >= lo) & (q <= hi))) else None


class ReachScene:
    """The reaching arm's state and physics; ``step`` advances it, ``render`` draws the
    camera image with the target marker (``target_xy``; None: none drawn)."""

    joint_names: tuple[str, ...] = JOINT_NAMES
    link_lengths_m: tuple[float, ...] = LINK_LENGTHS_M

    def __init__(self, cfg: SceneConfig) -> None:
        self.cfg = cfg
        self._q = np.array([1.6, 1.6, -0.6])
        self._qd = np.zeros(3)
        self.time_s = 0.0
        self.target_xy: np.ndarray | None = None
        self._camera = TopDownCamera(cfg.image_height, cfg.image_width)

    def set_state(self, *, joints: np.ndarray) -> None:
        """Place the arm at rest: the start of an episode."""
        self._q = np.clip(np.asarray(joints, dtype=np.float64).reshape(3), *self._limits())
        self._qd = np.zeros(3)

    def joint_positions(self) -> np.ndarray:
        return self._q.copy()

    def joint_velocities(self) -> np.ndarray:
        return self._qd.copy()

    def end_effector_xy(self) -> np.ndarray:
        return forward_kinematics(self._q)[-1]

    def tip_speed_m_s(self) -> float:
        """How fast the tool tip moves (the Jacobian times the joint velocities)."""
        angles = np.cumsum(self._q)
        speed = np.zeros(2)
        for i in range(3):  # joint i turns every link from i on
            for j in range(i, 3):
                a = angles[j]
                speed += self._qd[i] * LINK_LENGTHS_M[j] * np.array([-math.sin(a), math.cos(a)])
        return float(np.linalg.norm(speed))

    def step(self, dt_s: float, joint_targets: np.ndarray) -> None:
        """Advance ``dt_s`` seconds with the joints' PD controllers tracking ``joint_targets``
        (radians, one per joint; clipped to the joint limits)."""
        if not (math.isfinite(dt_s) and 0.0 < dt_s <= 1.0):
            raise ValueError(f"dt_s must be in (0, 1] seconds, got {dt_s!r}")
        targets = np.asarray(joint_targets, dtype=np.float64).reshape(-1)
        if targets.shape != (3,) or not np.all(np.isfinite(targets)):
            raise ValueError(f"joint_targets must be 3 finite values, got {joint_targets!r}")
        lo, hi = self._limits()
        targets = np.clip(targets, lo, hi)
        n_sub = max(1, math.ceil(dt_s / SUBSTEP_S - 1e-9))
        h = dt_s / n_sub
        kp, kd, inertia = np.array(JOINT_KP), np.array(JOINT_KD), np.array(JOINT_INERTIA)
        limit = JOINT_TORQUE_LIMIT
        for _ in range(n_sub):  # semi-implicit Euler
            tau = np.clip(kp * (targets - self._q) - kd * self._qd, -limit, limit)
            qd = self._qd + h * tau / inertia
            q = self._q + h * qd
            at_limit = (q < lo) | (q > hi)
            self._q = np.clip(q, lo, hi)
            self._qd = np.where(at_limit, 0.0, qd)
        self.time_s += dt_s

    @staticmethod
    def _limits() -> tuple[np.ndarray, np.ndarray]:
        return np.array([a for a, _ in JOINT_LIMITS]), np.array([b for _, b in JOINT_LIMITS])

    def render(self) -> np.ndarray:
        """[H, W, 3] uint8 top-down camera image: the table, the target, the arm."""
        cam = self._camera
        img = cam.table()
        if self.target_xy is not None:
            cam.paint(img, cam.disk(self.target_xy, TARGET_RADIUS_M), GOAL_RGB)
        points = forward_kinematics(self._q)
        for a, b, half in zip(points[:-1], points[1:], LINK_HALF_WIDTHS_M, strict=True):
            cam.paint(img, cam.segment(a, b, half), LINK_RGB)
        cam.paint(img, cam.disk(points[-1], TOOL_RADIUS_M), TOOL_RGB)
        cam.paint(img, cam.disk(points[0], 0.04), BASE_RGB)
        return cam.to_uint8(img)


@dataclass(frozen=True)
class ReachSetup:
    """One episode's start and target (table frame, metres / radians)."""

    task: ClassVar[str] = "reach"
    seed: int
    joints: tuple[float, float, float]
    target_xy: tuple[float, float]


def _in_view(points: np.ndarray) -> bool:
    return bool(np.all(np.abs(points[:, 0]) <= 0.5) and np.all(np.abs(points[:, 1]) <= 0.5))


def sample_reach(seed: int) -> ReachSetup:
    """A start and target drawn from ``seed``: the target where the arm reaches it, the arm
    at rest somewhere in view at least 0.15 m from it."""
    if not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be a non-negative int, got {seed!r}")
    rng = np.random.default_rng([seed, 0x4EAC])
    while True:
        target = np.array([rng.uniform(-0.45, 0.45), rng.uniform(-0.35, 0.4)])
        reach = math.hypot(target[0] - BASE_XY[0], target[1] - BASE_XY[1])
        lo, hi = _TARGET_REACH_M
        if lo <= reach <= hi and inverse_kinematics(target) is not None:
            break
    while True:
        q = np.array([rng.uniform(0.4, 2.7), rng.uniform(0.4, 2.3), rng.uniform(-1.5, 1.0)])
        points = forward_kinematics(q)
        if _in_view(points[1:]) and np.linalg.norm(points[-1] - target) >= 0.15:
            break
    return ReachSetup(
        seed=seed,
        joints=(float(q[0]), float(q[1]), float(q[2])),
        target_xy=(float(target[0]), float(target[1])),
    )


class ReachExpert:
    """Joint targets straight towards the target's configuration (``inverse_kinematics``),
    all joints arriving together, at most MAX_SPEED_RAD_S on the joint with the farthest to
    go, slowing down within SLOW_RAD of it (the arm arrives nearly at rest)."""

    MAX_SPEED_RAD_S = 1.5
    SLOW_RAD = 0.25
    MIN_SPEED_FRACTION = 0.2

    def __init__(self, target_xy) -> None:
        q = inverse_kinematics(target_xy)
        if q is None:
            raise ValueError(f"target {tuple(target_xy)} is out of the arm's reach")
        self.goal_q = q

    def joint_targets(self, scene: ReachScene, previous: np.ndarray, dt_s: float) -> np.ndarray:
        delta = self.goal_q - previous
        far = float(np.abs(delta).max())
        fraction = min(1.0, max(self.MIN_SPEED_FRACTION, far / self.SLOW_RAD))
        limit = self.MAX_SPEED_RAD_S * fraction * dt_s
        if far > limit:
            delta = delta * (limit / far)
        return previous + delta


class ReachTask(base.Task):
    """The reach task (module docstring)."""

    name = "reach"
    label = "reach"
    joint_names = JOINT_NAMES
    state_names = STATE_NAMES
    task_value_names = TARGET_NAMES
    model_state = (
        *(StateInput(f"{j}_pos", "joint_position", j) for j in JOINT_NAMES),
        *(StateInput(f"{j}_vel", "joint_velocity", j) for j in JOINT_NAMES),
        *(StateInput(n, "task", n) for n in TARGET_NAMES),
    )
    prompt = PromptSpec("task_features", TARGET_NAMES, TARGET_SCALE_M)
    setup_type = ReachSetup
    scene_type = ReachScene
    default_model = "reach-wam"
    moved = "tool tip"
    goal_topic = "target"
    time_limit_s = TIME_LIMIT_S
    tolerance_m = TOLERANCE_M

    @property
    def success_text(self) -> str:
        return f"tool tip within {TOLERANCE_M} m of the target, moving under {SETTLED_M_S} m/s"

    def sample(self, seed: int) -> ReachSetup:
        return sample_reach(seed)

    def start(self, scene: ReachScene, setup: ReachSetup) -> None:
        scene.set_state(joints=np.array(setup.joints))
        scene.target_xy = np.array(setup.target_xy)

    def goal_xy(self, scene: ReachScene) -> np.ndarray:
        return scene.target_xy

    def moved_xy(self, scene: ReachScene) -> np.ndarray:
        return scene.end_effector_xy()

    def succeeded(self, scene: ReachScene) -> bool:
        return self.error_m(scene) <= TOLERANCE_M and scene.tip_speed_m_s() <= SETTLED_M_S

    def state(self, scene: ReachScene) -> np.ndarray:
        return np.concatenate([scene.joint_positions(), scene.joint_velocities()]).astype(
            np.float32
        )

    def expert(self, setup: ReachSetup) -> ReachExpert:
        return ReachExpert(setup.target_xy)

    def task_values(self, setup: ReachSetup) -> dict[str, float]:
        return dict(zip(TARGET_NAMES, (float(v) for v in setup.target_xy), strict=True))


REACH = ReachTask()
