"""``sim_robot``: a simulated robot on ROS 2 topics, so the demo is a closed loop.

Wraps ``physis_ros.sim.scene.PushScene`` (a planar 2-link arm pushing a box, top-down
camera): publishes ``camera/image`` (rgb8 ``sensor_msgs/Image``), ``wrench``
(``WrenchStamped``), ``joint_states`` and ``object_position`` (``PointStamped``: the box
centre in the table frame, as an object tracker on a real robot would report it; whatever
the task) at their own rates, and executes the ``joint_trajectory``
(``trajectory_msgs/JointTrajectory``) it receives. When no trajectory is fresh (none yet, or
its last point ended ``trajectory_timeout_s`` ago) it falls back to the ``idle_policy``: the
scene's scripted policy, or holding the last target.

``task: goal_push`` runs goal-push episodes (``physis_ros.sim.task``): a goal drawn on the
table, the box and arm at a start drawn from ``seed`` (then seed + 1, ...); an episode ends
when the box centre is within GOAL_TOLERANCE_M of the goal (success, then
``episode_pause_s``) or after TIME_LIMIT_S, and the next one starts; the scripted policy there
is the task's expert. Episode results go to the log and to ``/diagnostics``; each episode's
goal goes out on ``goal`` (``PointStamped`` in the table frame, kept for late joiners: what a
goal-prompted model's bridge opens its stream with).

Every physics step it publishes the joint targets it applied on
``joint_command`` (``JointTrajectory``, one point, positions in the scene's joint order,
stamped with the command time): the layout of the recorded bags (``physis_ros.sim.record``),
so the bridge sees the live sim and a replayed bag alike and can condition the world model
on the commands. With each physics step it also publishes the arm's frames on ``tf``, and
once the static ones (table, camera, arm base) on ``tf_static`` (``physis_ros.nodes.frames``):
``table`` is the fixed frame of config/physis.rviz and of the bridge's markers. Every topic
is relative, so ``-r __ns:=/arm1`` puts a whole robot in a namespace. Simulated time follows
the wall clock; stamps are ROS time.
"""

from __future__ import annotations

import sys
import threading

import numpy as np
from diagnostic_msgs.msg import DiagnosticArray, DiagnosticStatus, KeyValue
from geometry_msgs.msg import PointStamped, WrenchStamped
from rcl_interfaces.msg import FloatingPointRange, ParameterDescriptor
from rclpy.node import Node
from rclpy.qos import QoSProfile, ReliabilityPolicy, qos_profile_sensor_data
from sensor_msgs.msg import Image, JointState
from tf2_msgs.msg import TFMessage
from trajectory_msgs.msg import JointTrajectory, JointTrajectoryPoint

from physis_ros.cli_errors import cli_main
from physis_ros.nodes import frames
from physis_ros.nodes.conversions import fill_image_msg
from physis_ros.nodes.run import LATCHED_QOS, NodeUsage, quiet_at_shutdown, run_node
from physis_ros.sim.scene import PushScene, SceneConfig, ScriptedPolicy
from physis_ros.sim.task import GOAL_TOLERANCE_M, TIME_LIMIT_S, GoalPushExpert, sample_task

TASKS = ("free", "goal_push")
IDLE_POLICIES = ("scripted", "hold")

PARAMETERS: tuple[tuple[str, object, str, str], ...] = (
    # name, default, description, kind: "rate" (0.1..1000, settable), "fixed" (read-only), ""
    ("camera_rate_hz", 30.0, "camera images per second (camera/image)", "rate"),
    (
        "state_rate_hz",
        100.0,
        "physics steps, wrench, joint states, object positions, joint commands and arm TF per "
        "second",
        "rate",
    ),
    ("image_height", 64, "camera height in pixels", "fixed"),
    ("image_width", 64, "camera width in pixels", "fixed"),
    ("seed", 0, "scene and scripted-policy seed", "fixed"),
    (
        "trajectory_timeout_s",
        0.5,
        "use the idle policy once the last trajectory ended this long ago",
        "rate",
    ),
    ("table_frame", "table", "TF root: the table centre (frame of joint_command)", "fixed"),
    ("camera_frame", "camera", "frame_id of images (TF: top-down above the table)", "fixed"),
    ("tool_frame", "tool", "frame_id of the wrench (TF: the pusher at the arm's tip)", "fixed"),
    ("publish_tf", True, "publish the scene's frames on tf and tf_static (relative)", "fixed"),
    ("task", "free", "free (the scripted scene) or goal_push (episodes with a goal)", "fixed"),
    (
        "idle_policy",
        "scripted",
        "what moves the arm while no trajectory is fresh: scripted (the scene's policy; "
        "goal_push: the expert) or hold (the last target)",
        "",
    ),
    ("episode_pause_s", 1.0, "goal_push: seconds between a success and the next episode", ""),
)

USAGE = NodeUsage(
    prog="sim_robot",
    description=__doc__.replace("``", ""),
    parameters=[(name, default, text) for name, default, text, _ in PARAMETERS],
    params_file="sim_robot.yaml",
    example="ros2 run physis_ros sim_robot --ros-args -r __ns:=/arm1 -p camera_rate_hz:=10.0",
)


def _descriptor(description: str, kind: str) -> ParameterDescriptor:
    if kind == "rate":
        return ParameterDescriptor(
            description=description,
            floating_point_range=[FloatingPointRange(from_value=0.1, to_value=1000.0)],
        )
    return ParameterDescriptor(description=description, read_only=kind == "fixed")


class TrajectoryFollower:
    """Joint targets from the last received trajectory, linearly interpolated in time."""

    def __init__(self, joint_names: tuple[str, ...], timeout_s: float) -> None:
        self._joint_names = joint_names
        self._timeout_ns = int(timeout_s * 1e9)
        self._times_ns: np.ndarray | None = None
        self._points: np.ndarray | None = None
        self._lock = threading.Lock()

    def set(self, start_ns: int, times_from_start_ns: list[int], points: np.ndarray) -> None:
        with self._lock:
            self._times_ns = start_ns + np.asarray(times_from_start_ns, dtype=np.int64)
            self._points = points

    def clear(self) -> None:
        with self._lock:
            self._times_ns = self._points = None

    def targets(self, now_ns: int) -> np.ndarray | None:
        """Targets at ``now_ns``, or None when the trajectory is missing or has gone stale."""
        with self._lock:
            if self._times_ns is None or now_ns > self._times_ns[-1] + self._timeout_ns:
                return None
            times, points = self._times_ns, self._points
        if now_ns <= times[0]:
            return points[0]
        return np.array([np.interp(now_ns, times, points[:, j]) for j in range(points.shape[1])])


class SimRobot(Node):
    def __init__(self) -> None:
        super().__init__("sim_robot")
        for name, default, description, kind in PARAMETERS:
            self.declare_parameter(name, default, _descriptor(description, kind))
        p = {name: self.get_parameter(name).value for name in self._parameters}
        if p["task"] not in TASKS or p["idle_policy"] not in IDLE_POLICIES:
            raise ValueError(
                f"task {p['task']!r} must be one of {TASKS}, idle_policy {p['idle_policy']!r} "
                f"one of {IDLE_POLICIES}"
            )
        self.scene = PushScene(
            SceneConfig(
                image_height=p["image_height"], image_width=p["image_width"], seed=p["seed"]
            )
        )
        self.policy = ScriptedPolicy(p["seed"])
        self.follower = TrajectoryFollower(self.scene.joint_names, p["trajectory_timeout_s"])
        self._idle_policy = p["idle_policy"]
        self._held: np.ndarray | None = None
        self.episodes = (
            GoalEpisodes(p["seed"], p["episode_pause_s"]) if p["task"] == "goal_push" else None
        )
        self._camera_frame, self._tool_frame = p["camera_frame"], p["tool_frame"]
        self._table_frame = p["table_frame"]
        self._state_period_s = 1.0 / p["state_rate_hz"]
        self._t0_ns = self.get_clock().now().nanoseconds
        self._lock = threading.Lock()
        self.trajectories_received = 0
        self.trajectories_rejected = 0
        self.executing_trajectory = False

        self.image_pub = self.create_publisher(Image, "camera/image", qos_profile_sensor_data)
        self.wrench_pub = self.create_publisher(WrenchStamped, "wrench", qos_profile_sensor_data)
        self.joints_pub = self.create_publisher(JointState, "joint_states", qos_profile_sensor_data)
        self.object_pub = self.create_publisher(
            PointStamped, "object_position", qos_profile_sensor_data
        )
        # Reliable, as a command stream usually is; a best-effort subscriber (the bridge's
        # default sensor-data QoS) matches it too.
        self.command_pub = self.create_publisher(
            JointTrajectory,
            "joint_command",
            QoSProfile(depth=10, reliability=ReliabilityPolicy.RELIABLE),
        )
        self.tf_pub = None
        if p["publish_tf"]:
            # tf2's conventions (static: one latched message for late joiners); relative
            # names, so a namespaced robot has its own tree (rviz: remap /tf to tf).
            self.tf_pub = self.create_publisher(
                TFMessage, "tf", QoSProfile(depth=100, reliability=ReliabilityPolicy.RELIABLE)
            )
            static_pub = self.create_publisher(
                TFMessage,
                "tf_static",
                LATCHED_QOS,
            )
            static_pub.publish(
                TFMessage(
                    transforms=frames.static_transforms(
                        self.get_clock().now().to_msg(),
                        table=self._table_frame,
                        camera=self._camera_frame,
                    )
                )
            )
        self.create_subscription(
            JointTrajectory,
            "joint_trajectory",
            self._on_trajectory,
            QoSProfile(depth=10, reliability=ReliabilityPolicy.RELIABLE),
        )
        self.diag_pub = self.create_publisher(
            DiagnosticArray,
            "/diagnostics",
            QoSProfile(depth=10, reliability=ReliabilityPolicy.RELIABLE),
        )
        if self.episodes is not None:
            self.goal_pub = self.create_publisher(
                PointStamped,
                "goal",
                LATCHED_QOS,
            )
            self.episodes.start(self.scene, self.get_clock().now().nanoseconds)
            self._publish_goal()
            self.create_timer(1.0, self._on_diagnostics_timer)
        self.create_timer(self._state_period_s, self._on_state_timer)
        self.create_timer(1.0 / p["camera_rate_hz"], self._on_camera_timer)

    def _on_trajectory(self, msg: JointTrajectory) -> None:
        names = tuple(msg.joint_names)
        columns = [names.index(n) for n in self.scene.joint_names if n in names]
        if len(columns) != len(self.scene.joint_names) or not msg.points:
            self.trajectories_rejected += 1
            self.get_logger().warning(
                f"trajectory for joints {names} with {len(msg.points)} points ignored; "
                f"need {self.scene.joint_names}",
                throttle_duration_sec=5.0,
            )
            return
        points = np.array([[pt.positions[c] for c in columns] for pt in msg.points], np.float64)
        if not np.all(np.isfinite(points)):
            self.trajectories_rejected += 1
            return
        times = [
            pt.time_from_start.sec * 1_000_000_000 + pt.time_from_start.nanosec for pt in msg.points
        ]
        start_ns = msg.header.stamp.sec * 1_000_000_000 + msg.header.stamp.nanosec
        if start_ns == 0:  # JointTrajectory convention: zero stamp means "start now"
            start_ns = self.get_clock().now().nanoseconds
        if self.episodes is not None and start_ns < self.episodes.started_ns:
            self.trajectories_rejected += 1  # planned for the previous episode
            return
        self.follower.set(start_ns, times, points)
        self.trajectories_received += 1

    @quiet_at_shutdown
    def _on_state_timer(self) -> None:
        now = self.get_clock().now()
        t_s = (now.nanoseconds - self._t0_ns) * 1e-9
        with self._lock:
            targets = self.follower.targets(now.nanoseconds)
            self.executing_trajectory = targets is not None
            if targets is None:
                targets = self._idle_targets(t_s)
            self._held = np.asarray(targets, dtype=np.float64)
            self.scene.step(self._state_period_s, self._held)
            if self.episodes is not None:
                ended = self.episodes.after_step(self.scene, now.nanoseconds)
                if ended is not None:
                    self.get_logger().info(ended)
                    self.follower.clear()
                    self._held = None
                    self._publish_goal()
            q, qd, wrench, box = (
                self.scene.joint_positions(),
                self.scene.joint_velocities(),
                self.scene.wrench(),
                self.scene.box_pose(),
            )
        stamp = now.to_msg()
        self.command_pub.publish(
            command_msg(stamp, self.scene.joint_names, targets, frame_id=self._table_frame)
        )
        if self.tf_pub is not None:
            self.tf_pub.publish(
                TFMessage(transforms=frames.arm_transforms(stamp, q, tool=self._tool_frame))
            )
        joints = JointState()
        joints.header.stamp = stamp
        joints.name = list(self.scene.joint_names)
        joints.position = q.tolist()
        joints.velocity = qd.tolist()
        self.joints_pub.publish(joints)
        w = WrenchStamped()
        w.header.stamp = stamp
        w.header.frame_id = self._tool_frame
        w.wrench.force.x, w.wrench.force.y, w.wrench.force.z = (float(v) for v in wrench[:3])
        w.wrench.torque.x, w.wrench.torque.y, w.wrench.torque.z = (float(v) for v in wrench[3:])
        self.wrench_pub.publish(w)
        self.object_pub.publish(_point_msg(stamp, box[:2], self._table_frame))

    def _idle_targets(self, t_s: float) -> np.ndarray:
        if self._idle_policy == "hold":
            return self._held if self._held is not None else self.scene.joint_positions()
        if self.episodes is not None:
            previous = self._held if self._held is not None else self.scene.joint_positions()
            return self.episodes.expert.joint_targets(self.scene, previous, self._state_period_s)
        return self.policy.joint_targets(self.scene, t_s)

    def _publish_goal(self) -> None:
        stamp = self.get_clock().now().to_msg()
        self.goal_pub.publish(_point_msg(stamp, self.scene.goal_xy, self._table_frame))

    @quiet_at_shutdown
    def _on_diagnostics_timer(self) -> None:
        values = self.episodes.report(self.scene)
        values["executing_trajectory"] = str(self.executing_trajectory)
        status = DiagnosticStatus(
            level=DiagnosticStatus.OK,
            name=f"{self.get_name()}: goal_push",
            message=f"episode {values['episode']}: {values['successes']} of "
            f"{values['finished']} finished episodes reached the goal",
            hardware_id="sim",
            values=[KeyValue(key=k, value=str(v)) for k, v in values.items()],
        )
        array = DiagnosticArray(status=[status])
        array.header.stamp = self.get_clock().now().to_msg()
        self.diag_pub.publish(array)

    @quiet_at_shutdown
    def _on_camera_timer(self) -> None:
        stamp = self.get_clock().now().to_msg()
        with self._lock:
            rgb = self.scene.render()
        msg = Image()
        fill_image_msg(msg, rgb, stamp=stamp, frame_id=self._camera_frame)
        self.image_pub.publish(msg)


def _point_msg(stamp, xy_m, frame_id: str) -> PointStamped:
    """A point on the table (z 0: the scene is planar), e.g. the goal or the box centre."""
    msg = PointStamped()
    msg.header.stamp, msg.header.frame_id = stamp, frame_id
    msg.point.x, msg.point.y = (float(v) for v in xy_m)
    return msg


class GoalEpisodes:
    """goal_push episodes on the node's clock: starts, success or time-out, the pause, the
    next start; counts what happened."""

    def __init__(self, seed: int, pause_s: float) -> None:
        self.seed0, self.pause_ns = seed, int(pause_s * 1e9)
        self.index = 0
        self.started_ns = 0
        self.reached_ns: int | None = None
        self.finished = self.successes = 0
        self.times_to_goal_s: list[float] = []
        self.expert: GoalPushExpert | None = None

    def start(self, scene: PushScene, now_ns: int) -> None:
        setup = sample_task(self.seed0 + self.index)
        scene.set_state(
            joints=np.array(setup.joints), box_xy=np.array(setup.box_xy), box_yaw=setup.box_yaw
        )
        scene.goal_xy = np.array(setup.goal_xy)
        self.expert = GoalPushExpert(scene.goal_xy)
        self.started_ns, self.reached_ns = now_ns, None

    def after_step(self, scene: PushScene, now_ns: int) -> str | None:
        """A line for the log when an episode ended (and the next one started), else None."""
        error = float(np.linalg.norm(scene.box_pose()[:2] - scene.goal_xy))
        elapsed_s = (now_ns - self.started_ns) / 1e9
        if self.reached_ns is None and error <= GOAL_TOLERANCE_M:
            self.reached_ns = now_ns
        done = self.reached_ns is not None and now_ns - self.reached_ns >= self.pause_ns
        if not done and not (self.reached_ns is None and elapsed_s >= TIME_LIMIT_S):
            return None
        # Counted as the episode ends (after its pause), so successes never run ahead of
        # the finished episodes they are a share of.
        self.finished += 1
        if self.reached_ns is not None:
            self.successes += 1
            self.times_to_goal_s.append((self.reached_ns - self.started_ns) / 1e9)
        line = (
            f"goal_push episode {self.index} (seed {self.seed0 + self.index}): "
            + (
                f"reached the goal in {self.times_to_goal_s[-1]:.2f} s"
                if self.reached_ns is not None
                else f"not within {TIME_LIMIT_S:g} s (box {error:.3f} m from the goal)"
            )
            + f"; {self.successes} of {self.finished} so far"
        )
        self.index += 1
        self.start(scene, now_ns)
        return line

    def report(self, scene: PushScene) -> dict:
        return {
            "episode": self.index,
            "seed": self.seed0 + self.index,
            "finished": self.finished,
            "successes": self.successes,
            "median_time_to_goal_s": (
                f"{float(np.median(self.times_to_goal_s)):.2f}" if self.times_to_goal_s else "-"
            ),
            "box_to_goal_m": f"{float(np.linalg.norm(scene.box_pose()[:2] - scene.goal_xy)):.3f}",
        }


def command_msg(stamp, joint_names: tuple[str, ...], targets, frame_id: str) -> JointTrajectory:
    """The commanded joint targets as the recorded bags hold them: one point, reached at
    once (time_from_start 0), header frame the table (physis_ros.sim.record.TABLE_FRAME)."""
    msg = JointTrajectory()
    msg.header.stamp = stamp
    msg.header.frame_id = frame_id
    msg.joint_names = list(joint_names)
    msg.points = [JointTrajectoryPoint(positions=[float(v) for v in targets])]
    return msg


@cli_main("sim_robot")
def main(args=None) -> int:
    return run_node(SimRobot, args, usage=USAGE)


if __name__ == "__main__":
    sys.exit(main())
