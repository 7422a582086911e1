"""What the bridge reports once a second: the PipelineStats message and the three
/diagnostics statuses (inputs, output, link), computed from the node's meters."""

from __future__ import annotations

from physis_ros.msg import PipelineStats
from physis_ros.nodes import outputs


def pipeline_stats_msg(node, link, now_ns: int) -> PipelineStats:
    msg = PipelineStats()
    msg.header.stamp = outputs.time_msg(now_ns)
    msg.connection_state = outputs.CONNECTION_STATES.get(link.state, PipelineStats.DISCONNECTED)
    msg.actions_stale = bool(node.holding)
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
    msg.chunk_overlap = float(node.chunk_overlap.share())
    msg.target_interval_ms = node.interval_s() * 1e3 if node.counts["chunks_received"] else 0.0
    interval = node.interval_ms.summary()
    msg.interval_median_ms, msg.interval_p99_ms = interval["median"], interval["p99"]
    msg.interval_jitter_ms = interval["std"]
    response = node.response_ms.summary()
    msg.response_latency_ms, msg.response_latency_p99_ms = response["median"], response["p99"]
    hops = sorted(node.hop_ms.items())
    msg.hop_names = [name for name, _ in hops]
    msg.hop_median_ms = [window.summary()["median"] for _, window in hops]
    obs = node.obs_to_send_ms.summary()
    msg.obs_to_send_median_ms, msg.obs_to_send_p99_ms = obs["median"], obs["p99"]
    pub = node.receive_to_publish_ms.summary()
    msg.receive_to_publish_median_ms, msg.receive_to_publish_p99_ms = pub["median"], pub["p99"]
    msg.clock_offset_ms = float(link.clock_offset_ms or 0.0)
    msg.clock_offset_uncertainty_ms = float(link.clock_offset_uncertainty_ms or 0.0)
    drops = all_drops(node, link)
    msg.drop_reasons = list(drops)
    msg.drop_counts = list(drops.values())
    msg.observations_dropped = sum(drops.values())
    msg.images_received = node.counts["images"]
    msg.observations_sent = int(link.observations_sent)
    msg.chunks_received = node.counts["chunks_received"]
    msg.chunks_published = node.counts["chunks_published"]
    msg.chunks_expired = node.counts["chunks_expired"]
    msg.fallbacks_published = node.counts["fallbacks"]
    msg.last_error = link.last_error
    return msg


def all_drops(node, link) -> dict[str, int]:
    """The node's own drop reasons plus the link's (prefixed ``link:``)."""
    drops = dict(node.drops.snapshot())
    drops.update({f"link:{reason}": count for reason, count in sorted(link.drops.items())})
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


def diagnostics_report(node, link) -> dict:
    """part -> (level, message, values) for outputs.diagnostic_array."""
    rates = {f"{name}_rate_hz": meter.rate_hz() for name, meter in node.rates.items()}
    drops = node.drops.snapshot()
    inputs_level = outputs.LEVEL_OK
    inputs_message = "receiving"
    if rates["image_rate_hz"] == 0:
        inputs_level, inputs_message = outputs.LEVEL_WARN, "no camera images"
    elif drops:
        inputs_level, inputs_message = outputs.LEVEL_WARN, f"{sum(drops.values())} inputs dropped"
    inputs_values = {
        **rates,
        "images_received": node.counts["images"],
        "observations_handed_to_link": node.counts["sent"],
        # images before the stream opened: their size for the model was not known yet
        "images_before_stream": node.counts["not_sent_before_stream"],
        # how many went with a commanded action (the world model's conditioning); why the
        # others did not is in the dropped_command:<reason> counts
        "commands_received": node.counts["commands"],
        "observations_with_command": node.counts["observations_with_command"],
    }
    inputs_values.update({f"dropped_{k}": v for k, v in drops.items()})
    obs = node.obs_to_send_ms.summary()
    inputs_values.update(obs_to_send_median_ms=obs["median"], obs_to_send_p99_ms=obs["p99"])

    promise = link.promise
    target_ms = node.interval_s() * 1e3 if node.counts["chunks_received"] else 0.0
    interval = node.interval_ms.summary()
    response = node.response_ms.summary()
    output_values = {
        "target_interval_ms": target_ms,
        "promised_interval_ms": float(promise.expected_interval_ms) if promise else 0.0,
        "promised_response_latency_ms": (
            float(promise.expected_response_latency_ms) if promise else 0.0
        ),
        "promise_revision": int(getattr(promise, "revision", 0)) if promise else 0,
        "horizon": int(promise.horizon) if promise else 0,
        "rollouts": bool(promise.rollouts) if promise else False,
        "chunk_overlap": node.chunk_overlap.share(),
        "interval_median_ms": interval["median"],
        "interval_p99_ms": interval["p99"],
        "interval_jitter_ms": interval["std"],
        "chunk_rate_hz": node.chunk_rate.rate_hz(),
        "response_latency_median_ms": response["median"],
        "response_latency_p99_ms": response["p99"],
        "receive_to_publish_median_ms": node.receive_to_publish_ms.summary()["median"],
        "chunks_received": node.counts["chunks_received"],
        "chunks_published": node.counts["chunks_published"],
        "chunks_expired": node.counts["chunks_expired"],
        "fallbacks_published": node.counts["fallbacks"],
        "deadline_ms": node.gate.deadline_s * 1e3,
    }
    if node.p.previews or node.p.act_on_previews:
        output_values.update(node.previews.values())
    if node.execution.stats.accepted or node.p.act_on_previews:  # timed chunks: how they joined
        output_values.update(node.execution.values(previews=node.p.act_on_previews))
    world_model = not node.predicts_actions()
    late_s = node.seconds_since_chunk()
    output_values["model_kind"] = "world model" if world_model else "world-action model"
    output_values["holding"] = node.holding
    if node.holding:  # never OK while the robot holds
        output_level = outputs.LEVEL_ERROR
        output_message = f"{node.p.fallback} fallback out: {node.holding}"
    elif world_model and node.counts["chunks_received"] and late_s > node.gate.deadline_s:
        output_level = outputs.LEVEL_WARN
        output_message = f"no predicted frames for {late_s * 1e3:.0f} ms"
    elif node.counts["chunks_received"] == 0:
        output_level, output_message = outputs.LEVEL_WARN, "no chunk yet"
    elif target_ms > 0 and interval["median"] > 1.1 * target_ms:
        output_level = outputs.LEVEL_WARN
        output_message = f"interval {interval['median']:.1f} ms > 110% of target {target_ms:.1f} ms"
    else:
        output_level, output_message = outputs.LEVEL_OK, "chunks on time"

    link_values = {
        "state": link.state,
        "connections": link.connections,
        "observations_sent": link.observations_sent,
        "predictions_received": link.predictions_received,
        "clock_offset_ms": float(link.clock_offset_ms or 0.0),
        "clock_offset_uncertainty_ms": float(link.clock_offset_uncertainty_ms or 0.0),
        "last_error": link.last_error,
    }
    link_values.update({f"dropped_{k}": v for k, v in sorted(link.drops.items())})
    if promise is not None:
        link_values.update(
            model=promise.model, stream_id=promise.stream_id, pipeline_depth=promise.pipeline_depth
        )
    if node.holding or (link.state == "disconnected" and link.connections > 0):
        link_level, link_message = (
            outputs.LEVEL_ERROR,
            f"link {link.state}: {link.last_error or 'chunks stopped'}",
        )
    elif link.state != "streaming":
        link_level, link_message = outputs.LEVEL_WARN, f"link {link.state}"
    elif faults := server_faults(link):
        # The server refused some of our observations (bad tensors, images it cannot decode,
        # NaN, ...) or its model produced NaN: streaming, but not as it should.
        link_level = outputs.LEVEL_WARN
        link_message = (
            f"server dropped {sum(faults.values())}: "
            + ", ".join(f"{reason} {count}" for reason, count in sorted(faults.items()))
            + (f" ({link.last_error})" if link.last_error else "")
        )
    else:
        link_level, link_message = outputs.LEVEL_OK, "streaming"
    return {
        "inputs": (inputs_level, inputs_message, inputs_values),
        "output": (output_level, output_message, output_values),
        "link": (link_level, link_message, link_values),
    }
