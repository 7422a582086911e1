"""``sim_robot``: a simulated robot on ROS 2 topics, so the demo is a closed loop.

Wraps ``physis_ros.sim.scene.PushScene`` (a planar 2-link arm pushing a box, top-down
camera): publishes ``camera/image`` (rgb8 ``sensor_msgs/Image``), ``wrench``
(``WrenchStamped``) and ``joint_states`` at their own rates, and executes the
``joint_trajectory`` (``trajectory_msgs/JointTrajectory``) it receives. When no trajectory
is fresh (none yet, or its last point ended ``trajectory_timeout_s`` ago) it falls back to
the scene's scripted policy. Every physics step it publishes the joint targets it applied on
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
from geometry_msgs.msg import WrenchStamped
from rcl_interfaces.msg import FloatingPointRange, ParameterDescriptor
from rclpy.node import Node
from rclpy.qos import DurabilityPolicy, QoSProfile, ReliabilityPolicy, qos_profile_sensor_data
from sensor_msgs.msg import Image, JointState
from tf2_msgs.msg import TFMessage
from trajectory_msgs.msg import JointTrajectory, JointTrajectoryPoint

from physis_ros.nodes import frames
from physis_ros.nodes.conversions import fill_image_msg
from physis_ros.nodes.run import NodeUsage, quiet_at_shutdown, run_node
from physis_ros.sim.scene import PushScene, SceneConfig, ScriptedPolicy

PARAMETERS: tuple[tuple[str, object, str, str], ...] = (
    # name, default, description, kind: "rate" (0.1..1000, settable), "fixed" (read-only), ""
    ("camera_rate_hz", 30.0, "camera images per second (camera/image)", "rate"),
    (
        "state_rate_hz",
        100.0,
        "physics steps, wrench, joint states, joint commands and arm TF per second",
        "rate",
    ),
    ("image_height", 64, "camera height in pixels", "fixed"),
    ("image_width", 64, "camera width in pixels", "fixed"),
    ("seed", 0, "scene and scripted-policy seed", "fixed"),
    (
        "trajectory_timeout_s",
        0.5,
        "use the scripted policy once the last trajectory ended this long ago",
        "rate",
    ),
    ("table_frame", "table", "TF root: the table centre (frame of joint_command)", "fixed"),
    ("camera_frame", "camera", "frame_id of images (TF: top-down above the table)", "fixed"),
    ("tool_frame", "tool", "frame_id of the wrench (TF: the pusher at the arm's tip)", "fixed"),
    ("publish_tf", True, "publish the scene's frames on tf and tf_static (relative)", "fixed"),
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
        self.scene = PushScene(
            SceneConfig(
                image_height=p["image_height"], image_width=p["image_width"], seed=p["seed"]
            )
        )
        self.policy = ScriptedPolicy(p["seed"])
        self.follower = TrajectoryFollower(self.scene.joint_names, p["trajectory_timeout_s"])
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
                QoSProfile(
                    depth=1,
                    reliability=ReliabilityPolicy.RELIABLE,
                    durability=DurabilityPolicy.TRANSIENT_LOCAL,
                ),
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
                targets = self.policy.joint_targets(self.scene, t_s)
            self.scene.step(self._state_period_s, np.asarray(targets, dtype=np.float64))
            q, qd, wrench = (
                self.scene.joint_positions(),
                self.scene.joint_velocities(),
                self.scene.wrench(),
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

    @quiet_at_shutdown
    def _on_camera_timer(self) -> None:
        stamp = self.get_clock().now().to_msg()
        with self._lock:
            rgb = self.scene.render()
        msg = Image()
        fill_image_msg(msg, rgb, stamp=stamp, frame_id=self._camera_frame)
        self.image_pub.publish(msg)


def command_msg(stamp, joint_names: tuple[str, ...], targets, frame_id: str) -> JointTrajectory:
    """The commanded joint targets as the recorded bags hold them: one point, reached at
    once (time_from_start 0), header frame the table (physis_ros.sim.record.TABLE_FRAME)."""
    msg = JointTrajectory()
    msg.header.stamp = stamp
    msg.header.frame_id = frame_id
    msg.joint_names = list(joint_names)
    msg.points = [JointTrajectoryPoint(positions=[float(v) for v in targets])]
    return msg


def main(args=None) -> int:
    return run_node(SimRobot, args, usage=USAGE)


if __name__ == "__main__":
    sys.exit(main())
