"""A planar 2-link arm pushing a box on a table, seen by a top-down camera (numpy only).

What belongs here: the scene's physics (PD-driven joints, a pusher disk on the arm's tip in
penalty contact with a box that slides with table friction), its renderer, and a scripted
policy with varied behaviour (reaches, pushes, wiggles, holds). No ROS, no torch: the
``sim_robot`` node wraps this, the headless recorder (``physis_ros.sim.record``) records it.

Frames: the table frame ``table`` (``physis_ros.sim.table``); the arm's base sits at
``BASE_XY``. Everything is deterministic given ``SceneConfig.seed`` and the sequence of
calls.
"""

from __future__ import annotations

import math

import numpy as np

from physis_ros.sim.table import (
    BASE_RGB,
    BASE_XY,
    GOAL_RADIUS_M,
    GOAL_RGB,
    LINK_RGB,
    TABLE_HALF_M,
    TOOL_RGB,
    SceneConfig,
    TopDownCamera,
)

LINK_LENGTHS_M = (0.38, 0.32)
PUSHER_RADIUS_M = 0.035
BOX_HALF_M = 0.07
"""The box stays inside [-TABLE_HALF_M, TABLE_HALF_M]^2 (the rim stops it)."""
BOX_MASS_KG = 0.4
JOINT_INERTIA = (0.08, 0.03)  # kg·m², effective, decoupled
JOINT_KP = (11.0, 4.5)  # N·m/rad
JOINT_KD = (1.5, 0.6)  # N·m·s/rad: about critically damped, settles in ~0.3 s
JOINT_TORQUE_LIMIT = 4.0  # N·m
JOINT_LIMITS = ((0.05, math.pi - 0.05), (-2.7, 2.7))  # rad
CONTACT_STIFFNESS = 2500.0  # N/m
CONTACT_DAMPING = 15.0  # N·s/m
CONTACT_FRICTION = 0.4
TABLE_FRICTION = 0.35
GRAVITY = 9.81
SUBSTEP_S = 0.002

BOX_RGB = (200, 45, 40)
BOX_STRIPE_RGB = (250, 240, 240)


def forward_kinematics(q: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(elbow_xy, end_effector_xy) in metres, frame ``table``, for joint angles ``q`` [2]."""
    l1, l2 = LINK_LENGTHS_M
    elbow = np.array([BASE_XY[0] + l1 * math.cos(q[0]), BASE_XY[1] + l1 * math.sin(q[0])])
    ee = elbow + l2 * np.array([math.cos(q[0] + q[1]), math.sin(q[0] + q[1])])
    return elbow, ee


def inverse_kinematics(xy: np.ndarray, q_near: np.ndarray) -> np.ndarray:
    """Joint angles that put the end effector at ``xy`` (clamped to reach), within limits,
    choosing the elbow branch closest to ``q_near``."""
    l1, l2 = LINK_LENGTHS_M
    dx, dy = float(xy[0]) - BASE_XY[0], float(xy[1]) - BASE_XY[1]
    r = min(max(math.hypot(dx, dy), abs(l1 - l2) + 1e-3), l1 + l2 - 1e-3)
    phi = math.atan2(dy, dx)
    cos_q2 = (r * r - l1 * l1 - l2 * l2) / (2 * l1 * l2)
    best, best_cost = None, math.inf
    for sign in (1.0, -1.0):
        q2 = sign * math.acos(max(-1.0, min(1.0, cos_q2)))
        q1 = phi - math.atan2(l2 * math.sin(q2), l1 + l2 * math.cos(q2))
        q1 = (q1 + math.pi) % (2 * math.pi) - math.pi
        cand = np.clip([q1, q2], [lo for lo, _ in JOINT_LIMITS], [hi for _, hi in JOINT_LIMITS])
        cost = float(np.sum((cand - q_near) ** 2)) + (0.0 if np.allclose(cand, [q1, q2]) else 10.0)
        if cost < best_cost:
            best, best_cost = cand, cost
    return np.asarray(best, dtype=np.float64)


def in_push_region(xy: np.ndarray) -> bool:
    """Whether a box centred at ``xy`` lies where the arm can push it in any direction."""
    reach = float(np.hypot(xy[0] - BASE_XY[0], xy[1] - BASE_XY[1]))
    return 0.3 <= reach <= 0.55 and abs(float(xy[0])) <= 0.35 and float(xy[1]) <= 0.25


class PushScene:
    """The scene's state and physics; ``step`` advances it, ``render`` draws the camera image."""

    joint_names: tuple[str, ...] = ("shoulder", "elbow")
    link_lengths_m: tuple[float, ...] = LINK_LENGTHS_M

    def __init__(self, cfg: SceneConfig) -> None:
        self.cfg = cfg
        rng = np.random.default_rng(cfg.seed)
        self._q = inverse_kinematics(
            np.array([rng.uniform(-0.3, 0.3), rng.uniform(-0.35, -0.15)]), np.array([1.2, 1.0])
        )
        self._qd = np.zeros(2)
        # box somewhere the arm can reach, not on top of the pusher
        while True:
            box = np.array([rng.uniform(-0.35, 0.35), rng.uniform(-0.3, 0.25)])
            if in_push_region(box) and np.linalg.norm(box - forward_kinematics(self._q)[1]) > 0.18:
                break
        self._box = box
        self._box_yaw = float(rng.uniform(-math.pi, math.pi))
        self._box_v = np.zeros(2)
        self._box_w = 0.0
        self._wrench = np.zeros(6)
        self.time_s = 0.0
        self.goal_xy: np.ndarray | None = None
        """Where a goal task wants the box (drawn as a green disk); None: no goal drawn."""
        self._camera = TopDownCamera(cfg.image_height, cfg.image_width)

    def set_state(self, *, joints: np.ndarray, box_xy: np.ndarray, box_yaw: float) -> None:
        """Place the arm (at rest) and the box (still): the start of a goal task's episode."""
        lo = np.array([a for a, _ in JOINT_LIMITS])
        hi = np.array([b for _, b in JOINT_LIMITS])
        self._q = np.clip(np.asarray(joints, dtype=np.float64).reshape(2), lo, hi)
        self._qd = np.zeros(2)
        self._box = np.asarray(box_xy, dtype=np.float64).reshape(2).copy()
        self._box_yaw = float(box_yaw)
        self._box_v = np.zeros(2)
        self._box_w = 0.0
        self._wrench = np.zeros(6)

    # ---- state ----
    def joint_positions(self) -> np.ndarray:
        return self._q.copy()

    def joint_velocities(self) -> np.ndarray:
        return self._qd.copy()

    def wrench(self) -> np.ndarray:
        """[6] contact force on the pusher (N, xyz) and torque about the tip (N·m, xyz),
        averaged over the last ``step`` (as a sensor with a low-pass would report it)."""
        return self._wrench.copy()

    def end_effector_xy(self) -> np.ndarray:
        return forward_kinematics(self._q)[1]

    def box_pose(self) -> np.ndarray:
        """[x_m, y_m, yaw_rad] of the box in frame ``table``."""
        return np.array([self._box[0], self._box[1], self._box_yaw])

    # ---- physics ----
    def step(self, dt_s: float, joint_targets: np.ndarray) -> None:
        """Advance ``dt_s`` seconds with the joints' PD controllers tracking ``joint_targets``
        (radians, one per joint; clipped to the joint limits)."""
        if not (math.isfinite(dt_s) and 0.0 < dt_s <= 1.0):
            raise ValueError(f"dt_s must be in (0, 1] seconds, got {dt_s!r}")
        targets = np.asarray(joint_targets, dtype=np.float64).reshape(-1)
        if targets.shape != (2,) or not np.all(np.isfinite(targets)):
            raise ValueError(f"joint_targets must be 2 finite values, got {joint_targets!r}")
        lo = np.array([a for a, _ in JOINT_LIMITS])
        hi = np.array([b for _, b in JOINT_LIMITS])
        targets = np.clip(targets, lo, hi)
        n_sub = max(1, math.ceil(dt_s / SUBSTEP_S - 1e-9))
        h = dt_s / n_sub
        wrench_sum = np.zeros(6)
        for _ in range(n_sub):
            wrench_sum += self._substep(h, targets, lo, hi)
        self._wrench = wrench_sum / n_sub
        self.time_s += dt_s

    def _substep(self, h: float, targets: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
        q, qd = self._q, self._qd
        l1, l2 = LINK_LENGTHS_M
        s1, c1 = math.sin(q[0]), math.cos(q[0])
        s12, c12 = math.sin(q[0] + q[1]), math.cos(q[0] + q[1])
        jac = np.array([[-l1 * s1 - l2 * s12, -l2 * s12], [l1 * c1 + l2 * c12, l2 * c12]])
        ee = np.array([BASE_XY[0] + l1 * c1 + l2 * c12, BASE_XY[1] + l1 * s1 + l2 * s12])
        ee_v = jac @ qd
        force_ee, force_box, contact = self._contact(ee, ee_v)
        wrench = np.zeros(6)
        if contact is not None:
            # box: force at the contact point -> linear and angular acceleration
            r = contact - self._box
            torque_box = r[0] * force_box[1] - r[1] * force_box[0]
            self._box_v += h * force_box / BOX_MASS_KG
            self._box_w += h * torque_box / self._box_inertia()
            arm = contact - ee
            wrench[:2] = force_ee
            wrench[5] = arm[0] * force_ee[1] - arm[1] * force_ee[0]
        # table friction on the box (smoothed Coulomb), then integrate and keep it on the table
        speed = float(np.linalg.norm(self._box_v))
        decel = TABLE_FRICTION * GRAVITY * h
        self._box_v = self._box_v * max(0.0, speed - decel) / speed if speed > 0 else self._box_v
        w_decel = 6.0 * TABLE_FRICTION * GRAVITY / (2 * BOX_HALF_M) * h
        self._box_w = math.copysign(max(0.0, abs(self._box_w) - w_decel), self._box_w)
        self._box = self._box + h * self._box_v
        self._box_yaw = (self._box_yaw + h * self._box_w + math.pi) % (2 * math.pi) - math.pi
        for i in range(2):
            if abs(self._box[i]) > TABLE_HALF_M - BOX_HALF_M:
                self._box[i] = math.copysign(TABLE_HALF_M - BOX_HALF_M, self._box[i])
                self._box_v[i] = 0.0
        # joints: PD + contact reaction through the Jacobian, semi-implicit Euler
        tau = np.array(JOINT_KP) * (targets - q) - np.array(JOINT_KD) * qd
        tau = np.clip(tau, -JOINT_TORQUE_LIMIT, JOINT_TORQUE_LIMIT) + jac.T @ force_ee
        qd = qd + h * tau / np.array(JOINT_INERTIA)
        q = q + h * qd
        at_limit = (q < lo) | (q > hi)
        self._q = np.clip(q, lo, hi)
        self._qd = np.where(at_limit, 0.0, qd)
        return wrench

    def _box_inertia(self) -> float:
        return BOX_MASS_KG * (2 * BOX_HALF_M) ** 2 / 6.0

    def _contact(
        self, ee: np.ndarray, ee_v: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """Penalty contact between the pusher disk and the box: (force on pusher, force on
        box, contact point) — zeros and None without contact."""
        c, s = math.cos(self._box_yaw), math.sin(self._box_yaw)
        d = ee - self._box
        local = np.array([c * d[0] + s * d[1], -s * d[0] + c * d[1]])
        closest = np.clip(local, -BOX_HALF_M, BOX_HALF_M)
        delta = local - closest
        dist = float(np.linalg.norm(delta))
        if dist > 1e-9:
            normal_local = delta / dist
            penetration = PUSHER_RADIUS_M - dist
        else:  # pusher centre inside the box: push out through the nearest face
            axis = int(np.argmax(np.abs(local)))
            normal_local = np.zeros(2)
            normal_local[axis] = math.copysign(1.0, local[axis]) if local[axis] != 0 else 1.0
            penetration = PUSHER_RADIUS_M + BOX_HALF_M - abs(local[axis])
            closest = local.copy()
            closest[axis] = normal_local[axis] * BOX_HALF_M
        if penetration <= 0:
            zero = np.zeros(2)
            return zero, zero, None
        normal = np.array(
            [c * normal_local[0] - s * normal_local[1], s * normal_local[0] + c * normal_local[1]]
        )
        contact = self._box + np.array(
            [c * closest[0] - s * closest[1], s * closest[0] + c * closest[1]]
        )
        r = contact - self._box
        box_point_v = self._box_v + self._box_w * np.array([-r[1], r[0]])
        rel_v = ee_v - box_point_v
        normal_speed = float(rel_v @ normal)
        f_normal = max(0.0, CONTACT_STIFFNESS * penetration - CONTACT_DAMPING * normal_speed)
        tangent_v = rel_v - normal_speed * normal
        tangent_speed = float(np.linalg.norm(tangent_v))
        f_tangent = -CONTACT_FRICTION * f_normal * math.tanh(tangent_speed / 0.01)
        tangent = tangent_v / tangent_speed if tangent_speed > 1e-9 else np.zeros(2)
        force_ee = f_normal * normal + f_tangent * tangent
        return force_ee, -force_ee, contact

    # ---- camera ----
    def render(self) -> np.ndarray:
        """[H, W, 3] uint8 top-down camera image (anti-aliased by signed distance)."""
        cam = self._camera
        img = cam.table()
        if self.goal_xy is not None:  # under the box: covered when the box is on it
            cam.paint(img, cam.disk(self.goal_xy, GOAL_RADIUS_M), GOAL_RGB)
        # box with a stripe on one face so its yaw is visible
        c, s = math.cos(self._box_yaw), math.sin(self._box_yaw)
        dx, dy = cam.px - self._box[0], cam.py - self._box[1]
        lx, ly = c * dx + s * dy, -s * dx + c * dy
        cam.paint(img, _box_sdf(lx, ly, BOX_HALF_M, BOX_HALF_M), BOX_RGB)
        stripe = _box_sdf(lx - 0.6 * BOX_HALF_M, ly, 0.25 * BOX_HALF_M, 0.8 * BOX_HALF_M)
        cam.paint(img, stripe, BOX_STRIPE_RGB)
        elbow, ee = forward_kinematics(self._q)
        base = np.array(BASE_XY)
        cam.paint(img, cam.segment(base, elbow, 0.025), LINK_RGB)
        cam.paint(img, cam.segment(elbow, ee, 0.02), LINK_RGB)
        cam.paint(img, cam.disk(ee, PUSHER_RADIUS_M), TOOL_RGB)
        cam.paint(img, cam.disk(base, 0.04), BASE_RGB)
        return cam.to_uint8(img)


def _box_sdf(lx: np.ndarray, ly: np.ndarray, half_x: float, half_y: float) -> np.ndarray:
    qx, qy = np.abs(lx) - half_x, np.abs(ly) - half_y
    outside = np.hypot(np.maximum(qx, 0), np.maximum(qy, 0))
    return outside + np.minimum(np.maximum(qx, qy), 0)


def _sample_region(rng: np.random.Generator) -> np.ndarray:
    while True:
        xy = np.array([rng.uniform(-0.35, 0.35), rng.uniform(-0.3, 0.25)])
        if in_push_region(xy):
            return xy


class ScriptedPolicy:
    """Varied behaviour for recording: reaches to random points, pushes of the box towards
    random goals, wiggles, holds. Joint targets move at a bounded speed, so the commanded
    actions are smooth and the motion they cause is learnable."""

    MAX_TARGET_SPEED_RAD_S = 2.0
    STALL_S = 0.3
    """A waypoint the arm stops short of (out of reach, or blocked by the box against the
    rim) for this long is given up: the arm never stands still in a reach or push."""

    def __init__(self, seed: int) -> None:
        if not isinstance(seed, int) or seed < 0:
            raise ValueError(f"seed must be a non-negative int, got {seed!r}")
        self._rng = np.random.default_rng(seed + 1_000_003)
        self._target: np.ndarray | None = None
        self._last_t_s: float | None = None
        self._mode = "hold"
        self._mode_end_s = 0.0
        self._waypoints: list[np.ndarray] = []
        self._wiggle: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None = None
        self._stalled_s = 0.0
        self.mode_history: list[tuple[float, str]] = []

    @property
    def mode(self) -> str:
        return self._mode

    def joint_targets(self, scene: PushScene, t_s: float) -> np.ndarray:
        """Joint position targets (radians) at time ``t_s`` (non-decreasing between calls)."""
        if self._target is None:
            self._target = scene.joint_positions()
            self._last_t_s = t_s
        dt_s = max(0.0, t_s - (self._last_t_s if self._last_t_s is not None else t_s))
        self._last_t_s = t_s
        if t_s >= self._mode_end_s or (self._mode in ("reach", "push") and not self._waypoints):
            self._choose_mode(scene, t_s)
        desired = self._desired(scene, t_s)
        step = np.clip(
            desired - self._target,
            -self.MAX_TARGET_SPEED_RAD_S * dt_s,
            self.MAX_TARGET_SPEED_RAD_S * dt_s,
        )
        self._target = self._target + step
        if self._mode in ("reach", "push") and self._waypoints:
            ee = scene.end_effector_xy()
            settled = np.allclose(step, 0, atol=1e-3)
            moving = float(np.abs(scene.joint_velocities()).max()) > 0.05
            self._stalled_s = self._stalled_s + dt_s if settled and not moving else 0.0
            if (
                settled and np.linalg.norm(ee - self._waypoints[0]) < 0.03
            ) or self._stalled_s > self.STALL_S:
                self._waypoints.pop(0)
                self._stalled_s = 0.0
        return self._target.copy()

    def _choose_mode(self, scene: PushScene, t_s: float) -> None:
        rng = self._rng
        self._mode = str(rng.choice(["push", "push", "push", "reach", "wiggle", "hold"]))
        self._mode_end_s = t_s + {"push": 6.0, "reach": 3.0, "wiggle": 2.5, "hold": 0.8}[self._mode]
        self.mode_history.append((t_s, self._mode))
        if self._mode == "reach":
            self._waypoints = [_sample_region(rng)]
        elif self._mode == "push":
            box = scene.box_pose()[:2]
            goal = _sample_region(rng)
            direction = goal - box
            norm = float(np.linalg.norm(direction))
            direction = (
                direction / norm if norm > 0.05 else np.array([math.cos(t_s), math.sin(t_s)])
            )
            behind = box - direction * (BOX_HALF_M + PUSHER_RADIUS_M + 0.06)
            # go around the box if the pusher is on its far side: a side waypoint first
            side = np.array([-direction[1], direction[0]]) * (BOX_HALF_M + 0.08)
            ee = scene.end_effector_xy()
            detour = [box + side] if float((ee - box) @ direction) > 0 else []
            # stop short of the goal by the contact offset: the box ends near the goal, so
            # pushes keep it inside the region the arm can reach
            through = box + direction * max(0.05, min(norm, 0.35) - BOX_HALF_M - PUSHER_RADIUS_M)
            self._waypoints = [*detour, behind, through]
        elif self._mode == "wiggle":
            self._wiggle = (
                scene.joint_positions(),
                rng.uniform(0.15, 0.4, 2),
                rng.uniform(0.4, 1.2, 2),
                rng.uniform(0, 2 * math.pi, 2),
            )

    def _desired(self, scene: PushScene, t_s: float) -> np.ndarray:
        assert self._target is not None
        if self._mode in ("reach", "push") and self._waypoints:
            return inverse_kinematics(self._waypoints[0], self._target)
        if self._mode == "wiggle" and self._wiggle is not None:
            centre, amp, freq_hz, phase = self._wiggle
            return centre + amp * np.sin(2 * math.pi * freq_hz * t_s + phase)
        return self._target
