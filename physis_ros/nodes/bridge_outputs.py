"""The bridge's outputs: predictions out on the link's receive thread, the deadline watchdog
and the reports.

A prediction's frames go out stamped at their predicted time (``frame_out``); a preview is
published as one (and, with ``act_on_previews``, its timed rows executed). A chunk's actions
go to ``action_out.ActionOutput``: the safety gate, the timed execution and the fallback.
Each delivery is timed (``stats.ChunkTiming``), afresh after an outage of the link (the
outage is no interval of the stream); the stream's interval comes from the pacing asked for,
else what is measured, else the promise. ``chunks_published`` counts the chunks that went
out: a world-action model's actions, a world model's frames. The reports (``pipeline_stats``,
``/diagnostics``) are built from a ``bridge_report.BridgeSnapshot`` of the node's parts.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from rclpy.publisher import Publisher

from physis_ros.link.client import Prediction
from physis_ros.nodes import outputs
from physis_ros.nodes.action_out import ActionOutput, ActionPublisher
from physis_ros.nodes.bridge_link import BridgeLink
from physis_ros.nodes.bridge_params import BridgeParams
from physis_ros.nodes.bridge_report import (
    BridgeSnapshot,
    OutputsSnapshot,
    diagnostics_report,
    pipeline_stats_msg,
)
from physis_ros.nodes.conversions import ImageFields
from physis_ros.nodes.frame_out import FrameOutput, PreviewOutput, frames_stamp_ns
from physis_ros.nodes.stats import ChunkTiming, DropCounter, RollingWindow
from physis_ros.nodes.wam_execution import ActionExecution

MEASURED_INTERVAL_MIN_SAMPLES = 10
"""Deliveries measured before their median interval is trusted over the promise's."""


@dataclass(frozen=True, kw_only=True)
class OutputTopics:
    """The node's publishers the outputs use."""

    frames: Publisher
    side_by_side: Publisher
    action_chunk: Publisher
    joint_trajectory: Publisher
    ee_path: Publisher
    pipeline_stats: Publisher
    diagnostics: Publisher
    previews: PreviewOutput


class BridgeOutputs:
    """Predictions, fallbacks and reports out (see the module docstring)."""

    def __init__(
        self,
        p: BridgeParams,
        topics: OutputTopics,
        *,
        link: BridgeLink,
        execution: ActionExecution,
        drops: DropCounter,
        joint_state_names: Callable[[], tuple[str, ...]],
        joint_positions: Callable[[], np.ndarray | None],
        observed_image: Callable[[int], ImageFields | None],
        logger,
        clock_ns: Callable[[], int],
        context_ok: Callable[[], bool],
        node_name: str,
    ) -> None:
        self.p, self.topics = p, topics
        self._link, self._execution, self._drops = link, execution, drops
        self._logger, self._clock_ns, self._context_ok = logger, clock_ns, context_ok
        self._node_name = node_name
        self.frames = FrameOutput(
            topics.frames,
            topics.side_by_side,
            camera_frame=p.camera_frame,
            side_by_side_height=p.side_by_side_height,
            observed_image=observed_image,
        )
        publisher = ActionPublisher(
            p,
            chunk_pub=topics.action_chunk,
            trajectory_pub=topics.joint_trajectory,
            marker_pub=topics.ee_path,
            joint_state_names=joint_state_names,
        )
        self.actions = ActionOutput(
            p,
            publisher,
            link=link,
            execution=execution,
            drops=drops,
            joint_positions=joint_positions,
            logger=logger,
            clock_ns=clock_ns,
        )
        self.timing = ChunkTiming()
        self.receive_to_publish_ms = RollingWindow()
        self.chunks_received = 0
        self.frame_chunks_published = 0
        """A world model's chunks whose frames went out (its chunks carry no actions)."""

    # ---- predictions: the link's receive thread --------------------------------------------

    def publish(self, pred: Prediction, *, new_stream: bool) -> None:
        """One prediction out (``new_stream``: the first of a stream, which numbers its chunks
        afresh: the gate and the plan restart). A bad one is counted and said, never fatal."""
        t_got = time.perf_counter()
        if self._link.arrived(pred.received_ns):
            self.timing = ChunkTiming()  # the outage is not one of the stream's intervals
        try:
            if new_stream:
                self.actions.restart_stream()
            if pred.preview_steps:  # a look at a chunk still in flight: not a chunk
                self._publish_preview(pred)
            else:
                self._publish_chunk(pred)
        except Exception as exc:  # noqa: BLE001 - a bad chunk must not end the receive thread
            if self._context_ok():  # (else Ctrl-C shut the context down under the publish)
                self._drops.add("bad_prediction")
                self._logger.error(f"prediction {pred.chunk_index} not published: {exc!r}")
            return
        self.receive_to_publish_ms.add((time.perf_counter() - t_got) * 1e3)

    def _publish_preview(self, pred: Prediction) -> None:
        start_ns = pred.received_ns + int(self.p.action_lead_s * 1e9)
        frames = len(pred.frames) if pred.frames is not None else 1
        frame_dt_s = self.interval_s() / max(frames, 1)
        self.topics.previews.publish(pred, frames_stamp_ns(pred, frame_dt_s, start_ns), frame_dt_s)
        # a world-action model's timed rows may be executed at once (preview_actions.py)
        timed = pred.action_start_ns > 0 and pred.action_dt_ns > 0
        if self.p.act_on_previews and pred.actions is not None and timed:
            self.actions.timed_chunk(pred, _action_rows(pred))

    def _publish_chunk(self, pred: Prediction) -> None:
        self.topics.previews.on_chunk(pred)
        self._link.current_promise()  # known by now: the interval and the deadline use it
        self.chunks_received += 1
        # interval, response and hops per delivery (rollouts: per rollout)
        self.timing.add(
            stream_id=pred.stream_id,
            anchor_slot=pred.anchor_slot,
            hop_ms=pred.hop_ms,
            server_times_ns=pred.server_times_ns,
            now_s=time.monotonic(),
        )
        interval_s = self.interval_s()
        self.actions.gate.set_interval(interval_s)
        start_ns = pred.received_ns + int(self.p.action_lead_s * 1e9)
        if pred.frames is not None and len(pred.frames):
            frame_dt_s = interval_s / len(pred.frames)
            self.frames.publish(pred, frames_stamp_ns(pred, frame_dt_s, start_ns), frame_dt_s)
        if pred.actions is None:  # a world model: frames only, nothing for the action gate
            if pred.frames is not None and len(pred.frames):
                self.frame_chunks_published += 1
            return
        actions = _action_rows(pred)
        if pred.action_start_ns > 0 and pred.action_dt_ns > 0:
            self.actions.timed_chunk(pred, actions)
        else:
            dt_s = self.p.action_dt_s or interval_s / max(1, actions.shape[0])
            self.actions.chunk(pred, actions, start_ns=start_ns, dt_s=dt_s)

    # ---- what the stream is ----------------------------------------------------------------

    def interval_s(self) -> float:
        """The interval chunks come at: the pacing asked of the server if any, else the
        measured median once there are enough samples, else the server's promise."""
        if self.p.target_interval_ms > 0:
            return self.p.target_interval_ms / 1e3
        measured = self.timing.interval_ms.summary()
        if measured["n"] >= MEASURED_INTERVAL_MIN_SAMPLES:
            return measured["median"] / 1e3
        promise = self._link.promise
        if promise is not None and promise.expected_interval_ms > 0:
            return promise.expected_interval_ms / 1e3
        return 0.1

    def expect_new_stream(self) -> None:
        """The stream ends on purpose (a new prompt): the next one has a whole deadline to
        deliver its first chunk."""
        self.actions.gate.restart_deadline(self._clock_ns())

    # ---- timers: the deadline watchdog and the reports -------------------------------------

    def check_deadline(self, now_ns: int) -> bool:
        """True when the fallback went out just now (``ActionOutput.check_deadline``)."""
        return self.actions.check_deadline(now_ns)

    def stop(self, now_ns: int) -> None:
        """The bridge stops: no prediction goes out from now on, and a world-action model's
        robot gets the fallback (``ActionOutput.stop``)."""
        self._link.stop_receiving()
        self.actions.stop(now_ns)

    def snapshot(self) -> OutputsSnapshot:
        p, timing = self.p, self.timing
        extra: dict[str, float | int] = {}
        if p.previews or p.act_on_previews:
            extra.update(self.topics.previews.values())
        if self._execution.stats.accepted or p.act_on_previews:  # timed chunks: how they joined
            extra.update(self._execution.values(previews=p.act_on_previews))
        counts = {"chunks_received": self.chunks_received, **self.actions.counts}
        counts["chunks_published"] += self.frame_chunks_published
        counts["frames_published"] = self.frames.published
        return OutputsSnapshot(
            counts=counts,
            holding=self.actions.holding,
            fallback=p.fallback,
            world_model=not self.actions.predicts_actions(),
            seconds_since_chunk=timing.seconds_since_delivery(),
            target_interval_ms=self.interval_s() * 1e3 if self.chunks_received else 0.0,
            deadline_s=self.actions.gate.deadline_s,
            chunk_rate_hz=timing.rate.rate_hz(),
            chunk_overlap=timing.overlap.share(),
            interval_ms=timing.interval_ms.summary(),
            response_ms=timing.response_ms.summary(),
            hop_median_ms=timing.hop_medians_ms(),
            receive_to_publish_ms=self.receive_to_publish_ms.summary(),
            extra_values=extra,
        )

    def publish_stats(self, snap: BridgeSnapshot, now_ns: int) -> None:
        self.topics.pipeline_stats.publish(pipeline_stats_msg(snap, now_ns))

    def publish_diagnostics(self, snap: BridgeSnapshot, now_ns: int) -> None:
        self.topics.diagnostics.publish(
            outputs.diagnostic_array(
                stamp_ns=now_ns,
                # namespace/name: two robots' bridges on one /diagnostics stay apart
                node_name=self._node_name,
                report=diagnostics_report(snap),
            )
        )


def _action_rows(pred: Prediction) -> np.ndarray:
    return np.asarray(pred.actions, dtype=np.float32).reshape(len(pred.actions), -1)
