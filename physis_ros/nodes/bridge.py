"""``bridge``: the robot-side node between ROS 2 topics and the physis server.

In: ``camera/image`` (``sensor_msgs/Image``) and/or a ``CompressedImage`` topic, ``wrench``
(``WrenchStamped``), ``joint_states`` (``JointState``), ``joint_command`` (``JointTrajectory``,
the commanded joint targets), with ``object_topic`` a tracked object's position
(``PointStamped``, from an object tracker), sensor-data QoS by default; with ``goal_topic``
the task's goal (``PointStamped``, kept for late joiners), which a goal-prompted model's
stream is opened with. The callbacks validate and convert, pair by stamp (approximate time,
bounded slop; the command in force when the image was taken, ``pairing.CommandHistory``) and
hand the newest observation, with that command as its ``action`` and the object's position
as its ``object_position``, to the link client, which is non-blocking: no network in
callbacks.

Out, at the rate the server delivers (published from the link's receive thread):
``predicted/image`` (each frame stamped at its predicted time), ``predicted/side_by_side``
(observed | predicted), ``action_chunk`` (``physis_ros/ActionChunk``), ``joint_trajectory``
(for a joint_trajectory_controller), ``predicted/ee_path`` (MarkerArray, planar forward
kinematics), once a second ``pipeline_stats`` and ``/diagnostics``.

Safety (``safety.ActionGate``), for a world-action model (its chunks carry actions; the
promise's ``action_mode`` is ``predict``): stale rows are never published; when chunks stop
arriving for the deadline, model actions stop, the ``hold``/``zeros`` fallback goes out once
with the reason logged, and /diagnostics says ERROR (published at once, then every stats
period) until a model chunk is published again: never OK while the robot holds. A world model
(frames only) commands nothing: late predictions make /diagnostics WARN, never a fallback.
The link client reconnects by itself.
"""

from __future__ import annotations

import sys
import threading
import time
from collections import OrderedDict

import numpy as np
from diagnostic_msgs.msg import DiagnosticArray
from geometry_msgs.msg import PointStamped, WrenchStamped
from rclpy.node import Node
from rclpy.qos import QoSProfile, ReliabilityPolicy, qos_profile_sensor_data
from sensor_msgs.msg import CompressedImage, Image, JointState
from trajectory_msgs.msg import JointTrajectory
from visualization_msgs.msg import MarkerArray

from physis_ros.cli_errors import cli_main
from physis_ros.link.client import (
    ROLLOUT_CHOICES,
    CameraImage,
    LinkClient,
    Observation,
    Prediction,
)
from physis_ros.msg import ActionChunk, PipelineStats
from physis_ros.nodes import outputs
from physis_ros.nodes.bridge_params import BridgeParams, declare_bridge_params, parameter_docs
from physis_ros.nodes.conversions import (
    ConversionError,
    command_positions,
    compressed_msg_to_fields,
    fields_to_rgb,
    fill_image_msg,
    image_msg_to_fields,
    resize_fields,
    side_by_side,
    validate_vector,
)
from physis_ros.nodes.pairing import (
    ApproxTimePairer,
    CommandHistory,
    PairedObservation,
    Sample,
)
from physis_ros.nodes.preview_out import PreviewOutput
from physis_ros.nodes.run import LATCHED_QOS, NodeUsage, quiet_at_shutdown, run_node
from physis_ros.nodes.safety import ActionGate, SafetyConfig
from physis_ros.nodes.stats import (
    ChunkOverlap,
    Deliveries,
    DropCounter,
    RateMeter,
    RollingWindow,
)
from physis_ros.nodes.wam_execution import ActionExecution, ExecutionConfig
from physis_ros.sim.task import goal_prompt_name

_OBSERVED_IMAGES_KEPT = 16  # recent observed images (full size), for the side-by-side view
_MEASURED_INTERVAL_MIN_SAMPLES = 10


def stamp_ns(header) -> int:
    return header.stamp.sec * 1_000_000_000 + header.stamp.nanosec


class Bridge(Node):
    def __init__(self, *, client: LinkClient | None = None) -> None:
        super().__init__("bridge")
        self.p: BridgeParams = declare_bridge_params(self)
        self.drops = DropCounter()
        self.pairer = ApproxTimePairer(
            slop_s=self.p.slop_s,
            require_wrench=self.p.require_wrench,
            require_joints=self.p.require_joints,
            require_object=bool(self.p.object_topic) and self.p.require_object,
            drops=self.drops,
        )
        self.gate = ActionGate(
            SafetyConfig(
                deadline_s=self.p.deadline_ms / 1000.0,
                fallback=self.p.fallback,
                max_observation_age_s=self.p.max_observation_age_s,
            )
        )
        self.commands = CommandHistory(max_age_s=self.p.command_max_age_s)
        # timed chunks of a world-action model: joined into one trajectory (wam_execution.py)
        self.execution = ActionExecution(
            ExecutionConfig(
                execution=self.p.execution,
                join=self.p.join,
                fade_rows=self.p.fade_rows,
                commands_dt_s=self.p.commands_dt_s,
            ),
            self.commands,
        )
        # The action columns' joints: fixed by parameter, else on the first command.
        self._command_order: tuple[str, ...] = self.p.command_joint_names or self.p.action_names
        inputs = ["image", "wrench", "joints", "command"]
        if self.p.object_topic:  # (no object_rate_hz on /diagnostics without a tracker)
            inputs.append("object")
        self.rates = {name: RateMeter() for name in inputs}
        self.chunk_rate = RateMeter()
        self.interval_ms = RollingWindow()
        self.response_ms = RollingWindow()
        self.chunk_overlap = ChunkOverlap()
        self.deliveries = Deliveries()
        self.obs_to_send_ms = RollingWindow()
        self.receive_to_publish_ms = RollingWindow()
        self.hop_ms: dict[str, RollingWindow] = {}
        self.counts = dict.fromkeys(
            (
                "images",
                "sent",
                "not_sent_before_stream",
                "commands",
                "observations_with_command",
                "chunks_received",
                "chunks_published",
                "chunks_expired",
                "fallbacks",
            ),
            0,
        )
        self._seq = 0
        self._observed: OrderedDict[int, object] = OrderedDict()
        self._lock = threading.Lock()
        self._last_chunk_s: float | None = None
        self.holding = ""
        """Why the robot holds (a fallback went out, no model chunk published since); "": not."""
        self._stream_id: int | None = None
        self._promise = None  # the link's promise, refreshed by the receive thread and timers
        self._link_error_logged = ""
        # An image waiting for the command in force when it was taken: (it, monotonic deadline)
        self._awaiting_command: tuple[PairedObservation, float] | None = None

        self.client = client or self._make_client()
        self._make_io()
        self._running = True
        self._receiver = threading.Thread(
            target=self._receive_loop, name="bridge-receive", daemon=True
        )
        self.goal_prompt = ""
        """The prompt naming the newest goal ('' before the first, or without goal_topic)."""
        if not self.p.goal_topic:  # else the stream opens with the first goal (_on_goal)
            self.client.start()
        self._receiver.start()

    # ---- setup -------------------------------------------------------------------------

    def _make_client(self) -> LinkClient:
        p = self.p
        target = p.server
        if p.server_port_file:
            port = _wait_for_port(p.server_port_file, SERVER_PORT_WAIT_S)
            target = f"{p.server.rsplit(':', 1)[0]}:{port}"
        token = p.token or None
        if p.token_file:
            with open(p.token_file) as f:
                token = f.read().strip()
        return LinkClient(
            target,
            seed=p.seed,
            prompt=p.prompt,
            target_interval_ms=p.target_interval_ms,
            response_latency_budget_ms=p.response_latency_budget_ms,
            previews=p.previews or p.act_on_previews,
            horizon=p.horizon,
            rollouts=ROLLOUT_CHOICES[p.rollouts],
            token=token,
            root_cert_path=p.root_cert_path or None,
            client_cert_path=p.client_cert_path or None,
            client_key_path=p.client_key_path or None,
            connect_timeout_s=p.connect_timeout_s,
            client_name=self.get_fully_qualified_name(),
            clock_ns=lambda: self.get_clock().now().nanoseconds,  # capture stamps are ROS time
        )

    def _make_io(self) -> None:
        p = self.p
        if p.input_reliability == "reliable":
            in_qos = QoSProfile(depth=p.input_depth, reliability=ReliabilityPolicy.RELIABLE)
        else:
            in_qos = qos_profile_sensor_data
        if p.image_topic:
            self.create_subscription(Image, p.image_topic, self._on_image, in_qos)
        if p.compressed_image_topic:
            self.create_subscription(
                CompressedImage, p.compressed_image_topic, self._on_compressed, in_qos
            )
        self.create_subscription(WrenchStamped, p.wrench_topic, self._on_wrench, in_qos)
        self.create_subscription(JointState, p.joint_states_topic, self._on_joints, in_qos)
        if p.object_topic:
            self.create_subscription(PointStamped, p.object_topic, self._on_object, in_qos)
        if p.command_topic:
            self.create_subscription(JointTrajectory, p.command_topic, self._on_command, in_qos)
        if p.goal_topic:  # latched: a goal is published once per episode
            self.create_subscription(PointStamped, p.goal_topic, self._on_goal, LATCHED_QOS)

        reliable = QoSProfile(depth=10, reliability=ReliabilityPolicy.RELIABLE)
        latest = QoSProfile(depth=2, reliability=ReliabilityPolicy.RELIABLE)
        self.frame_pub = self.create_publisher(Image, "predicted/image", latest)
        self.sbs_pub = self.create_publisher(Image, "predicted/side_by_side", latest)
        self.chunk_pub = self.create_publisher(ActionChunk, "action_chunk", reliable)
        self.traj_pub = self.create_publisher(JointTrajectory, "joint_trajectory", reliable)
        self.marker_pub = self.create_publisher(MarkerArray, "predicted/ee_path", latest)
        self.stats_pub = self.create_publisher(PipelineStats, "pipeline_stats", reliable)
        self.diag_pub = self.create_publisher(DiagnosticArray, "/diagnostics", reliable)
        self.previews = PreviewOutput(self, latest, self.p.camera_frame)
        self.create_timer(p.watchdog_period_s, self._on_watchdog)
        self.create_timer(p.stats_period_s, self._on_stats_timer)

    # ---- input callbacks: validate, convert, pair, enqueue -----------------------------

    def _on_image(self, msg: Image) -> None:
        self._take_image(msg, image_msg_to_fields)

    def _on_compressed(self, msg: CompressedImage) -> None:
        self._take_image(msg, compressed_msg_to_fields)

    def _take_image(self, msg, convert) -> None:
        t_cb = time.perf_counter()
        self.rates["image"].tick()
        self.counts["images"] += 1
        try:
            fields = convert(msg)
        except ConversionError as exc:
            self.drops.add(exc.reason)
            self.get_logger().warning(f"image dropped: {exc}", throttle_duration_sec=2.0)
            return
        paired = self.pairer.add_image(
            Sample(stamp_ns=stamp_ns(msg.header), value=fields, received_s=t_cb)
        )
        if paired is not None:
            self._send(paired)

    def _on_goal(self, msg: PointStamped) -> None:
        try:
            goal = validate_vector([msg.point.x, msg.point.y], size=2, reason="bad_goal")
            name = goal_prompt_name(goal)  # one the server cannot take: the link says why
        except ValueError as exc:  # ConversionError
            self.drops.add("bad_goal")
            self.get_logger().warning(f"goal dropped: {exc}", throttle_duration_sec=2.0)
            return
        if name == self.goal_prompt:
            return
        self.get_logger().info(f"goal ({goal[0]:.3f}, {goal[1]:.3f}) m: stream prompt {name}")
        self.goal_prompt = name
        self.client.set_prompt(name)
        # the old stream's chunks stop by intent: the new one has a whole deadline to start
        self.gate.restart_deadline(self.now_ns())
        self.client.start()  # no-op once started

    def _on_wrench(self, msg: WrenchStamped) -> None:
        f, t = msg.wrench.force, msg.wrench.torque
        self._take_vector("wrench", msg.header, [f.x, f.y, f.z, t.x, t.y, t.z], "nan_wrench")

    def _on_object(self, msg: PointStamped) -> None:
        p = msg.point
        self._take_vector("object", msg.header, [p.x, p.y, p.z], "nan_object")

    def _take_vector(self, stream: str, header, values: list[float], reason: str) -> None:
        """An aux stream's vector sample, paired by its stamp; a non-finite one is dropped
        (``reason``) and said, at most every 2 s."""
        self.rates[stream].tick()
        try:
            vector = validate_vector(values, size=len(values), reason=reason)
        except ConversionError as exc:
            self.drops.add(exc.reason)
            self.get_logger().warning(f"{stream} dropped: {exc}", throttle_duration_sec=2.0)
            return
        self._take_aux(stream, header, vector)

    def _on_joints(self, msg: JointState) -> None:
        self.rates["joints"].tick()
        try:
            positions = validate_vector(msg.position, size=len(msg.name), reason="bad_joints")
            velocities = (
                validate_vector(msg.velocity, size=len(msg.name), reason="bad_joints")
                if len(msg.velocity)
                else None
            )
        except ConversionError as exc:
            self.drops.add(exc.reason)
            self.get_logger().warning(f"joint state dropped: {exc}", throttle_duration_sec=2.0)
            return
        self._take_aux("joints", msg.header, (tuple(msg.name), positions, velocities))

    def _on_command(self, msg: JointTrajectory) -> None:
        self.rates["command"].tick()
        if not self._command_order and msg.points:
            # No order configured: the first command's joint order is the action order.
            self._command_order = tuple(msg.joint_names)
            self.get_logger().info(
                f"commanded actions in the joint order of the first command: "
                f"{list(self._command_order)}"
            )
        try:
            positions = command_positions(
                msg.joint_names, [pt.positions for pt in msg.points], self._command_order
            )
        except ConversionError as exc:
            self._count_command_problem(
                exc.reason, f"{self.p.command_topic} message ignored: {exc}"
            )
            return
        command_stamp_ns = stamp_ns(msg.header)
        if command_stamp_ns == 0:
            # JointTrajectory convention: a zero stamp means "now".
            command_stamp_ns = self.now_ns()
        if not self.commands.add(command_stamp_ns, positions):
            self._count_command_problem(
                "command:out_of_order_stamp",
                f"{self.p.command_topic} message ignored: its stamp is not newer than the last one",
            )
            return
        self.counts["commands"] += 1
        self.execution.on_command(command_stamp_ns, np.asarray(positions, np.float64))
        waiting = self._awaiting_command
        if waiting is not None and command_stamp_ns >= waiting[0].image.stamp_ns:
            self._awaiting_command = None  # every command before the image is in now
            self._send_now(waiting[0])

    def _command_may_be_in_flight(self, image_stamp_ns: int) -> bool:
        """Commands flow, but none stamped at or after the image has arrived yet: the one in
        force when it was taken may still be on its way."""
        if not self.p.command_topic or self.p.command_wait_s <= 0:
            return False
        newest = self.commands.newest_stamp_ns()
        return newest is not None and 0 < image_stamp_ns - newest <= self.commands.max_age_ns

    def _flush_awaiting_command(self, *, deadline_only: bool) -> None:
        """Sends the image waiting for its command (with the commands there are) if it has
        waited command_wait_s, or at once unless ``deadline_only``."""
        waiting = self._awaiting_command
        if waiting is not None and (not deadline_only or time.monotonic() >= waiting[1]):
            self._awaiting_command = None
            self._send_now(waiting[0])

    def _count_command_problem(self, reason: str, detail: str) -> None:
        """Counts ``reason`` as a drop and says so, at most every 2 s (one call site, one
        throttle: rclpy's log filters are per call site)."""
        self.drops.add(reason)
        count = self.drops.snapshot().get(reason, 0)
        self.get_logger().warning(f"{detail} ({reason}: {count} so far)", throttle_duration_sec=2.0)

    def _command_for(self, image_stamp_ns: int, promise) -> np.ndarray | None:
        """The command in force when the image was taken, if it fits the model; a missing
        or unusable one is counted (the observation still goes, without an action)."""
        if not self.p.command_topic:
            return None
        if promise is not None and promise.action_dim == 0:
            return None  # the model takes no actions: nothing to condition on, no drop
        command, why = self.commands.before(image_stamp_ns)
        if command is None:
            self._count_command_problem(
                f"command:{why}",
                f"observation sent without a commanded action: no {self.p.command_topic} message "
                + (
                    f"within {self.p.command_max_age_s} s before the image"
                    if why == "stale"
                    else "before the image"
                ),
            )
            return None
        if promise is not None and promise.action_dim != len(command):
            self._count_command_problem(
                "command:dim_mismatch",
                f"observation sent without a commanded action: {len(command)} joints "
                f"{list(self._command_order)}, the model takes {promise.action_dim} actions "
                "(set command_joint_names)",
            )
            return None
        return command

    def _take_aux(self, stream: str, header, value) -> None:
        sample = Sample(stamp_ns=stamp_ns(header), value=value, received_s=time.perf_counter())
        paired = self.pairer.add_aux(stream, sample)
        if paired is not None:
            self._send(paired)

    def _send(self, paired: PairedObservation) -> None:
        self._flush_awaiting_command(deadline_only=False)  # an older image goes first
        if self._command_may_be_in_flight(paired.image.stamp_ns):
            self._awaiting_command = (paired, time.monotonic() + self.p.command_wait_s)
            return
        self._send_now(paired)

    def _send_now(self, paired: PairedObservation) -> None:
        observed = paired.image.value
        fields = observed
        promise = self._promise
        if promise is None:  # until the stream opens; then the receive thread keeps it fresh
            promise = self._promise = self.client.stats().promise
        if promise is None and self.p.resize_to_model:
            # The model's image size comes with the stream: sent as captured, the image would
            # wait in the link and reach the server at the camera's size (dropped there,
            # image_size). The stream's first observation is the first image after it opens.
            self.counts["not_sent_before_stream"] += 1
            return
        if self.p.resize_to_model and promise.image_height > 0:
            fields = resize_fields(observed, promise.image_height, promise.image_width)
        names, positions, velocities = paired.joints.value if paired.joints else ((), None, None)
        action = self._command_for(paired.image.stamp_ns, promise)
        with self._lock:
            self._seq += 1
            seq = self._seq
            self._observed[seq] = observed
            while len(self._observed) > _OBSERVED_IMAGES_KEPT:
                self._observed.popitem(last=False)
        timeline = None
        if promise is not None and promise.action_dim > 0 and self.p.command_topic:
            # a world-action model continues the rows the robot committed (wam_execution.py)
            timeline = self.execution.command_timeline(paired.image.stamp_ns)
        obs = Observation(
            seq=seq,
            capture_stamp_ns=paired.image.stamp_ns,
            image=CameraImage(
                encoding=fields.encoding,
                height=fields.height,
                width=fields.width,
                step=fields.step,
                data=fields.data,
            ),
            wrench=paired.wrench.value if paired.wrench else None,
            joint_names=names,
            joint_positions=positions,
            joint_velocities=velocities,
            action=action,
            commands=None if timeline is None else timeline[0],
            commands_start_ns=0 if timeline is None else timeline[1],
            commands_dt_ns=0 if timeline is None else timeline[2],
            object_position=paired.object_position.value if paired.object_position else None,
        )
        self.client.send_observation(obs)  # non-blocking: newest wins inside the client
        self.counts["sent"] += 1
        if action is not None:
            self.counts["observations_with_command"] += 1
        self.obs_to_send_ms.add((time.perf_counter() - paired.image.received_s) * 1e3)

    # ---- predictions: the receive thread publishes -------------------------------------

    def _receive_loop(self) -> None:
        while self._running:
            prediction = self.client.get_prediction(timeout_s=0.05)
            if prediction is None:
                continue
            t_got = time.perf_counter()
            try:
                self._publish_prediction(prediction)
            except Exception as exc:  # noqa: BLE001 - a bad chunk must not kill the output thread
                if not self.context.ok():
                    return  # Ctrl-C shut the context down under the publish
                self.drops.add("bad_prediction")
                self.get_logger().error(
                    f"prediction {prediction.chunk_index} not published: {exc!r}"
                )
                continue
            self.receive_to_publish_ms.add((time.perf_counter() - t_got) * 1e3)

    def interval_s(self) -> float:
        """The interval chunks come at: the pacing asked of the server if any, else the
        measured median once there are enough samples, else the server's promise."""
        if self.p.target_interval_ms > 0:
            return self.p.target_interval_ms / 1e3
        measured = self.interval_ms.summary()
        if measured["n"] >= _MEASURED_INTERVAL_MIN_SAMPLES:
            return measured["median"] / 1e3
        promise = self._promise
        if promise is not None and promise.expected_interval_ms > 0:
            return promise.expected_interval_ms / 1e3
        return 0.1

    def _follow_stream(self, pred: Prediction) -> None:
        """A new stream (e.g. server restart) renumbers chunks: the gate and the plan restart."""
        if pred.stream_id == self._stream_id:
            return
        self._stream_id = pred.stream_id
        self._promise = self.client.stats().promise
        self.gate.reset_stream()
        self.execution.restart()

    def _publish_prediction(self, pred: Prediction) -> None:
        if pred.preview_steps:  # a look at a chunk still in flight: not a chunk
            self._follow_stream(pred)
            start_ns = pred.received_ns + int(self.p.action_lead_s * 1e9)
            frames = len(pred.frames) if pred.frames is not None else 1
            frame_dt_s = self.interval_s() / max(frames, 1)
            stamp_ns = self._frames_stamp_ns(pred, frame_dt_s, start_ns)
            self.previews.publish(pred, stamp_ns, frame_dt_s)
            # a world-action model's timed rows may be executed at once (preview_actions.py)
            timed = pred.action_start_ns > 0 and pred.action_dt_ns > 0
            if self.p.act_on_previews and pred.actions is not None and timed:
                self._publish_timed_chunk(pred, self._action_rows(pred))
            return
        self.previews.on_chunk(pred)
        now_s = time.monotonic()
        if self._promise is None:
            self._promise = self.client.stats().promise
        self.counts["chunks_received"] += 1
        # interval, response and hops per delivery (rollouts: per rollout)
        if self.deliveries.is_new(pred.stream_id, pred.anchor_slot):
            self.chunk_rate.tick(now_s)
            if self._last_chunk_s is not None:
                self.interval_ms.add((now_s - self._last_chunk_s) * 1e3)
            self._last_chunk_s = now_s
            for name, value in pred.hop_ms.items():
                self.hop_ms.setdefault(name, RollingWindow()).add(value)
            if "capture_to_received" in pred.hop_ms:
                self.response_ms.add(pred.hop_ms["capture_to_received"])
        times = pred.server_times_ns
        self.chunk_overlap.add(pred.stream_id, times.get("entered", 0), times.get("left", 0))
        self._follow_stream(pred)
        interval_s = self.interval_s()
        self.gate.set_interval(interval_s)
        start_ns = pred.received_ns + int(self.p.action_lead_s * 1e9)
        if pred.frames is not None and len(pred.frames):
            frame_dt_s = interval_s / len(pred.frames)
            self._publish_frames(
                pred, self._frames_stamp_ns(pred, frame_dt_s, start_ns), frame_dt_s
            )
        if pred.actions is None:
            return  # a world model: frames only, nothing for the action gate
        actions = self._action_rows(pred)
        if pred.action_start_ns > 0 and pred.action_dt_ns > 0:
            self._publish_timed_chunk(pred, actions)
            return
        dt_s = self.p.action_dt_s or interval_s / max(1, actions.shape[0])
        decision = self._gate_chunk(
            pred, actions, now_ns=self.now_ns(), start_ns=start_ns, dt_s=dt_s
        )
        if decision is not None:
            self._publish_model_chunk(pred, decision, dt_s)

    @staticmethod
    def _action_rows(pred: Prediction) -> np.ndarray:
        return np.asarray(pred.actions, dtype=np.float32).reshape(len(pred.actions), -1)

    def _gate_chunk(
        self,
        pred: Prediction,
        actions: np.ndarray,
        *,
        now_ns: int,
        start_ns: int,
        dt_s: float,
        order: int | None = None,
    ):
        """The safety gate's decision on a model chunk (``order``: its place in the stream,
        the chunk index unless given); a refused chunk is counted (chunks_expired,
        chunk:<reason>), a refused preview as a preview ignored, and None returned."""
        decision = self.gate.on_chunk(
            now_ns=now_ns,
            chunk_index=pred.chunk_index if order is None else order,
            actions=actions,
            start_ns=start_ns,
            dt_s=dt_s,
            observation_stamp_ns=pred.observation_stamp_ns if pred.observation_seq >= 0 else 0,
        )
        if not decision.publish:
            if pred.preview_steps:
                self.execution.ignore_preview(decision.reason)
            else:
                self._count_expired(decision.reason)
            return None
        return decision

    def _count_expired(self, reason: str) -> None:
        self.counts["chunks_expired"] += 1
        self.drops.add(f"chunk:{reason}")

    def _publish_model_chunk(self, pred: Prediction, decision, dt_s: float, **trajectory) -> None:
        """A gated model chunk (or an acted-on preview) out (``trajectory``: the executed one,
        for timed chunks); the robot is no longer holding a fallback once one is."""
        preview = bool(pred.preview_steps)
        self._publish_actions(
            decision.actions,
            decision.start_ns,
            dt_s,
            ActionChunk.SOURCE_MODEL_PREVIEW if preview else ActionChunk.SOURCE_MODEL,
            **trajectory,
            stream_id=pred.stream_id,
            chunk_index=pred.chunk_index,
            observation_seq=pred.observation_seq,
            observation_stamp_ns=pred.observation_stamp_ns,
        )
        if not preview:
            self.counts["chunks_published"] += 1
        if self.holding:
            self.get_logger().info("model actions resumed")
            self.holding = ""

    def _publish_timed_chunk(self, pred: Prediction, actions: np.ndarray) -> None:
        """A chunk whose rows say the time they are for (a world-action model's), or a preview
        of one (act_on_previews): the gate refuses stale or out-of-order chunks and trims past
        rows, the execution joins what is left to the committed trajectory, which goes out
        whole from now on, in the order preview_actions.py admits chunks and previews."""
        steps = pred.preview_steps
        refused, order = self.execution.arrived(
            chunk_index=pred.chunk_index, preview_steps=steps, received_ns=pred.received_ns
        )
        if refused:  # not newer than what came or was executed (a preview's: counted)
            if not steps:
                self._count_expired(refused)
            return
        now_ns = self.now_ns()
        dt_s = pred.action_dt_ns / 1e9
        start_ns = pred.action_start_ns if self.p.execution == "delay_aware" else now_ns
        decision = self._gate_chunk(
            pred, actions, now_ns=now_ns, start_ns=start_ns, dt_s=dt_s, order=order
        )
        if decision is None:
            return
        report = self.execution.accept(
            actions=actions.astype(np.float64),
            start_ns=pred.action_start_ns,
            dt_ns=pred.action_dt_ns,
            chunk_index=pred.chunk_index,
            now_ns=now_ns,
            order=order,
            preview_steps=steps,
            received_ns=pred.received_ns,
        )
        if not report.accepted:
            if not steps:  # a preview's refusal is counted by the execution
                self._count_expired(report.reason)
            return
        self._publish_model_chunk(
            pred,
            decision,
            dt_s,
            trajectory=self.execution.trajectory(now_ns),
            trajectory_stamp_ns=now_ns,
        )

    @staticmethod
    def _frames_stamp_ns(pred: Prediction, frame_dt_s: float, fallback_ns: int) -> int:
        """When the camera will capture the first frame a prediction stands for: its
        anchor's capture stamp plus the frames between them (so a rollout's horizons and the
        camera's own frames line up in time); ``fallback_ns`` without an anchor."""
        if (
            pred.observation_stamp_ns > 0
            and pred.observation_seq >= 0
            and pred.first_frame_seq >= 0
        ):
            ahead = pred.first_frame_seq - pred.observation_seq
            return pred.observation_stamp_ns + int(ahead * frame_dt_s * 1e9)
        return fallback_ns

    def _publish_frames(self, pred: Prediction, start_ns: int, frame_dt_s: float) -> None:
        frames = np.asarray(pred.frames, dtype=np.uint8)
        for j, frame in enumerate(frames):
            msg = Image()
            fill_image_msg(
                msg,
                frame,
                stamp=outputs.time_msg(start_ns + int(j * frame_dt_s * 1e9)),
                frame_id=self.p.camera_frame,
            )
            self.frame_pub.publish(msg)
        with self._lock:
            observed = self._observed.get(pred.observation_seq)
        msg = Image()
        fill_image_msg(
            msg,
            side_by_side(
                fields_to_rgb(observed) if observed is not None else None,
                frames[0],
                height=self.p.side_by_side_height,
            ),
            stamp=outputs.time_msg(start_ns),
            frame_id=self.p.camera_frame,
        )
        self.sbs_pub.publish(msg)

    def _joint_names(self) -> list[str]:
        if self.p.joint_names:
            return list(self.p.joint_names)
        latest = self.pairer.latest("joints")
        return list(latest.value[0]) if latest is not None else []

    def _publish_actions(
        self,
        actions: np.ndarray,
        start_ns: int,
        dt_s: float,
        source: int,
        *,
        trajectory: tuple[np.ndarray, np.ndarray] | None = None,
        trajectory_stamp_ns: int = 0,
        **ids,
    ) -> None:
        """``actions`` go out as the ActionChunk; the JointTrajectory is ``trajectory``
        (time_from_start [P] ns from ``trajectory_stamp_ns``, rows [P, A]) when given, else
        the rows at start + i * dt."""
        joint_names = self._joint_names()
        names = list(self.p.action_names) or [
            joint_names[i] if i < len(joint_names) else f"action_{i}"
            for i in range(actions.shape[1])
        ]
        self.chunk_pub.publish(
            outputs.action_chunk_msg(
                actions=actions,
                start_ns=start_ns,
                dt_s=dt_s,
                names=names,
                frame_id=self.p.action_frame,
                source=source,
                **ids,
            )
        )
        traj_names = joint_names[: actions.shape[1]]
        if traj_names and trajectory is not None:
            from_start_ns, rows = trajectory
            self.traj_pub.publish(
                outputs.timed_trajectory_msg(
                    stamp_ns=trajectory_stamp_ns,
                    times_from_start_ns=from_start_ns,
                    rows=rows,
                    joint_names=traj_names,
                )
            )
        elif traj_names:
            self.traj_pub.publish(
                outputs.trajectory_msg(
                    actions=actions, start_ns=start_ns, dt_s=dt_s, joint_names=traj_names
                )
            )
        if (
            self.p.publish_markers
            and actions.shape[1] > max(self.p.ee_joint_indices, default=-1) >= 0
        ):
            self.marker_pub.publish(
                outputs.ee_path_markers(
                    actions=actions,
                    stamp_ns=start_ns,
                    frame_id=self.p.marker_frame,
                    joint_indices=list(self.p.ee_joint_indices),
                    link_lengths_m=list(self.p.link_lengths_m),
                    base_xy_m=list(self.p.arm_base_xy_m),
                    source=source,
                )
            )

    # ---- timers: deadline watchdog, stats and diagnostics ------------------------------

    def now_ns(self) -> int:
        return self.get_clock().now().nanoseconds

    def seconds_since_chunk(self) -> float:
        """Since the last prediction came (0 before the first)."""
        last = self._last_chunk_s
        return time.monotonic() - last if last is not None else 0.0

    def predicts_actions(self) -> bool:
        """A world-action model (its chunks carry actions), by the stream's promise or, from
        a server that does not say, by the chunks themselves."""
        promise = self._promise
        if promise is not None and promise.action_mode:
            return promise.action_mode == "predict"
        return self.gate.armed()

    @quiet_at_shutdown
    def _on_watchdog(self) -> None:
        self._flush_awaiting_command(deadline_only=True)
        now_ns = self.now_ns()
        if not self.predicts_actions() or not self.gate.check_deadline(now_ns):
            return  # a world model commands nothing: there is nothing to stop or hold
        promise = self._promise
        horizon = promise.action_horizon if promise and promise.action_horizon else 1
        latest = self.pairer.latest("joints")
        held = latest.value[1] if latest is not None else None
        dim = (
            promise.action_dim
            if promise and promise.action_dim
            else (len(held) if held is not None else 0)
        )
        link = self.client.stats()
        # an error older than the deadline came before the last chunk: not why chunks stopped
        news = link.last_error and link.robot_time_ns - link.last_error_ns <= int(
            self.gate.deadline_s * 1e9
        )
        self.holding = (
            f"no chunk for {self.gate.deadline_s * 1e3:.0f} ms (link {link.state}"
            + (f": {link.last_error}" if news else "")
            + ")"
        )
        self.get_logger().error(
            f"model actions stopped, publishing the {self.p.fallback} fallback: {self.holding}"
        )
        if dim == 0:
            self._publish_diagnostics(now_ns, link)
            return
        source = (
            ActionChunk.SOURCE_FALLBACK_HOLD
            if self.p.fallback == "hold"
            else ActionChunk.SOURCE_FALLBACK_ZEROS
        )
        rows = self.gate.fallback_actions(horizon=horizon, dim=dim, held=held)
        self._publish_actions(rows, now_ns, self.gate.deadline_s / horizon, source)
        self.counts["fallbacks"] += 1
        self._publish_diagnostics(now_ns, link)  # ERROR now, not at the next stats period

    @quiet_at_shutdown
    def _on_stats_timer(self) -> None:
        from physis_ros.nodes.bridge_report import pipeline_stats_msg

        link = self.client.stats()
        self._promise = link.promise
        if link.last_error != self._link_error_logged:  # a refusal is not silent
            if link.last_error:
                self.get_logger().warning(f"link: {link.last_error}")
            self._link_error_logged = link.last_error
        now_ns = self.now_ns()
        self.stats_pub.publish(pipeline_stats_msg(self, link, now_ns))
        self._publish_diagnostics(now_ns, link)

    def _publish_diagnostics(self, now_ns: int, link) -> None:
        from physis_ros.nodes.bridge_report import diagnostics_report

        self.diag_pub.publish(
            outputs.diagnostic_array(
                stamp_ns=now_ns,
                # namespace/name: two robots' bridges on one /diagnostics stay apart
                node_name=self.get_fully_qualified_name().lstrip("/"),
                report=diagnostics_report(self, link),
            )
        )

    def shutdown(self) -> None:
        self._running = False
        self._receiver.join(timeout=2.0)
        self.client.close()


SERVER_PORT_WAIT_S = 600.0
"""Longest the bridge waits for physis-serve's --port-file: the server writes it once it has
loaded the model and measured the engine at start-up, which takes minutes for a large model
or on a busy host (30 s was too short for push-wm in a make test-stress run)."""


def _wait_for_port(path: str, timeout_s: float) -> int:
    """The port the server wrote to ``path`` (physis-serve --port-file), waiting for it."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with open(path) as f:
                text = f.read().strip()
            if text:
                return int(text)
        except FileNotFoundError:
            pass
        time.sleep(0.05)
    raise TimeoutError(f"no port in {path} after {timeout_s} s")


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
