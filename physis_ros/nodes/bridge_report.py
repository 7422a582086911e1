"""What the bridge reports once a second: the PipelineStats message and the three
/diagnostics statuses (inputs, output, link), computed from a ``BridgeSnapshot`` of its
meters that the bridge's parts fill (``BridgeInputs``, ``BridgeOutputs``, ``BridgeLink``)."""

from __future__ import annotations

import datetime
from dataclasses import dataclass

from physis_ros.link.client import LinkStats
from physis_ros.msg import PipelineStats
from physis_ros.nodes import outputs
from physis_ros.nodes.bridge_link import LinkRecovery

Summary = dict[str, float]
"""A ``stats.RollingWindow.summary()``: median, mean, p99, std, n."""


@dataclass(frozen=True, kw_only=True)
class InputsSnapshot:
    counts: dict[str, int]
    """images, sent, not_sent_before_stream, commands, observations_with_command."""
    rates_hz: dict[str, float]
    """Per input stream: image, wrench, joints, command (and object with a tracker)."""
    obs_to_send_ms: Summary
    """From an image's callback to its observation handed to the link."""


@dataclass(frozen=True, kw_only=True)
class OutputsSnapshot:
    counts: dict[str, int]
    """chunks_received, chunks_published (a world-action model's actions, a world model's
    frames), chunks_expired, fallbacks, frames_published."""
    holding: str
    """Why the robot holds a fallback ("": it does not)."""
    fallback: str
    world_model: bool
    """Frames only: nothing commanded, nothing held."""
    seconds_since_chunk: float
    target_interval_ms: float
    """The interval chunks are expected at (0 before the first chunk)."""
    deadline_s: float
    chunk_rate_hz: float
    chunk_overlap: float
    interval_ms: Summary
    response_ms: Summary
    hop_median_ms: dict[str, float]
    receive_to_publish_ms: Summary
    extra_values: dict[str, float | int]
    """The previews' and the timed execution's values, where they are in use."""


@dataclass(frozen=True, kw_only=True)
class BridgeSnapshot:
    inputs: InputsSnapshot
    outputs: OutputsSnapshot
    drops: dict[str, int]
    """The node's own drops, by reason."""
    link: LinkStats
    link_waiting: str = ""
    """What the link waits for before it connects (the server's port file); "": nothing."""
    link_recovery: LinkRecovery | None = None
    """The newest outage the link came back from; None: none."""

    @property
    def counts(self) -> dict[str, int]:
        """Every counter of the node, by name."""
        return {**self.inputs.counts, **self.outputs.counts}


def pipeline_stats_msg(snap: BridgeSnapshot, now_ns: int) -> PipelineStats:
    link, out = snap.link, snap.outputs
    msg = PipelineStats()
    msg.header.stamp = outputs.time_msg(now_ns)
    msg.connection_state = outputs.CONNECTION_STATES.get(link.state, PipelineStats.DISCONNECTED)
    msg.actions_stale = bool(out.holding)
    promise = link.promise
    if promise is not None:
        msg.stream_id = int(promise.stream_id)
        msg.model = promise.model
        msg.steps, msg.blocks = int(promise.steps), int(promise.blocks)
        msg.pipeline_depth = int(promise.pipeline_depth)
        msg.horizon, msg.rollouts = int(promise.horizon), bool(promise.rollouts)
        msg.promised_interval_ms = float(promise.expected_interval_ms)
        msg.promised_response_latency_ms = float(promise.expected_response_latency_ms)
        msg.promise_revision = int(getattr(promise, "revision", 0))
    msg.chunk_overlap = float(out.chunk_overlap)
    msg.target_interval_ms = out.target_interval_ms
    interval = out.interval_ms
    msg.interval_median_ms, msg.interval_p99_ms = interval["median"], interval["p99"]
    msg.interval_jitter_ms = interval["std"]
    response = out.response_ms
    msg.response_latency_ms, msg.response_latency_p99_ms = response["median"], response["p99"]
    msg.hop_names = list(out.hop_median_ms)
    msg.hop_median_ms = list(out.hop_median_ms.values())
    obs = snap.inputs.obs_to_send_ms
    msg.obs_to_send_median_ms, msg.obs_to_send_p99_ms = obs["median"], obs["p99"]
    pub = out.receive_to_publish_ms
    msg.receive_to_publish_median_ms, msg.receive_to_publish_p99_ms = pub["median"], pub["p99"]
    msg.clock_offset_ms = float(link.clock_offset_ms or 0.0)
    msg.clock_offset_uncertainty_ms = float(link.clock_offset_uncertainty_ms or 0.0)
    drops = all_drops(snap)
    msg.drop_reasons = list(drops)
    msg.drop_counts = list(drops.values())
    msg.observations_dropped = sum(drops.values())
    msg.images_received = snap.inputs.counts["images"]
    msg.observations_sent = int(link.observations_sent)
    msg.chunks_received = out.counts["chunks_received"]
    msg.chunks_published = out.counts["chunks_published"]
    msg.chunks_expired = out.counts["chunks_expired"]
    msg.fallbacks_published = out.counts["fallbacks"]
    msg.last_error = link.last_error
    return msg


def all_drops(snap: BridgeSnapshot) -> dict[str, int]:
    """The node's own drop reasons plus the link's (prefixed ``link:``)."""
    drops = dict(snap.drops)
    drops.update({f"link:{reason}": count for reason, count in sorted(snap.link.drops.items())})
    return drops


BENIGN_SERVER_DROPS = ("superseded", "client_slow")
"""Server drops that are pacing, not faults: newest-wins and a slow reader."""


def server_faults(link) -> dict[str, int]:
    """The server's drops of this link's messages that are faults, by reason."""
    return {
        reason.removeprefix("server:"): count
        for reason, count in link.drops.items()
        if reason.startswith("server:")
        and reason.removeprefix("server:") not in BENIGN_SERVER_DROPS
        and count
    }


def diagnostics_report(snap: BridgeSnapshot) -> dict:
    """part -> (level, message, values) for outputs.diagnostic_array."""
    return {
        "inputs": _inputs_status(snap.inputs, snap.drops),
        "output": _output_status(snap.outputs, snap.link),
        "link": _link_status(
            snap.link, snap.outputs.holding, snap.link_waiting, snap.link_recovery
        ),
    }


def _inputs_status(inputs: InputsSnapshot, drops: dict[str, int]) -> tuple:
    rates = {f"{name}_rate_hz": rate for name, rate in inputs.rates_hz.items()}
    level, message = outputs.LEVEL_OK, "receiving"
    if rates["image_rate_hz"] == 0:
        level, message = outputs.LEVEL_WARN, "no camera images"
    elif drops:
        level, message = outputs.LEVEL_WARN, f"{sum(drops.values())} inputs dropped"
    values = {
        **rates,
        "images_received": inputs.counts["images"],
        "observations_handed_to_link": inputs.counts["sent"],
        # images before the stream opened: their size for the model was not known yet
        "images_before_stream": inputs.counts["not_sent_before_stream"],
        # how many went with a commanded action (the world model's conditioning); why the
        # others did not is in the dropped_command:<reason> counts
        "commands_received": inputs.counts["commands"],
        "observations_with_command": inputs.counts["observations_with_command"],
    }
    values.update({f"dropped_{k}": v for k, v in drops.items()})
    obs = inputs.obs_to_send_ms
    values.update(obs_to_send_median_ms=obs["median"], obs_to_send_p99_ms=obs["p99"])
    return level, message, values


def _output_status(out: OutputsSnapshot, link: LinkStats) -> tuple:
    promise = link.promise
    interval = out.interval_ms
    response = out.response_ms
    chunks_received = out.counts["chunks_received"]
    values = {
        "target_interval_ms": out.target_interval_ms,
        "promised_interval_ms": float(promise.expected_interval_ms) if promise else 0.0,
        "promised_response_latency_ms": (
            float(promise.expected_response_latency_ms) if promise else 0.0
        ),
        "promise_revision": int(getattr(promise, "revision", 0)) if promise else 0,
        "horizon": int(promise.horizon) if promise else 0,
        "rollouts": bool(promise.rollouts) if promise else False,
        "chunk_overlap": out.chunk_overlap,
        "interval_median_ms": interval["median"],
        "interval_p99_ms": interval["p99"],
        "interval_jitter_ms": interval["std"],
        "chunk_rate_hz": out.chunk_rate_hz,
        "response_latency_median_ms": response["median"],
        "response_latency_p99_ms": response["p99"],
        "receive_to_publish_median_ms": out.receive_to_publish_ms["median"],
        "chunks_received": chunks_received,
        "chunks_published": out.counts["chunks_published"],
        "frames_published": out.counts["frames_published"],
        "chunks_expired": out.counts["chunks_expired"],
        "fallbacks_published": out.counts["fallbacks"],
        "deadline_ms": out.deadline_s * 1e3,
        **out.extra_values,
        "model_kind": "world model" if out.world_model else "world-action model",
        "holding": out.holding,
    }
    late_s = out.seconds_since_chunk
    target_ms = out.target_interval_ms
    if out.holding:  # never OK while the robot holds
        level, message = outputs.LEVEL_ERROR, f"{out.fallback} fallback out: {out.holding}"
    elif out.world_model and chunks_received and late_s > out.deadline_s:
        level, message = outputs.LEVEL_WARN, f"no predicted frames for {late_s * 1e3:.0f} ms"
    elif chunks_received == 0:
        level, message = outputs.LEVEL_WARN, "no chunk yet"
    elif target_ms > 0 and interval["median"] > 1.1 * target_ms:
        level = outputs.LEVEL_WARN
        message = f"interval {interval['median']:.1f} ms > 110% of target {target_ms:.1f} ms"
    else:
        level, message = outputs.LEVEL_OK, "chunks on time"
    return level, message, values


def _link_status(
    link: LinkStats, holding: str, waiting: str, recovery: LinkRecovery | None
) -> tuple:
    values = {
        "state": link.state,
        "connections": link.connections,
        "observations_sent": link.observations_sent,
        "predictions_received": link.predictions_received,
        "clock_offset_ms": float(link.clock_offset_ms or 0.0),
        "clock_offset_uncertainty_ms": float(link.clock_offset_uncertainty_ms or 0.0),
        "last_error": link.last_error,
    }
    values.update({f"dropped_{k}": v for k, v in sorted(link.drops.items())})
    if recovery is not None:  # last_error is cleared once the link comes back: here it is
        values.update(
            outages=recovery.count,
            recovered_at=_utc_text(recovery.at_ns),
            last_outage_s=round(recovery.outage_s, 3),
            recovered_from=recovery.error,
        )
    promise = link.promise
    if promise is not None:
        values.update(
            model=promise.model, stream_id=promise.stream_id, pipeline_depth=promise.pipeline_depth
        )
    if holding or (link.state == "disconnected" and link.connections > 0):
        level = outputs.LEVEL_ERROR
        message = f"link {link.state}: {link.last_error or 'chunks stopped'}"
    elif waiting:
        level, message = outputs.LEVEL_WARN, waiting
    elif link.state != "streaming":
        level, message = outputs.LEVEL_WARN, f"link {link.state}"
    elif faults := server_faults(link):
        # The server refused some of our observations (bad tensors, images it cannot decode,
        # NaN, ...) or its model produced NaN: streaming, but not as it should.
        level = outputs.LEVEL_WARN
        message = (
            f"server dropped {sum(faults.values())}: "
            + ", ".join(f"{reason} {count}" for reason, count in sorted(faults.items()))
            + (f" ({link.last_error})" if link.last_error else "")
        )
    else:
        level, message = outputs.LEVEL_OK, "streaming"
    return level, message, values


def _utc_text(stamp_ns: int) -> str:
    """A robot-clock stamp as UTC, to the millisecond (ROS time is wall time unless a
    simulation drives the clock)."""
    stamp = datetime.datetime.fromtimestamp(stamp_ns / 1e9, tz=datetime.UTC)
    return stamp.isoformat(timespec="milliseconds")
