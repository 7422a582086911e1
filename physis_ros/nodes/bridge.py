"""``bridge``: the robot-side node between ROS 2 topics and the physis server.

In: ``camera/image`` (``sensor_msgs/Image``) and/or a ``CompressedImage`` topic, ``wrench``
(``WrenchStamped``), ``joint_states`` (``JointState``), ``joint_command`` (``JointTrajectory``,
the commanded joint targets), with ``object_topics`` tracked objects' positions
(``PointStamped`` each, from an object tracker), sensor-data QoS by default; with
``task_topic`` the task's parameters (``PointStamped``, kept for late joiners), which a model
that takes task values opens its stream with. The callbacks validate and convert, pair by
stamp (approximate time, bounded slop; the command in force when the image was taken,
``pairing.CommandHistory``) and hand the newest observation, with that command as its
``action`` and the model's inputs by the names its contract gives them, to the link client,
which is non-blocking: no network in callbacks.

Out, at the rate the server delivers (published from the link's receive thread):
``predicted/image`` (each frame stamped at its predicted time), ``predicted/side_by_side``
(observed | predicted), ``action_chunk`` (``physis_ros/ActionChunk``), ``joint_trajectory``
(for a joint_trajectory_controller), ``predicted/ee_path`` (MarkerArray, planar forward
kinematics), once a second ``pipeline_stats`` and ``/diagnostics``.

Safety, for a world-action model (its chunks carry actions; the promise's ``action_mode`` is
``predict``): stale rows are never published; when chunks stop arriving for the deadline,
model actions stop, the ``hold``/``zeros`` fallback goes out once with the reason logged, and
/diagnostics says ERROR until a model chunk is published again; a bridge that stops (Ctrl-C,
SIGTERM, its launcher gone) publishes the fallback as it goes. A world model (frames only)
commands nothing: late predictions make /diagnostics WARN, never a fallback. The link client
reconnects by itself; with ``server_port_file`` it starts once the server has written its
port (/diagnostics says what the link waits for until then).

The node is three parts and the callbacks that feed them: ``bridge_inputs.BridgeInputs``
(validate, pair, build the observation), ``bridge_link.BridgeLink`` (the client, its receive
thread, the stream it follows) and ``bridge_outputs.BridgeOutputs`` (predictions, the
fallback, the reports, from a ``bridge_report.BridgeSnapshot``).
"""

from __future__ import annotations

import functools
import sys

from diagnostic_msgs.msg import DiagnosticArray
from geometry_msgs.msg import PointStamped, WrenchStamped
from rclpy.node import Node
from rclpy.qos import QoSProfile, ReliabilityPolicy, qos_profile_sensor_data
from sensor_msgs.msg import CompressedImage, Image, JointState
from trajectory_msgs.msg import JointTrajectory
from visualization_msgs.msg import MarkerArray

from physis_ros.cli_errors import cli_main
from physis_ros.link.client import LinkClient, LinkStats, Prediction
from physis_ros.msg import ActionChunk, PipelineStats
from physis_ros.nodes.bridge_inputs import BridgeInputs
from physis_ros.nodes.bridge_link import PORT_POLL_S, BridgeLink
from physis_ros.nodes.bridge_outputs import BridgeOutputs, OutputTopics
from physis_ros.nodes.bridge_params import BridgeParams, declare_bridge_params, parameter_docs
from physis_ros.nodes.bridge_report import BridgeSnapshot
from physis_ros.nodes.conversions import compressed_msg_to_fields, image_msg_to_fields
from physis_ros.nodes.frame_out import PreviewOutput
from physis_ros.nodes.pairing import CommandHistory
from physis_ros.nodes.run import LATCHED_QOS, NodeUsage, quiet_at_shutdown, run_node
from physis_ros.nodes.stats import DropCounter
from physis_ros.nodes.wam_execution import ActionExecution, ExecutionConfig


class Bridge(Node):
    """The node: its parts (``inputs``, ``link``, ``outputs``), its topics and timers, and
    callbacks that hand each message to the part it is for."""

    def __init__(self, *, client: LinkClient | None = None) -> None:
        super().__init__("bridge")
        p = self.p = declare_bridge_params(self)
        self.drops = DropCounter()
        commands = CommandHistory(max_age_s=p.command_max_age_s)
        self.execution = ActionExecution(
            ExecutionConfig(
                execution=p.execution,
                join=p.join,
                fade_rows=p.fade_rows,
                commands_dt_s=p.commands_dt_s,
            ),
            commands,
        )
        self.link = BridgeLink(
            p,
            client=client,
            client_name=self.get_fully_qualified_name(),
            clock_ns=self.now_ns,  # capture stamps are ROS time
            on_prediction=self._on_prediction,
            logger=self.get_logger(),
        )
        self.inputs = BridgeInputs(
            p,
            link=self.link,
            commands=commands,
            execution=self.execution,
            drops=self.drops,
            logger=self.get_logger(),
            clock_ns=self.now_ns,
        )
        self.topics = self._make_publishers()
        self.outputs = BridgeOutputs(
            p,
            self.topics,
            link=self.link,
            execution=self.execution,
            drops=self.drops,
            joint_state_names=self.inputs.joint_state_names,
            joint_positions=self.inputs.joint_positions,
            observed_image=self.inputs.observed_image,
            logger=self.get_logger(),
            clock_ns=self.now_ns,
            context_ok=self.context.ok,
            node_name=self.get_fully_qualified_name().lstrip("/"),
        )
        self._make_subscriptions()
        self.create_timer(p.watchdog_period_s, self._on_watchdog)
        self.create_timer(p.stats_period_s, self._on_stats_timer)
        # With task_topic the client connects now, learns the model's contract, and opens
        # its stream once the first task's values are set (_on_task).
        self.link.open_stream()
        self._port_timer = None
        if not self.link.try_start():
            self.get_logger().info(f"link {self.link.waiting()}")
            self._port_timer = self.create_timer(PORT_POLL_S, self._on_port_timer)

    def _make_subscriptions(self) -> None:
        p = self.p
        if p.input_reliability == "reliable":
            qos = QoSProfile(depth=p.input_depth, reliability=ReliabilityPolicy.RELIABLE)
        else:
            qos = qos_profile_sensor_data
        if p.image_topic:
            self.create_subscription(Image, p.image_topic, self._on_image, qos)
        if p.compressed_image_topic:
            self.create_subscription(
                CompressedImage, p.compressed_image_topic, self._on_compressed, qos
            )
        self.create_subscription(WrenchStamped, p.wrench_topic, self._on_wrench, qos)
        self.create_subscription(JointState, p.joint_states_topic, self._on_joints, qos)
        for name, topic in self.inputs.objects.items():
            self.create_subscription(
                PointStamped, topic, functools.partial(self._on_object, name), qos
            )
        if p.command_topic:
            self.create_subscription(JointTrajectory, p.command_topic, self._on_command, qos)
        if p.task_topic:  # latched: a task is published once per episode
            self.create_subscription(PointStamped, p.task_topic, self._on_task, LATCHED_QOS)

    def _make_publishers(self) -> OutputTopics:
        reliable = QoSProfile(depth=10, reliability=ReliabilityPolicy.RELIABLE)
        latest = QoSProfile(depth=2, reliability=ReliabilityPolicy.RELIABLE)
        return OutputTopics(
            frames=self.create_publisher(Image, "predicted/image", latest),
            side_by_side=self.create_publisher(Image, "predicted/side_by_side", latest),
            action_chunk=self.create_publisher(ActionChunk, "action_chunk", reliable),
            joint_trajectory=self.create_publisher(JointTrajectory, "joint_trajectory", reliable),
            ee_path=self.create_publisher(MarkerArray, "predicted/ee_path", latest),
            pipeline_stats=self.create_publisher(PipelineStats, "pipeline_stats", reliable),
            diagnostics=self.create_publisher(DiagnosticArray, "/diagnostics", reliable),
            previews=PreviewOutput(self, latest, self.p.camera_frame),
        )

    # ---- inputs: validate, convert, pair, hand to the link ---------------------------------

    def _on_image(self, msg: Image) -> None:
        self.inputs.take_image(msg, image_msg_to_fields)

    def _on_compressed(self, msg: CompressedImage) -> None:
        self.inputs.take_image(msg, compressed_msg_to_fields)

    def _on_wrench(self, msg: WrenchStamped) -> None:
        f, t = msg.wrench.force, msg.wrench.torque
        self.inputs.take_vector("wrench", msg.header, [f.x, f.y, f.z, t.x, t.y, t.z], "nan_wrench")

    def _on_object(self, name: str, msg: PointStamped) -> None:
        p = msg.point
        self.inputs.take_vector(f"object:{name}", msg.header, [p.x, p.y, p.z], "nan_object")

    def _on_joints(self, msg: JointState) -> None:
        self.inputs.take_joints(msg)

    def _on_command(self, msg: JointTrajectory) -> None:
        self.inputs.take_command(msg)

    def _on_task(self, msg: PointStamped) -> None:
        self._start_task(self.inputs.take_task(msg))

    def _start_task(self, task: dict[str, float]) -> None:
        """A new task reopens the stream with its values; the old stream's chunks stop by
        intent, so the new one has a whole deadline to start."""
        if task:
            self.link.set_task(task)
            self.outputs.expect_new_stream()

    # ---- predictions: the link's receive thread --------------------------------------------

    def _on_prediction(self, pred: Prediction) -> None:
        self.outputs.publish(pred, new_stream=self.link.follow_stream(pred.stream_id))

    # ---- timers: the link's start, the deadline watchdog, stats and diagnostics ------------

    def _on_port_timer(self) -> None:
        if self.link.try_start():
            self._port_timer.cancel()

    @quiet_at_shutdown
    def _on_watchdog(self) -> None:
        self.inputs.flush_overdue()
        now_ns = self.now_ns()
        if self.outputs.check_deadline(now_ns):  # ERROR now, not at the next stats period
            self.outputs.publish_diagnostics(self.snapshot(), now_ns)

    @quiet_at_shutdown
    def _on_stats_timer(self) -> None:
        self._start_task(self.inputs.pending_task())  # its names once the contract is known
        snap = self.snapshot(self.link.poll())
        now_ns = self.now_ns()
        self.outputs.publish_stats(snap, now_ns)
        self.outputs.publish_diagnostics(snap, now_ns)

    def snapshot(self, link: LinkStats | None = None) -> BridgeSnapshot:
        """The node's meters now (``link``: the link's stats, when just taken)."""
        return BridgeSnapshot(
            inputs=self.inputs.snapshot(),
            outputs=self.outputs.snapshot(),
            drops=self.drops.snapshot(),
            link=self.link.stats() if link is None else link,
            link_waiting=self.link.waiting(),
            link_recovery=self.link.recovery,
        )

    def now_ns(self) -> int:
        return self.get_clock().now().nanoseconds

    def on_stop(self) -> None:
        """The process stops (``run_node``): a world-action model's robot holds (the
        fallback), before anything is released."""
        self.outputs.stop(self.now_ns())

    def shutdown(self) -> None:
        self.link.close()


def usage() -> NodeUsage:
    docs = parameter_docs()
    return NodeUsage(
        prog="bridge",
        description=__doc__.replace("``", ""),
        parameters=[
            (f.name, f.default, docs[f.name]) for f in BridgeParams.__dataclass_fields__.values()
        ],
        params_file="bridge.yaml",
        example="ros2 run physis_ros bridge --ros-args -r __ns:=/arm1 -p server:=gpu-box:50051",
    )


@cli_main("bridge")
def main(args=None) -> int:
    # Callbacks, the link's gRPC threads and the publishing thread share the GIL; the default
    # 5 ms switch interval makes the publishing thread wait for it several times per chunk.
    sys.setswitchinterval(0.0005)
    return run_node(Bridge, args, usage=usage(), executor="events")


if __name__ == "__main__":
    sys.exit(main())
