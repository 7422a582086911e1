"""The bridge's diagnostics after the link comes back, and its fallback when it stops, on the
node's parts with a scripted client and recording publishers (no ROS process):

- an outage (a link error, then predictions on a new connection) is logged once with its
  length; ``last_error`` is then empty (the recovery is in /diagnostics' link values), and a
  newer error shows again;
- the interval statistics restart after an outage instead of counting it as one interval;
- a world model's ``chunks_published`` counts its chunks whose frames went out;
- a world-action bridge that stops publishes its fallback once (a world model's: nothing),
  from the node's ``on_stop`` hook, which ``run_node`` calls before ``shutdown``.
"""

from __future__ import annotations

import types

import numpy as np
import pytest

from physis_ros.link.client import LinkPromise, LinkStats, Prediction
from physis_ros.msg import ActionChunk
from physis_ros.nodes import bridge_outputs
from physis_ros.nodes import outputs as outputs_module
from physis_ros.nodes.bridge_link import BridgeLink
from physis_ros.nodes.bridge_outputs import BridgeOutputs, OutputTopics
from physis_ros.nodes.bridge_params import BridgeParams
from physis_ros.nodes.bridge_report import (
    BridgeSnapshot,
    InputsSnapshot,
    diagnostics_report,
    pipeline_stats_msg,
)
from physis_ros.nodes.pairing import CommandHistory
from physis_ros.nodes.stats import DropCounter
from physis_ros.nodes.wam_execution import ActionExecution, ExecutionConfig

S = 1_000_000_000  # ns
REFUSED = "connect to 127.0.0.1:1: nothing listens there (connection refused)"


class ScriptedLink:
    """A LinkClient whose connections, errors and clock the test sets."""

    def __init__(self, action_mode: str = "condition") -> None:
        self.now_ns = 100 * S
        self.connections = 1
        self.last_error, self.last_error_ns = "", 0
        self.action_mode = action_mode

    def fail(self, text: str) -> None:
        self.last_error, self.last_error_ns = text, self.now_ns

    def promise(self) -> LinkPromise:
        return LinkPromise(
            stream_id=self.connections, model="scripted", steps=4, blocks=2,
            expected_interval_ms=200.0, pipeline_depth=1, expected_response_latency_ms=200.0,
            chunk_frames=2, image_height=16, image_width=16, action_horizon=4, action_dim=2,
            max_observation_bytes=1 << 20, horizon=1, action_mode=self.action_mode,
        )  # fmt: skip

    def stats(self) -> LinkStats:
        return LinkStats(
            state="streaming", promise=self.promise(), clock_offset_ms=0.0,
            clock_offset_uncertainty_ms=0.0, robot_time_ns=self.now_ns, server_time_ns=None,
            observations_sent=0, connections=self.connections, last_error=self.last_error,
            last_error_ns=self.last_error_ns,
        )  # fmt: skip

    def start(self) -> None:
        pass

    def get_prediction(self, timeout_s: float):
        return None

    def close(self) -> None:
        pass


class Log:
    def __init__(self) -> None:
        self.lines: list[tuple[str, str]] = []

    def info(self, text: str) -> None:
        self.lines.append(("info", text))

    def warning(self, text: str) -> None:
        self.lines.append(("warning", text))

    def error(self, text: str) -> None:
        self.lines.append(("error", text))


class Topic:
    def __init__(self) -> None:
        self.messages: list = []
        self.flushed = 0

    def publish(self, msg) -> None:
        self.messages.append(msg)

    def wait_for_all_acked(self, timeout) -> bool:
        self.flushed += 1
        return True


class Clock:
    """Stands in for the ``time`` module the outputs time deliveries with."""

    def __init__(self) -> None:
        self.now_s = 1000.0

    def monotonic(self) -> float:
        return self.now_s

    def perf_counter(self) -> float:
        return self.now_s


def make_bridge(client: ScriptedLink, log: Log, **params) -> tuple[BridgeLink, BridgeOutputs]:
    p = BridgeParams(**params)
    link = BridgeLink(
        p, client=client, client_name="/bridge", clock_ns=lambda: client.now_ns,
        on_prediction=lambda pred: None, logger=log,
    )  # fmt: skip
    assert link.try_start()
    execution = ActionExecution(
        ExecutionConfig(execution=p.execution, join=p.join, fade_rows=p.fade_rows,
                        commands_dt_s=p.commands_dt_s),
        CommandHistory(max_age_s=p.command_max_age_s),
    )  # fmt: skip
    topics = OutputTopics(
        frames=Topic(), side_by_side=Topic(), action_chunk=Topic(), joint_trajectory=Topic(),
        ee_path=Topic(), pipeline_stats=Topic(), diagnostics=Topic(),
        previews=types.SimpleNamespace(on_chunk=lambda pred: None),
    )  # fmt: skip
    outputs = BridgeOutputs(
        p, topics, link=link, execution=execution, drops=DropCounter(),
        joint_state_names=lambda: ("shoulder", "elbow"),
        joint_positions=lambda: np.array([0.25, -0.5]), observed_image=lambda seq: None,
        logger=log, clock_ns=lambda: client.now_ns, context_ok=lambda: True, node_name="bridge",
    )  # fmt: skip
    return link, outputs


def chunk(client: ScriptedLink, index: int, *, actions: bool = False) -> Prediction:
    return Prediction(
        stream_id=client.connections, chunk_index=index,
        frames=np.full((2, 16, 16, 3), index % 255, np.uint8),
        actions=np.full((4, 2), 0.1, np.float32) if actions else None, observation_seq=-1,
        observation_stamp_ns=0, server_times_ns={}, received_ns=client.now_ns,
        hop_ms={"capture_to_received": 150.0},
    )  # fmt: skip


def deliver(link, outputs, client, clock, count: int, *, every_s: float, first: int = 0):
    for i in range(first, first + count):
        pred = chunk(client, i)
        outputs.publish(pred, new_stream=link.follow_stream(pred.stream_id))
        client.now_ns += int(every_s * S)
        clock.now_s += every_s


def snapshot(link: BridgeLink, outputs: BridgeOutputs) -> BridgeSnapshot:
    inputs = InputsSnapshot(
        counts={"images": 0, "sent": 0, "not_sent_before_stream": 0, "commands": 0,
                "observations_with_command": 0},
        rates_hz={"image": 10.0, "wrench": 0.0, "joints": 0.0, "command": 0.0},
        obs_to_send_ms={"median": 0.0, "mean": 0.0, "p99": 0.0, "std": 0.0, "n": 0},
    )  # fmt: skip
    return BridgeSnapshot(
        inputs=inputs, outputs=outputs.snapshot(), drops={}, link=link.stats(),
        link_recovery=link.recovery,
    )  # fmt: skip


@pytest.fixture
def clock(monkeypatch) -> Clock:
    fake = Clock()
    monkeypatch.setattr(bridge_outputs, "time", fake)
    return fake


def test_an_outage_is_logged_once_with_its_length_and_last_error_clears(clock):
    client, log = ScriptedLink(), Log()
    link, outputs = make_bridge(client, log)
    try:
        deliver(link, outputs, client, clock, 5, every_s=0.2)
        client.fail(REFUSED)  # the server went away
        assert link.poll().last_error == REFUSED  # said while it lasts
        client.now_ns += 6 * S
        client.connections = 2  # a new connection streams
        deliver(link, outputs, client, clock, 3, every_s=0.2, first=5)
        recovered = [text for level, text in log.lines if "streaming again" in text]
        # from the last prediction before the outage (0.2 s after it) to the first after it
        assert recovered == [f"link: streaming again after a 6.2 s outage (last error: {REFUSED})"]
        snap = snapshot(link, outputs)
        assert snap.link.last_error == "" and link.poll().last_error == ""
        assert pipeline_stats_msg(snap, client.now_ns).last_error == ""
        level, message, values = diagnostics_report(snap)["link"]
        assert (level, message) == (outputs_module.LEVEL_OK, "streaming")
        assert values["last_error"] == "" and values["recovered_from"] == REFUSED
        assert values["outages"] == 1 and values["last_outage_s"] == pytest.approx(6.2)
        assert values["recovered_at"].endswith("+00:00")
        # a newer error is news again
        client.fail("server dropped: bad_tensor (image 3 bytes)")
        assert link.stats().last_error.startswith("server dropped")
        # a stream reopened on purpose (a new prompt) after it: no outage
        client.last_error = ""
        client.connections = 3
        deliver(link, outputs, client, clock, 2, every_s=0.2, first=8)
        assert sum("streaming again" in text for _, text in log.lines) == 1
    finally:
        link.close()


def test_the_first_connection_after_errors_clears_them_too(clock):
    client, log = ScriptedLink(), Log()
    client.connections = 0
    link, outputs = make_bridge(client, log)
    try:
        client.now_ns += 2 * S
        client.fail(REFUSED)  # the bridge came up before the server
        client.now_ns += 3 * S
        client.connections = 1
        deliver(link, outputs, client, clock, 2, every_s=0.2)
        assert link.stats().last_error == ""
        assert [text for _, text in log.lines if "streaming" in text] == [
            f"link: streaming, 5.0 s after the link started (last error: {REFUSED})"
        ]
    finally:
        link.close()


def test_interval_statistics_restart_after_an_outage(clock):
    client, log = ScriptedLink(), Log()
    link, outputs = make_bridge(client, log)
    try:
        deliver(link, outputs, client, clock, 20, every_s=0.2)
        assert outputs.timing.interval_ms.summary()["p99"] == pytest.approx(200.0)
        client.fail(REFUSED)
        client.now_ns += 10 * S
        clock.now_s += 10.0
        client.connections = 2
        deliver(link, outputs, client, clock, 20, every_s=0.2, first=20)
        interval = outputs.timing.interval_ms.summary()
        # the 10 s outage is no interval: the new connection's 19 intervals alone
        assert interval["n"] == 19 and interval["p99"] == pytest.approx(200.0), interval
        msg = pipeline_stats_msg(snapshot(link, outputs), client.now_ns)
        assert msg.interval_p99_ms == pytest.approx(200.0)
    finally:
        link.close()


def test_a_world_model_counts_the_chunks_and_frames_it_publishes(clock):
    client, log = ScriptedLink(action_mode="condition"), Log()
    link, outputs = make_bridge(client, log)
    try:
        deliver(link, outputs, client, clock, 7, every_s=0.2)
        snap = snapshot(link, outputs)
        assert snap.outputs.counts["chunks_published"] == 7
        assert snap.outputs.counts["frames_published"] == 14
        assert len(outputs.topics.frames.messages) == 14
        msg = pipeline_stats_msg(snap, client.now_ns)
        assert (msg.chunks_received, msg.chunks_published) == (7, 7)
        values = diagnostics_report(snap)["output"][2]
        assert values["chunks_published"] == 7 and values["frames_published"] == 14
    finally:
        link.close()


def test_a_world_action_bridge_publishes_its_fallback_once_when_it_stops(clock):
    client, log = ScriptedLink(action_mode="predict"), Log()
    link, outputs = make_bridge(client, log, fallback="hold")
    for i in range(3):
        pred = chunk(client, i, actions=True)
        outputs.publish(pred, new_stream=link.follow_stream(pred.stream_id))
        client.now_ns += S // 5
    chunks = outputs.topics.action_chunk.messages
    assert [m.source for m in chunks] == [ActionChunk.SOURCE_MODEL] * 3
    outputs.stop(client.now_ns)
    link.close()
    fallback = chunks[-1]
    assert len(chunks) == 4 and fallback.source == ActionChunk.SOURCE_FALLBACK_HOLD
    # hold: the joints where they are now, for the promise's horizon
    held = np.array(fallback.data).reshape(fallback.horizon, fallback.dim)
    np.testing.assert_allclose(held, [[0.25, -0.5]] * 4)
    assert outputs.topics.action_chunk.flushed == 1  # waited for it to be delivered
    assert outputs.actions.holding == "the bridge is stopping"
    assert any("fallback: the bridge is stopping" in text for _, text in log.lines)
    outputs.stop(client.now_ns)  # already holding: nothing more
    assert len(chunks) == 4


def test_a_world_model_bridge_publishes_nothing_when_it_stops(clock):
    client, log = ScriptedLink(action_mode="condition"), Log()
    link, outputs = make_bridge(client, log)
    deliver(link, outputs, client, clock, 3, every_s=0.2)
    outputs.stop(client.now_ns)
    link.close()
    assert outputs.topics.action_chunk.messages == [] and outputs.actions.holding == ""


def test_run_node_has_the_node_say_its_last_word_before_it_releases_anything():
    from physis_ros.nodes.run import _stop_node

    calls = []
    spinner = types.SimpleNamespace(shutdown=lambda timeout_sec: calls.append("executor"))
    node = types.SimpleNamespace(
        on_stop=lambda: calls.append("on_stop"),
        shutdown=lambda: calls.append("shutdown"),
        destroy_node=lambda: calls.append("destroy"),
    )
    _stop_node(spinner, node)
    assert calls == ["executor", "on_stop", "shutdown", "destroy"]
