"""The bridge's inputs: ROS messages in, observations out to the link.

Each message is validated and converted (a bad one is dropped, counted by reason and said
at most every 2 s); the camera image is paired by stamp with the wrench, joint states and a
tracked object's position (``pairing.ApproxTimePairer``) and with the command in force when
it was taken (``pairing.CommandHistory``: the newest one stamped before it). While commands
flow, an image whose command may still be in flight waits for it, at most command_wait_s.
The observation carries that command as its ``action`` and, for a world-action model, the
command timeline (``wam_execution``: what the robot commanded before the capture and has
committed after it).

A world-action model says what it takes by name in its contract (``contract.model``, from
the stream's promise): the bridge reads each of its robot inputs from the topic bound to its
source (joint states, the wrench, ``object_topics``) and sends them as the observation's
named state values; an input with no binding is named, and the stream refused. The task's
values (``task_topic``'s point, named by ``task_names`` or the contract) open the stream.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np

from physis_ros.contract.model import WRENCH_KEYS, ContractError, WamContract
from physis_ros.link.client import LinkPromise
from physis_ros.nodes.bridge_link import BridgeLink
from physis_ros.nodes.bridge_params import BridgeParams
from physis_ros.nodes.bridge_report import InputsSnapshot
from physis_ros.nodes.conversions import (
    ConversionError,
    ImageFields,
    command_positions,
    resize_fields,
    validate_vector,
)
from physis_ros.nodes.pairing import (
    ApproxTimePairer,
    CommandHistory,
    PairedObservation,
    Sample,
    SentImages,
)
from physis_ros.nodes.stats import DropCounter, RateMeter, RollingWindow
from physis_ros.nodes.wam_execution import ActionExecution

OBSERVED_IMAGES_KEPT = 16
"""Recent observed images (full size) kept by observation seq, for the side-by-side view."""


def stamp_ns(header) -> int:
    return header.stamp.sec * 1_000_000_000 + header.stamp.nanosec


class BridgeInputs:
    """Validates, converts and pairs the node's inputs; hands each observation to ``link``."""

    def __init__(
        self,
        p: BridgeParams,
        *,
        link: BridgeLink,
        commands: CommandHistory,
        execution: ActionExecution,
        drops: DropCounter,
        logger,
        clock_ns: Callable[[], int],
    ) -> None:
        self.p = p
        self._link, self._commands, self._execution = link, commands, execution
        self._drops, self._logger, self._clock_ns = drops, logger, clock_ns
        self.objects = p.objects()
        self.pairer = ApproxTimePairer(
            slop_s=p.slop_s,
            require_wrench=p.require_wrench,
            require_joints=p.require_joints,
            objects=tuple(self.objects),
            require_object=p.require_object,
            drops=drops,
        )
        # The action columns' joints: fixed by parameter, else on the first command.
        self._command_order: tuple[str, ...] = p.command_joint_names or p.action_names
        streams = ["image", "wrench", "joints", "command"]
        streams += [f"object:{name}" for name in self.objects]
        self.rates = {name: RateMeter() for name in streams}
        self.counts = dict.fromkeys(
            ("images", "sent", "not_sent_before_stream", "commands", "observations_with_command"),
            0,
        )
        self.obs_to_send_ms = RollingWindow()
        self.task: dict[str, float] = {}
        """The newest task values (empty before the first, or without task_topic)."""
        self._task_point: tuple[float, ...] | None = None
        """The newest task_topic point, until the model's contract names its values."""
        self.unbound = ""
        """Why the model cannot be fed (an input it takes has no binding): the stream is
        refused ("" while it can)."""
        self._checked_contract = ""
        self._parsed: WamContract | None = None
        self._sent_images = SentImages(OBSERVED_IMAGES_KEPT)
        # An image waiting for the command in force when it was taken: (it, monotonic deadline)
        self._awaiting_command: tuple[PairedObservation, float] | None = None

    # ---- messages in -----------------------------------------------------------------------

    def take_image(self, msg, convert: Callable[[object], ImageFields]) -> None:
        t_cb = time.perf_counter()
        self.rates["image"].tick()
        self.counts["images"] += 1
        try:
            fields = convert(msg)
        except ConversionError as exc:
            self._drops.add(exc.reason)
            self._logger.warning(f"image dropped: {exc}", throttle_duration_sec=2.0)
            return
        sample = Sample(stamp_ns=stamp_ns(msg.header), value=fields, received_s=t_cb)
        self._send(self.pairer.add_image(sample))

    def take_vector(self, stream: str, header, values: list[float], reason: str) -> None:
        """An aux stream's vector sample (``wrench``, ``object``), paired by its stamp; a
        non-finite one is dropped as ``reason``."""
        self.rates[stream].tick()
        try:
            vector = validate_vector(values, size=len(values), reason=reason)
        except ConversionError as exc:
            self._drops.add(exc.reason)
            self._logger.warning(f"{stream} dropped: {exc}", throttle_duration_sec=2.0)
            return
        self._take_aux(stream, header, vector)

    def take_joints(self, msg) -> None:
        self.rates["joints"].tick()
        size = len(msg.name)
        try:
            positions = validate_vector(msg.position, size=size, reason="bad_joints")
            velocities = (
                validate_vector(msg.velocity, size=size, reason="bad_joints")
                if len(msg.velocity)
                else None
            )
        except ConversionError as exc:
            self._drops.add(exc.reason)
            self._logger.warning(f"joint state dropped: {exc}", throttle_duration_sec=2.0)
            return
        self._take_aux("joints", msg.header, (tuple(msg.name), positions, velocities))

    def take_command(self, msg) -> None:
        """A JointTrajectory the robot commanded: kept by stamp for the images it pairs with,
        told to the execution, and it releases an image that waited for it."""
        self.rates["command"].tick()
        if not self._command_order and msg.points:
            # No order configured: the first command's joint order is the action order.
            self._command_order = tuple(msg.joint_names)
            self._logger.info(
                f"commanded actions in the joint order of the first command: "
                f"{list(self._command_order)}"
            )
        topic = self.p.command_topic
        try:
            positions = command_positions(
                msg.joint_names, [pt.positions for pt in msg.points], self._command_order
            )
        except ConversionError as exc:
            self._count_command_problem(exc.reason, f"{topic} message ignored: {exc}")
            return
        command_stamp_ns = stamp_ns(msg.header)
        if command_stamp_ns == 0:  # JointTrajectory convention: a zero stamp means "now"
            command_stamp_ns = self._clock_ns()
        if not self._commands.add(command_stamp_ns, positions):
            self._count_command_problem(
                "command:out_of_order_stamp",
                f"{topic} message ignored: its stamp is not newer than the last one",
            )
            return
        self.counts["commands"] += 1
        self._execution.on_command(command_stamp_ns, np.asarray(positions, np.float64))
        waiting = self._awaiting_command
        if waiting is not None and command_stamp_ns >= waiting[0].image.stamp_ns:
            self._awaiting_command = None  # every command before the image is in now
            self._send_now(waiting[0])

    def take_task(self, msg) -> dict[str, float]:
        """The task values of a new task_topic point; {} when they are the same as before, are
        bad, or the model's contract that names them is not known yet (``pending_task``)."""
        try:
            xyz = [msg.point.x, msg.point.y, msg.point.z]
            point = validate_vector(xyz, size=3, reason="bad_task")
        except ConversionError as exc:
            self._drops.add("bad_task")
            self._logger.warning(f"task dropped: {exc}", throttle_duration_sec=2.0)
            return {}
        self._task_point = tuple(float(v) for v in point)
        return self.pending_task()

    def pending_task(self) -> dict[str, float]:
        """The task values of the newest point once the names are known ({} while not, or
        when they are the ones the stream has)."""
        if self._task_point is None:
            return {}
        names = self.p.task_names
        if not names:
            contract = self._link.contract()
            names = contract.task_names if contract is not None else ()
        if not names:
            return {}
        if len(names) > len(self._task_point):
            self._note_unbound(f"the model takes task values {list(names)}; a point gives 3")
            return {}
        task = dict(zip(names, self._task_point, strict=False))
        if task == self.task:
            return {}
        self._logger.info(f"task {task}: the stream opens with it")
        self.task = task
        return task

    def flush_overdue(self) -> None:
        """The image waiting for its command goes once it has waited command_wait_s."""
        waiting = self._awaiting_command
        if waiting is not None and time.monotonic() >= waiting[1]:
            self._awaiting_command = None
            self._send_now(waiting[0])

    # ---- what others read ------------------------------------------------------------------

    def joint_state_names(self) -> tuple[str, ...]:
        """The joints of the newest joint state (() before the first)."""
        latest = self.pairer.latest("joints")
        return latest.value[0] if latest is not None else ()

    def joint_positions(self) -> np.ndarray | None:
        """The newest joint state's positions (None before the first)."""
        latest = self.pairer.latest("joints")
        return latest.value[1] if latest is not None else None

    def observed_image(self, seq: int) -> ImageFields | None:
        """The image sent as observation ``seq``, while it is among the recent ones."""
        return self._sent_images.get(seq)

    def snapshot(self) -> InputsSnapshot:
        return InputsSnapshot(
            counts=dict(self.counts),
            rates_hz={name: meter.rate_hz() for name, meter in self.rates.items()},
            obs_to_send_ms=self.obs_to_send_ms.summary(),
        )

    # ---- pairing and sending ---------------------------------------------------------------

    def _count_command_problem(self, reason: str, detail: str) -> None:
        """Counts ``reason`` as a drop and says so, at most every 2 s (one call site, one
        throttle: rclpy's log filters are per call site)."""
        self._drops.add(reason)
        count = self._drops.snapshot().get(reason, 0)
        self._logger.warning(f"{detail} ({reason}: {count} so far)", throttle_duration_sec=2.0)

    def _take_aux(self, stream: str, header, value) -> None:
        sample = Sample(stamp_ns=stamp_ns(header), value=value, received_s=time.perf_counter())
        self._send(self.pairer.add_aux(stream, sample))

    def _send(self, paired: PairedObservation | None) -> None:
        if paired is None:
            return
        waiting = self._awaiting_command  # an older image goes first
        if waiting is not None:
            self._awaiting_command = None
            self._send_now(waiting[0])
        if self._command_may_be_in_flight(paired.image.stamp_ns):
            self._awaiting_command = (paired, time.monotonic() + self.p.command_wait_s)
            return
        self._send_now(paired)

    def _command_may_be_in_flight(self, image_stamp_ns: int) -> bool:
        """Commands flow, but none stamped at or after the image has arrived yet: the one in
        force when it was taken may still be on its way."""
        if not self.p.command_topic or self.p.command_wait_s <= 0:
            return False
        newest = self._commands.newest_stamp_ns()
        return newest is not None and 0 < image_stamp_ns - newest <= self._commands.max_age_ns

    def _command_for(self, image_stamp_ns: int, promise: LinkPromise | None) -> np.ndarray | None:
        """The command in force when the image was taken, if it fits the model; a missing
        or unusable one is counted (the observation still goes, without an action)."""
        topic = self.p.command_topic
        if not topic:
            return None
        if promise is not None and promise.action_dim == 0:
            return None  # the model takes no actions: nothing to condition on, no drop
        command, why = self._commands.before(image_stamp_ns)
        if command is None:
            self._count_command_problem(
                f"command:{why}",
                f"observation sent without a commanded action: no {topic} message "
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

    def _send_now(self, paired: PairedObservation) -> None:
        observed = paired.image.value
        fields = observed
        promise = self._link.current_promise()
        state = None
        if promise is not None and promise.contract:
            state = self._state_values(paired, promise.contract)
            if state is None:
                return  # counted: an input is unbound, or missing from this pairing
        if promise is None and self.p.resize_to_model:
            # The model's image size comes with the stream: sent as captured, the image would
            # wait in the link and reach the server at the camera's size (dropped there,
            # image_size). The stream's first observation is the first image after it opens.
            self.counts["not_sent_before_stream"] += 1
            return
        if self.p.resize_to_model and promise.image_height > 0:
            fields = resize_fields(observed, promise.image_height, promise.image_width)
        action = self._command_for(paired.image.stamp_ns, promise)
        seq = self._sent_images.add(observed)
        timeline = None
        if promise is not None and promise.action_dim > 0 and self.p.command_topic:
            # a world-action model continues the rows the robot committed (wam_execution.py)
            timeline = self._execution.command_timeline(paired.image.stamp_ns)
        observation = paired.observation(seq, fields, action=action, timeline=timeline, state=state)
        if not self._link.send(observation):
            self.counts["not_sent_before_stream"] += 1  # no client yet: no stream either
            return
        self.counts["sent"] += 1
        if action is not None:
            self.counts["observations_with_command"] += 1
        self.obs_to_send_ms.add((time.perf_counter() - paired.image.received_s) * 1e3)

    # ---- the model's inputs by name ------------------------------------------------------

    def _state_values(self, paired: PairedObservation, contract_json: str) -> dict | None:
        """The model's robot inputs by name from this pairing (its contract: the promise's);
        None when one cannot be given (an unbound input refuses the stream; a missing joint
        in this joint state drops this image), counted."""
        contract = self._contract(contract_json)
        if contract is None:
            return None
        names, positions, velocities = paired.joints.value if paired.joints else ((), None, None)
        values = {}
        for s in contract.robot_state:
            if s.source == "wrench":
                if paired.wrench is None:
                    self._drops.add("missing_wrench")
                    return None
                values[s.name] = float(paired.wrench.value[WRENCH_KEYS.index(s.key)])
            elif s.source == "object":
                sample = paired.objects.get(s.object_name)
                if sample is None:
                    self._drops.add("missing_object")
                    return None
                values[s.name] = float(sample.value["xyz".index(s.key[-1])])
            else:
                source = positions if s.source == "joint_position" else velocities
                if source is None or s.key not in names:
                    self._drops.add("missing_joint")
                    self._logger.warning(
                        f"image dropped: the model takes {s.name} ({s.source} of joint "
                        f"{s.key}); the joint state has {list(names)}",
                        throttle_duration_sec=2.0,
                    )
                    return None
                values[s.name] = float(source[names.index(s.key)])
        return values

    def _contract(self, contract_json: str) -> WamContract | None:
        """The stream's contract, its bindings checked once per contract: an input whose
        source has no binding refuses the stream (``unbound``)."""
        if contract_json != self._checked_contract:
            self._checked_contract = contract_json
            try:
                contract = WamContract.from_json(contract_json)
            except ContractError as exc:
                self._note_unbound(f"the server's model contract is unusable: {exc}")
                return None
            self.unbound = ""
            problems = binding_problems(contract, self.p, tuple(self.objects))
            if problems:
                self._note_unbound("; ".join(problems))
            self._parsed = contract
        return None if self.unbound else self._parsed

    def _note_unbound(self, why: str) -> None:
        if why != self.unbound:
            self._logger.error(f"the model cannot be fed: {why}; the stream is refused")
            self._link.refuse(f"the model cannot be fed: {why}")
        self.unbound = why
        self._drops.add("unbound_input")


def binding_problems(contract: WamContract, p: BridgeParams, objects: tuple[str, ...]) -> list:
    """What the model's contract takes that no parameter binds, each named with its fix."""
    problems = []
    sources = {s.source for s in contract.robot_state}
    if sources & {"joint_position", "joint_velocity"} and not p.joint_states_topic:
        problems.append("it takes joint states: set joint_states_topic")
    if "wrench" in sources and not p.wrench_topic:
        problems.append("it takes the wrench: set wrench_topic")
    for name in contract.objects:
        if name not in objects:
            inputs = [s.name for s in contract.robot_state if s.object_name == name]
            problems.append(
                f"it takes object {name!r} ({', '.join(inputs)}): bind it with "
                f"object_topics:=['{name}=<PointStamped topic>']"
            )
    if contract.task_names and not p.task_topic:
        problems.append(
            f"it takes task values {list(contract.task_names)}: set task_topic (a PointStamped)"
        )
    return problems
