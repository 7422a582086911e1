"""The bridge's actions out, for a world-action model (its chunks carry actions).

``ActionOutput``: a model chunk passes the safety gate (``safety.ActionGate``: stale or
out-of-order chunks are refused, past rows trimmed) and goes out as rows at start + i * dt;
a chunk whose rows say the time they are for (or an acted-on preview of one) is joined into
the one committed trajectory (``wam_execution``), which goes out whole. When chunks stop for
the deadline, model actions stop and the ``hold``/``zeros`` fallback goes out once, with the
reason (``holding``) kept until a model chunk is published again; a bridge that stops does
the same (``stop``).

``ActionPublisher``: one block of rows as ``action_chunk`` (``physis_ros/ActionChunk``),
``joint_trajectory`` (for a joint_trajectory_controller) and, for a planar arm,
``predicted/ee_path`` (MarkerArray by forward kinematics).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
from rclpy.duration import Duration

from physis_ros.link.client import Prediction
from physis_ros.msg import ActionChunk
from physis_ros.nodes import outputs
from physis_ros.nodes.bridge_link import BridgeLink
from physis_ros.nodes.bridge_params import BridgeParams
from physis_ros.nodes.safety import ActionGate, GateDecision, SafetyConfig
from physis_ros.nodes.stats import DropCounter
from physis_ros.nodes.wam_execution import ActionExecution

STOP_FLUSH_S = 1.0
"""Longest a stopping bridge waits for its subscribers to acknowledge the fallback (a
reliable topic's message still unsent when the process ends is lost)."""


class ActionOutput:
    """A stream's model actions through the gate to the controller, and the fallback (see
    the module docstring). Chunks come on the receive thread, the deadline check on a timer."""

    def __init__(
        self,
        p: BridgeParams,
        publisher: ActionPublisher,
        *,
        link: BridgeLink,
        execution: ActionExecution,
        drops: DropCounter,
        joint_positions: Callable[[], np.ndarray | None],
        logger,
        clock_ns: Callable[[], int],
    ) -> None:
        self.p, self.publisher = p, publisher
        self._link, self._execution, self._drops = link, execution, drops
        self._joint_positions = joint_positions
        self._logger, self._clock_ns = logger, clock_ns
        self.gate = ActionGate(
            SafetyConfig(
                deadline_s=p.deadline_ms / 1000.0,
                fallback=p.fallback,
                max_observation_age_s=p.max_observation_age_s,
            )
        )
        self.counts = dict.fromkeys(("chunks_published", "chunks_expired", "fallbacks"), 0)
        self.holding = ""
        """Why the robot holds (a fallback went out, no model chunk published since); "": not."""

    def restart_stream(self) -> None:
        """A new stream numbers its chunks afresh: the gate and the plan restart."""
        self.gate.reset_stream()
        self._execution.restart()

    def predicts_actions(self) -> bool:
        """A world-action model (its chunks carry actions), by the stream's promise or, from
        a server that does not say, by the chunks themselves."""
        promise = self._link.promise
        if promise is not None and promise.action_mode:
            return promise.action_mode == "predict"
        return self.gate.armed()

    def chunk(self, pred: Prediction, actions: np.ndarray, *, start_ns: int, dt_s: float) -> None:
        """A model chunk whose rows are for start_ns + i * dt_s, through the gate."""
        decision = self._gate(pred, actions, now_ns=self._clock_ns(), start_ns=start_ns, dt_s=dt_s)
        if decision is not None:
            self._publish_model_rows(pred, decision, dt_s)

    def timed_chunk(self, pred: Prediction, actions: np.ndarray) -> None:
        """A chunk whose rows say the time they are for (a world-action model's), or a preview
        of one (act_on_previews): the gate refuses stale or out-of-order chunks and trims past
        rows, the execution joins what is left to the committed trajectory, which goes out
        whole from now on, in the order preview_actions.py admits chunks and previews."""
        steps = pred.preview_steps
        refused, order = self._execution.arrived(
            chunk_index=pred.chunk_index, preview_steps=steps, received_ns=pred.received_ns
        )
        if refused:  # not newer than what came or was executed (a preview's: counted)
            if not steps:
                self._count_expired(refused)
            return
        now_ns = self._clock_ns()
        dt_s = pred.action_dt_ns / 1e9
        start_ns = pred.action_start_ns if self.p.execution == "delay_aware" else now_ns
        decision = self._gate(
            pred, actions, now_ns=now_ns, start_ns=start_ns, dt_s=dt_s, order=order
        )
        if decision is None:
            return
        report = self._execution.accept(
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
        self._publish_model_rows(
            pred,
            decision,
            dt_s,
            trajectory=self._execution.trajectory(now_ns),
            trajectory_stamp_ns=now_ns,
        )

    def _gate(
        self,
        pred: Prediction,
        actions: np.ndarray,
        *,
        now_ns: int,
        start_ns: int,
        dt_s: float,
        order: int | None = None,
    ) -> GateDecision | None:
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
                self._execution.ignore_preview(decision.reason)
            else:
                self._count_expired(decision.reason)
            return None
        return decision

    def _count_expired(self, reason: str) -> None:
        self.counts["chunks_expired"] += 1
        self._drops.add(f"chunk:{reason}")

    def _publish_model_rows(
        self, pred: Prediction, decision: GateDecision, dt_s: float, **trajectory
    ) -> None:
        """A gated model chunk (or an acted-on preview) out (``trajectory``: the executed one,
        for timed chunks); the robot is no longer holding a fallback once one is."""
        preview = bool(pred.preview_steps)
        self.publisher.publish(
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
            self._logger.info("model actions resumed")
            self.holding = ""

    def check_deadline(self, now_ns: int) -> bool:
        """True when a world-action model's chunks stopped for the deadline by ``now_ns``:
        model actions stop and the fallback, stamped ``now_ns``, goes out once (the robot
        holds until a chunk is published again). A world model commands nothing: there is
        nothing to stop or hold."""
        if not self.predicts_actions() or not self.gate.check_deadline(now_ns):
            return False
        link = self._link.stats()
        # an error older than the deadline came before the last chunk: not why chunks stopped
        news = link.last_error and link.robot_time_ns - link.last_error_ns <= int(
            self.gate.deadline_s * 1e9
        )
        self._fall_back(
            now_ns,
            f"no chunk for {self.gate.deadline_s * 1e3:.0f} ms (link {link.state}"
            + (f": {link.last_error}" if news else "")
            + ")",
        )
        return True

    def stop(self, now_ns: int) -> bool:
        """The bridge stops (however it was stopped: Ctrl-C, its launcher gone): a world-action
        model's robot gets the fallback, unless it already holds one, so that nothing goes on
        commanding it without a bridge. True when it went out."""
        if not self.predicts_actions() or self.holding:
            return False
        self._fall_back(now_ns, "the bridge is stopping")
        if not self.publisher.flush(STOP_FLUSH_S):
            self._logger.warning(
                f"the fallback was not acknowledged by every subscriber within {STOP_FLUSH_S} s"
            )
        return True

    def _fall_back(self, now_ns: int, why: str) -> None:
        """Model actions stop: the fallback, stamped ``now_ns``, goes out once with ``why``
        logged and kept as ``holding``."""
        promise = self._link.promise
        horizon = promise.action_horizon if promise and promise.action_horizon else 1
        held = self._joint_positions()
        dim = (
            promise.action_dim
            if promise and promise.action_dim
            else (len(held) if held is not None else 0)
        )
        self.holding = why
        self._logger.error(
            f"model actions stopped, publishing the {self.p.fallback} fallback: {self.holding}"
        )
        if dim == 0:
            return
        source = (
            ActionChunk.SOURCE_FALLBACK_HOLD
            if self.p.fallback == "hold"
            else ActionChunk.SOURCE_FALLBACK_ZEROS
        )
        rows = self.gate.fallback_actions(horizon=horizon, dim=dim, held=held)
        self.publisher.publish(rows, now_ns, self.gate.deadline_s / horizon, source)
        self.counts["fallbacks"] += 1


class ActionPublisher:
    """Publishes action rows; ``joint_state_names``: the joints of the newest joint state
    (the trajectory's joints and the rows' names unless parameters name them)."""

    def __init__(
        self,
        p: BridgeParams,
        *,
        chunk_pub,
        trajectory_pub,
        marker_pub,
        joint_state_names: Callable[[], tuple[str, ...]],
    ) -> None:
        self.p = p
        self.chunk_pub, self.trajectory_pub, self.marker_pub = chunk_pub, trajectory_pub, marker_pub
        self.joint_state_names = joint_state_names

    def flush(self, timeout_s: float) -> bool:
        """Until the rows published so far reached every subscriber, ``timeout_s`` at most;
        False when some did not acknowledge them in time."""
        deadline = time.monotonic() + timeout_s
        acked = True
        for pub in (self.chunk_pub, self.trajectory_pub):
            left_s = max(0.0, deadline - time.monotonic())
            acked &= bool(pub.wait_for_all_acked(Duration(nanoseconds=int(left_s * 1e9))))
        return acked

    def joint_names(self) -> list[str]:
        """The trajectory's joints: by parameter, else those of the newest joint state."""
        return list(self.p.joint_names or self.joint_state_names())

    def publish(
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
        joint_names = self.joint_names()
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
            self.trajectory_pub.publish(
                outputs.timed_trajectory_msg(
                    stamp_ns=trajectory_stamp_ns,
                    times_from_start_ns=from_start_ns,
                    rows=rows,
                    joint_names=traj_names,
                )
            )
        elif traj_names:
            self.trajectory_pub.publish(
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
