"""``sim_robot``: a simulated robot on ROS 2 topics, so the demo is a closed loop.

Wraps a simulated task's scene (``physis_ros.sim.tasks``, parameter ``scene``): ``push``, a
planar 2-link arm pushing a box (``physis_ros.sim.scene``), or ``reach``, a planar 3-joint
arm putting its tool tip on a target (``physis_ros.sim.reach``); a top-down camera. It
publishes ``camera/image`` (rgb8 ``sensor_msgs/Image``), ``joint_states`` and, where the
robot has them, ``wrench`` (``WrenchStamped``; push) and ``object_position``
(``PointStamped``: push's box centre in the table frame, as an object tracker on a real
robot would report it; whatever the task) at their own rates, and executes the
``joint_trajectory`` (``trajectory_msgs/JointTrajectory``) it receives. When no trajectory is
fresh (none yet, or its last point ended ``trajectory_timeout_s`` ago) it falls back to the
``idle_policy``: the scene's scripted policy (in episodes, the task's expert), or holding
the last target.

``task: goal_push`` runs the scene's episodes (``physis_ros.sim.episodes.GoalEpisodes``): a
goal drawn on the table (push: where the box must go; reach: the target), the arm (and the
box) at a start drawn from ``seed`` (then seed + 1, ...); an episode ends when the goal is
reached (success, then ``episode_pause_s``) or after the task's time limit, and the next one
starts; the scripted policy there is the task's expert. The reach scene has no free motion:
it always runs its episodes. Episode results go to the log and to ``/diagnostics``; each
episode's goal goes out on the task's goal topic (``goal``; reach: ``target``;
``PointStamped`` in the table frame, kept for late joiners: what a goal-prompted model's
bridge opens its stream with).

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
from physis_ros.sim.episodes import GoalEpisodes
from physis_ros.sim.table import BASE_XY
from physis_ros.sim.tasks import TASKS as SCENES
from physis_ros.sim.tasks import get_task

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
    ("scene", "push", "push (a 2-link arm and a box) or reach (a 3-joint arm, a target)", "fixed"),
    (
        "trajectory_timeout_s",
        0.5,
        "use the idle policy once the last trajectory ended this long ago",
        "rate",
    ),
    ("table_frame", "table", "TF root: the table centre (frame of joint_command)", "fixed"),
    ("camera_frame", "camera", "frame_id of images (TF: top-down above the table)", "fixed"),
    ("tool_frame", "tool", "frame_id of the wrench (TF: the tool at the arm's tip)", "fixed"),
    ("publish_tf", True, "publish the scene's frames on tf and tf_static (relative)", "fixed"),
    (
        "task",
        "free",
        "free (the scripted scene; reach has none) or goal_push (episodes with a goal)",
        "fixed",
    ),
    (
        "idle_policy",
        "scripted",
        "what moves the arm while no trajectory is fresh: scripted (the scene's policy; "
        "goal_push: the expert) or hold (the last target)",
        "",
    ),
    ("episode_pause_s", 1.0, "episodes: seconds between a success and the next episode", ""),
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
        if (
            p["task"] not in TASKS
            or p["idle_policy"] not in IDLE_POLICIES
            or p["scene"] not in SCENES
        ):
            raise ValueError(
                f"task {p['task']!r} must be one of {TASKS}, idle_policy {p['idle_policy']!r} "
                f"one of {IDLE_POLICIES}, scene {p['scene']!r} one of {sorted(SCENES)}"
            )
        self.task = get_task(p["scene"])
        self.scene = self.task.new_scene((p["image_height"], p["image_width"]), p["seed"])
        self.policy = self.task.free_policy(p["seed"]) if p["task"] == "free" else None
        self.follower = TrajectoryFollower(self.scene.joint_names, p["trajectory_timeout_s"])
        self._idle_policy = p["idle_policy"]
        self._held: np.ndarray | None = None
        self.episodes = (
            GoalEpisodes(p["seed"], p["episode_pause_s"], task=self.task.name)
            if self.policy is None
            else None
        )
        self._camera_frame, self._tool_frame = p["camera_frame"], p["tool_frame"]
        self._table_frame = p["table_frame"]
        self._state_period_s = 1.0 / p["state_rate_hz"]
        self._t0_ns = self.get_clock().now().nanoseconds
        self._lock = threading.Lock()
        self.trajectories_received = 0
        self.trajectories_rejected = 0
        self.steps_on_trajectory = 0
        """State steps whose joint targets came from a commanded trajectory (the run's total)."""
        self._steps_reported = 0
        """``steps_on_trajectory`` at the last diagnostics report: its status says whether a
        trajectory was followed since then (an instant's sample would miss a robot that drives
        between two chunks' trajectories, as a short episode's goal change leaves it)."""

        self.image_pub = self.create_publisher(Image, "camera/image", qos_profile_sensor_data)
        self.joints_pub = self.create_publisher(JointState, "joint_states", qos_profile_sensor_data)
        self.wrench_pub = (
            self.create_publisher(WrenchStamped, "wrench", qos_profile_sensor_data)
            if self.task.has_wrench
            else None
        )
        # the task's one tracked object (push: the box), as a tracker on a real robot reports it
        self.object_pub = (
            self.create_publisher(PointStamped, "object_position", qos_profile_sensor_data)
            if self.task.objects
            else None
        )
        # Reliable, as a command stream usually is; a best-effort subscriber (the bridge's
        # default sensor-data QoS) matches it too.
        self.command_pub = self.create_publisher(
            JointTrajectory,
            "joint_command",
            QoSProfile(depth=10, reliability=ReliabilityPolicy.RELIABLE),
        )
        self.tf_pub = self._start_tf() if p["publish_tf"] else None
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
            self.goal_pub = self.create_publisher(PointStamped, self.task.goal_topic, LATCHED_QOS)
            self.episodes.start(self.scene, self.get_clock().now().nanoseconds)
            self._publish_goal()
            self.create_timer(1.0, self._on_diagnostics_timer)
        self.create_timer(self._state_period_s, self._on_state_timer)
        self.create_timer(1.0 / p["camera_rate_hz"], self._on_camera_timer)

    def _start_tf(self):
        """The tf publisher of the arm's frames, after publishing the static ones once."""
        # tf2's conventions (static: one latched message for late joiners); relative names,
        # so a namespaced robot has its own tree (rviz: remap /tf to tf).
        static_pub = self.create_publisher(TFMessage, "tf_static", LATCHED_QOS)
        static = frames.static_transforms(
            self.get_clock().now().to_msg(),
            table=self._table_frame,
            camera=self._camera_frame,
            base_xy=BASE_XY,
        )
        static_pub.publish(TFMessage(transforms=static))
        return self.create_publisher(
            TFMessage, "tf", QoSProfile(depth=100, reliability=ReliabilityPolicy.RELIABLE)
        )

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
            self.steps_on_trajectory += targets is not None
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
            q, qd = self.scene.joint_positions(), self.scene.joint_velocities()
            wrench = self.scene.wrench() if self.wrench_pub is not None else None
            obj = None
            if self.object_pub is not None:
                obj = self.task.object_xy(self.scene, self.task.objects[0])
        stamp = now.to_msg()
        self.command_pub.publish(
            command_msg(stamp, self.scene.joint_names, targets, frame_id=self._table_frame)
        )
        if self.tf_pub is not None:
            arm = frames.arm_transforms(
                stamp, q, tool=self._tool_frame, link_lengths_m=self.scene.link_lengths_m
            )
            self.tf_pub.publish(TFMessage(transforms=arm))
        joints = JointState()
        joints.header.stamp = stamp
        joints.name = list(self.scene.joint_names)
        joints.position = q.tolist()
        joints.velocity = qd.tolist()
        self.joints_pub.publish(joints)
        if wrench is not None:
            w = WrenchStamped()
            w.header.stamp = stamp
            w.header.frame_id = self._tool_frame
            w.wrench.force.x, w.wrench.force.y, w.wrench.force.z = (float(v) for v in wrench[:3])
            w.wrench.torque.x, w.wrench.torque.y, w.wrench.torque.z = (float(v) for v in wrench[3:])
            self.wrench_pub.publish(w)
        if obj is not None:
            self.object_pub.publish(_point_msg(stamp, obj, self._table_frame))

    def _idle_targets(self, t_s: float) -> np.ndarray:
        if self._idle_policy == "hold":
            return self._held if self._held is not None else self.scene.joint_positions()
        if self.episodes is not None:
            previous = self._held if self._held is not None else self.scene.joint_positions()
            return self.episodes.expert.joint_targets(self.scene, previous, self._state_period_s)
        return self.policy.joint_targets(self.scene, t_s)

    def _publish_goal(self) -> None:
        stamp = self.get_clock().now().to_msg()
        goal = self.task.goal_xy(self.scene)
        self.goal_pub.publish(_point_msg(stamp, goal, self._table_frame))

    @quiet_at_shutdown
    def _on_diagnostics_timer(self) -> None:
        values = self.episodes.report(self.scene)
        with self._lock:
            steps_on_trajectory, previous = self.steps_on_trajectory, self._steps_reported
            self._steps_reported = steps_on_trajectory
        values["executing_trajectory"] = str(steps_on_trajectory > previous)
        values["steps_on_trajectory"] = str(steps_on_trajectory)
        status = DiagnosticStatus(
            level=DiagnosticStatus.OK,
            name=f"{self.get_name()}: {self.task.label}",
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
