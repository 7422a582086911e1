"""In-process pieces of the link: clock offset, wire conversion, image decoding, configs,
and the session's mapping of chunks to the observations they are conditioned on."""

from __future__ import annotations

import contextlib
import io
import itertools
import os
import random
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from link_fake_engine import FakeEngine, served
from link_server import wait_for
from PIL import Image

from physis_ros.link.client import LinkClient, Observation
from physis_ros.link.clock import ClockOffsetEstimator
from physis_ros.link.encoding import (
    LARGE_PAYLOAD_BYTES,
    array_to_tensor,
    tensor_header,
    tensor_to_array,
)
from physis_ros.link.proto_gen import physis_pb2 as pb
from physis_ros.link.wire import (
    CameraImage,
    WireError,
    observation_from_proto,
    observation_to_proto,
    parse_client_message,
    parse_server_message,
    rgb_image,
    serialize_observation,
)
from physis_ros.serve.config import frontend_config
from physis_ros.serve.frontend_config import FrontendConfig, ServerDescription, SessionLimits
from physis_ros.serve.observations import check_observation, decode_image, raw_image_to_rgb


def test_clock_offset_best_of_n_within_its_uncertainty():
    rng = random.Random(3)
    true_offset_ns = 123_456_789  # server ahead of robot
    est = ClockOffsetEstimator(window=16)
    robot_ns = 1_000_000_000
    for _ in range(16):
        up, down, hold = (rng.randint(50_000, 5_000_000) for _ in range(3))  # asymmetric
        t1 = robot_ns
        t2 = t1 + up + true_offset_ns
        t3 = t2 + hold
        t4 = t3 - true_offset_ns + down
        sample = est.add(t1, t2, t3, t4)
        assert sample.round_trip_ns == up + down
        robot_ns = t4 + 1_000_000
    error = abs(est.offset_ns - true_offset_ns)
    assert error <= est.uncertainty_ns
    best = est.best()
    assert best.round_trip_ns == min(s for s in [best.round_trip_ns])  # the kept minimum
    # A probe that claims the server held it longer than the round trip is impossible.
    assert est.add(0, 10, 1_000, 20) is None
    est.reset()
    assert est.offset_ns is None and len(est) == 0


def test_clock_offset_picks_the_smallest_round_trip():
    est = ClockOffsetEstimator(window=4)
    est.add(0, 5_000 + 9_000_000, 5_000 + 9_000_000, 10_000_000)  # slow, one-sided
    est.add(100, 200 + 50, 200 + 50, 300)  # fast and symmetric, offset 50
    assert est.offset_ns == 50
    assert est.uncertainty_ns == 100


@pytest.mark.parametrize("dtype", ["uint8", "int32", "int64", "float16", "float32", "float64"])
def test_tensor_round_trip(dtype):
    arr = (np.arange(24).reshape(2, 3, 4) % 7).astype(dtype)
    back = tensor_to_array(pb.Tensor.FromString(array_to_tensor(arr).SerializeToString()), name="x")
    assert back.dtype == arr.dtype and back.shape == arr.shape
    np.testing.assert_array_equal(back, arr)


def test_tensor_refuses_bad_dtype_and_size():
    with pytest.raises(WireError, match="bad_tensor"):
        tensor_to_array(pb.Tensor(dtype="object", shape=[1], data=b"\0" * 8), name="x")
    with pytest.raises(WireError, match="bad_tensor"):
        tensor_to_array(pb.Tensor(dtype="float32", shape=[3], data=b"\0" * 8), name="x")
    with pytest.raises(WireError, match="bad_tensor"):
        array_to_tensor(np.array(["a"]))


def test_observation_round_trip_and_checks():
    frame = np.random.default_rng(0).integers(0, 255, (4, 5, 3), dtype=np.uint8)
    obs = Observation(
        seq=7,
        capture_stamp_ns=11,
        image=rgb_image(frame),
        wrench=np.arange(6, dtype=np.float64),
        joint_names=("a", "b"),
        joint_positions=np.array([0.1, 0.2]),
        action=np.ones((2, 3), np.float32),
    )
    msg = pb.ClientMessage.FromString(
        observation_to_proto(obs, send_stamp_ns=12).SerializeToString()
    )
    assert msg.observation.send_stamp_ns == 12
    back = observation_from_proto(msg.observation)
    assert back.seq == 7 and back.joint_names == ("a", "b")
    np.testing.assert_array_equal(back.wrench, obs.wrench)
    np.testing.assert_array_equal(raw_image_to_rgb(back.image), frame)
    bad = Observation(
        seq=1, capture_stamp_ns=0, joint_names=("a",), joint_positions=np.array([1.0, 2.0])
    )
    with pytest.raises(WireError, match="bad_tensor"):
        _received(observation_to_proto(bad, send_stamp_ns=0).observation)


def _received(o: pb.Observation) -> Observation:
    """What the server makes of an observation message: parsed, then checked."""
    obs = observation_from_proto(o)
    check_observation(obs)
    return obs


def test_named_state_values_cross_as_doubles_and_are_checked_like_the_wrench():
    def crossed(state) -> Observation:
        obs = Observation(seq=1, capture_stamp_ns=2, state=state)
        raw = serialize_observation(obs, send_stamp_ns=3)
        return _received(pb.ClientMessage.FromString(raw).observation)

    back = crossed({"box_x": 0.1, "box_y": -0.3, "gripper_width": 0.02})
    assert back.state == {"box_x": 0.1, "box_y": -0.3, "gripper_width": 0.02}  # exactly
    assert crossed({}).state == {}  # optional: a world model takes none
    with pytest.raises(WireError) as err:
        crossed({"box_x": 0.1, "box_y": float("nan")})
    assert err.value.reason == "non_finite" and "box_y" in err.value.detail


def test_raw_encodings_and_row_padding():
    rgb = np.random.default_rng(1).integers(0, 255, (3, 4, 3), dtype=np.uint8)
    padded = np.zeros((3, 4 * 3 + 5), np.uint8)  # step > width * 3
    padded[:, :12] = rgb[:, :, ::-1].reshape(3, 12)
    bgr = CameraImage(encoding="bgr8", height=3, width=4, step=17, data=padded.tobytes())
    np.testing.assert_array_equal(raw_image_to_rgb(bgr), rgb)
    rgba = np.concatenate([rgb, np.full((3, 4, 1), 9, np.uint8)], axis=2)
    img = CameraImage(encoding="rgba8", height=3, width=4, step=16, data=rgba.tobytes())
    np.testing.assert_array_equal(raw_image_to_rgb(img), rgb)
    bgra = np.concatenate([rgb[:, :, ::-1], np.full((3, 4, 1), 9, np.uint8)], axis=2)
    img = CameraImage(encoding="bgra8", height=3, width=4, step=16, data=bgra.tobytes())
    np.testing.assert_array_equal(raw_image_to_rgb(img), rgb)
    mono = rgb[:, :, 0].copy()
    img = CameraImage(encoding="mono8", height=3, width=4, step=4, data=mono.tobytes())
    np.testing.assert_array_equal(raw_image_to_rgb(img), np.repeat(mono[:, :, None], 3, axis=2))
    with pytest.raises(WireError, match="image_layout"):
        raw_image_to_rgb(CameraImage(encoding="rgb8", height=3, width=4, step=11, data=b""))
    with pytest.raises(WireError, match="image_encoding"):
        raw_image_to_rgb(CameraImage(encoding="16UC1", height=1, width=1, step=2, data=b"\0\0"))


@pytest.mark.parametrize("fmt", ["png", "jpeg"])
def test_compressed_images_decode_with_pillow(fmt):
    rgb = np.zeros((16, 24, 3), np.uint8)
    rgb[:, :12] = (200, 30, 60)
    buf = io.BytesIO()
    Image.fromarray(rgb).save(buf, format=fmt.upper(), quality=95)
    img = CameraImage(encoding=fmt, height=0, width=0, step=0, data=buf.getvalue())
    out = decode_image(img, height=16, width=24)
    assert out.shape == (16, 24, 3) and out.dtype == np.uint8
    error = np.abs(out.astype(int) - rgb)
    if fmt == "png":
        assert error.max() == 0
    else:  # lossy: small on average, ringing only at the colour edge
        assert error.mean() <= 3.0 and error[:, :8].max() <= 8 and error[:, 16:].max() <= 8
    with pytest.raises(WireError, match="image_size"):
        decode_image(img, height=24, width=16)
    other = "jpeg" if fmt == "png" else "png"
    with pytest.raises(WireError, match="image_decode"):
        decode_image(
            CameraImage(encoding=other, height=0, width=0, step=0, data=buf.getvalue()),
            height=16,
            width=24,
        )


def test_configs_name_the_bad_value():
    with pytest.raises(ValueError, match="port"):
        FrontendConfig(port=70000)
    with pytest.raises(ValueError, match="max_observation_bytes"):
        FrontendConfig(max_message_bytes=10, limits=SessionLimits(max_observation_bytes=20))
    with pytest.raises(ValueError, match="tls_key_path"):
        FrontendConfig(tls_cert_path="c.pem")
    with pytest.raises(ValueError, match="frontend: unknown key"):
        frontend_config({"max_strems": 3})
    with pytest.raises(ValueError, match="outbound_queue"):
        SessionLimits(outbound_queue=0)
    with pytest.raises(ValueError, match="reconnect_backoff_s"):
        LinkClient("127.0.0.1:1", reconnect_backoff_s=(1.0, 0.5))
    with pytest.raises(ValueError, match="client_key_path"):
        LinkClient("127.0.0.1:1", client_cert_path="c.pem", root_cert_path="ca.pem")


def test_predictions_name_the_observation_they_are_conditioned_on():
    """The fake engine's actions are the mean pixel of the newest context chunk before the
    generated chunk: each prediction's observation_seq must match that value exactly."""
    engine = FakeEngine(slots=2, chunk_ms=4.0)
    with served(engine) as (loop, handle):
        client = LinkClient(f"127.0.0.1:{handle.port}", connect_timeout_s=5)
        client.start()
        try:
            wait_for(lambda: client.stats().state == "streaming", 10, what="streaming")
            seen = []
            for seq in range(1, 60):
                value = (seq * 37) % 256
                frame = np.full((16, 16, 3), value, np.uint8)
                client.send_observation(
                    Observation(seq=seq, capture_stamp_ns=time.time_ns(), image=rgb_image(frame))
                )
                time.sleep(0.003)
                while (p := client.get_prediction(0)) is not None:
                    seen.append(p)
            # The pipeline never stops generating: take what arrives for a little longer.
            end_s = time.monotonic() + 0.3
            while time.monotonic() < end_s:
                if (p := client.get_prediction(0.05)) is not None:
                    seen.append(p)
            conditioned = [p for p in seen if p.observation_seq > 0]
            assert len(conditioned) >= 10
            for p in conditioned:
                expected = ((p.observation_seq * 37) % 256) / 255.0
                assert p.actions[0, 0] == pytest.approx(expected, abs=1e-6), p.observation_seq
            # Each context chunk the engine got came from an observation, newest first.
            assert [c[1] for c in engine.contexts] == sorted(c[1] for c in engine.contexts)
        finally:
            client.close()
            # The engine thread frees the slot after the call ends: stopping it first raced that.
            wait_for(lambda: not loop.sessions(), 10, what="the stream closed")
    assert engine.info()["free_slots"] == "2"


def test_observed_chunks_are_the_frames_of_their_time_slot():
    """A model with 2 frames per chunk: frame n of the stream is in slot n // 2; each slot's
    observation enters the engine as that slot's context chunk, once its last frame came or
    a later slot's frame did (the missing frame filled from its nearest neighbour, counted);
    predictions follow each observed slot up to the horizon."""
    engine = FakeEngine(slots=2, chunk_ms=3.0, chunk_frames=2)
    with served(engine) as (loop, handle):
        client = LinkClient(f"127.0.0.1:{handle.port}", connect_timeout_s=5)

        def send(seq: int, value: int) -> None:
            frame = np.full((16, 16, 3), value, np.uint8)
            client.send_observation(
                Observation(seq=seq, capture_stamp_ns=time.time_ns(), image=rgb_image(frame))
            )

        def contexts(stream_id: int) -> list[list[int]]:
            return [
                [int(f[0, 0, 0]) for f in fr] for s, fr in engine.context_frames if s == stream_id
            ]

        try:
            client.start()
            wait_for(lambda: client.stats().state == "streaming", 10, what="streaming")
            (session,) = wait_for(loop.sessions, 10, what="a session")
            send(101, 10)  # frame 0 of the stream: slot 0 waits for its second frame
            wait_for(lambda: session.observations_received == 1, 10, what="frame 0 received")
            timeline = loop.live.timeline(session.stream_id)
            assert contexts(session.stream_id) == [] and timeline.outstanding == 0
            send(102, 20)
            wait_for(lambda: contexts(session.stream_id), 10, what="slot 0's context chunk")
            assert contexts(session.stream_id) == [[10, 20]]
            send(103, 30)  # slot 1, position 0; frame 104 is lost
            wait_for(lambda: session.observations_received == 3, 10, what="frame 2 received")
            send(105, 50)  # slot 2 starts: slot 1 is completed with what it has
            wait_for(lambda: len(contexts(session.stream_id)) == 2, 10, what="slot 1")
            assert contexts(session.stream_id)[1] == [30, 30]  # frame 104: nearest is 103
            assert [slot for s, slot, _ in engine.contexts if s == session.stream_id] == [0, 1]
            counters = session.counters()
            assert (counters.filled_frames, counters.incomplete_chunks) == (1, 1)
            assert counters.observed_chunks == 2
            preds = []
            wait_for(
                lambda: (
                    preds.extend(iter(lambda: client.get_prediction(0.0), None))
                    or any(p.anchor_slot == 1 for p in preds)
                ),
                10,
                what="a prediction anchored on slot 1",
            )
            for p in preds:  # horizon 1: each observed slot releases the next one
                assert p.chunk_index == p.anchor_slot + 1 and p.horizon == 1
                assert p.observation_seq == 102 + 2 * p.anchor_slot - (p.anchor_slot == 1)
                assert p.first_frame_seq == 101 + 2 * p.chunk_index
        finally:
            client.close()
            wait_for(lambda: not loop.sessions(), 10, what="the stream closed")
    assert engine.info()["free_slots"] == "2"
    # a closed stream's timeline (and its queue of observed slots) is freed
    assert session.closed and loop.live.timeline(session.stream_id) is None


def test_generation_is_paced_at_the_admitted_interval():
    """A client that sends its slots faster than the interval it was admitted at gets one
    generated chunk per interval (after a burst of ``horizon``); the slots it observed
    before their turn are counted ``server_behind``, never generated."""
    engine = FakeEngine(slots=1, chunk_ms=1.0)
    generated_s: list[float] = []
    submit = engine.submit_generate

    def timed_submit(stream_id, actions=None):
        generated_s.append(time.monotonic())
        return submit(stream_id, actions)

    engine.submit_generate = timed_submit
    interval_s = 0.2
    with served(engine) as (loop, handle):
        client = LinkClient(
            f"127.0.0.1:{handle.port}", connect_timeout_s=5, target_interval_ms=interval_s * 1e3
        )
        try:
            client.start()
            wait_for(lambda: client.stats().state == "streaming", 10, what="streaming")
            (session,) = wait_for(loop.sessions, 10, what="a session")
            frame = np.zeros((16, 16, 3), np.uint8)
            for seq in range(12):  # 12 slots (1 frame each), as fast as they go through
                client.send_observation(
                    Observation(seq=seq, capture_stamp_ns=time.time_ns(), image=rgb_image(frame))
                )
                wait_for(
                    lambda n=seq + 1: session.observations_received == n, 10, what="a frame in"
                )
            wait_for(
                lambda: session.counters().observations_used == 12, 10, what="12 observed slots"
            )
            wait_for(lambda: len(generated_s) >= 3, 10, what="3 generated chunks")
            # load only delays a generate: the pace is a lower bound on the gaps (half an
            # interval of slack for a camera's jitter, one per interval in the long run)
            gaps = [b - a for a, b in itertools.pairwise(generated_s[:3])]
            assert min(gaps) >= 0.45 * interval_s, gaps
            assert generated_s[2] - generated_s[0] >= 1.45 * interval_s, gaps
            # slots 2..11 were each generated before they were observed, or counted
            behind = session.counters().drops["server_behind"]
            assert behind >= 11 - len(generated_s), (behind, len(generated_s))
        finally:
            client.close()
            wait_for(lambda: not loop.sessions(), 10, what="the stream closed")


def test_action_conditioned_model_gets_the_newest_commanded_actions():
    engine = FakeEngine(
        slots=1, chunk_ms=3.0, action_horizon=4, action_dim=2, action_mode="condition"
    )
    with served(
        engine,
        description=ServerDescription(model="fake", steps=2, blocks=2, action_mode="condition"),
    ) as (_loop, handle):
        client = LinkClient(f"127.0.0.1:{handle.port}", connect_timeout_s=5)
        client.start()
        try:
            wait_for(lambda: client.stats().state == "streaming", 10, what="streaming")
            frame = np.zeros((16, 16, 3), np.uint8)
            client.send_observation(
                Observation(
                    seq=1,
                    capture_stamp_ns=time.time_ns(),
                    image=rgb_image(frame),
                    action=np.array([0.5, -1.0], np.float32),
                )
            )
            wait_for(
                lambda: any(a is not None for a in engine.generate_actions),
                10,
                what="a generate request with actions",
            )
            first = next(i for i, a in enumerate(engine.generate_actions) if a is not None)
            np.testing.assert_array_equal(
                engine.generate_actions[first], np.tile([[0.5, -1.0]], (4, 1))
            )
            # Before the observation: no actions; after it: the same actions held.
            assert all(a is None for a in engine.generate_actions[:first])
            time.sleep(0.05)
            for a in engine.generate_actions[first:]:
                np.testing.assert_array_equal(a, np.tile([[0.5, -1.0]], (4, 1)))
        finally:
            client.close()


@pytest.mark.parametrize("size", [10, 70_000, 921_600])
def test_serialize_with_payload_decodes_to_the_same_message(size):
    from physis_ros.link.encoding import serialize_with_payload

    rng = np.random.default_rng(size)
    frames = rng.integers(0, 255, size, dtype=np.uint8)
    msg = pb.ServerMessage(protocol_version=1)
    msg.prediction.stream_id = 3
    msg.prediction.chunk_index = 300
    array_to_tensor(frames, msg.prediction.frames)
    array_to_tensor(np.ones((16, 7), np.float32), msg.prediction.actions)
    msg.prediction.counters.drops["x"] = 2
    expected = pb.ServerMessage()
    expected.CopyFrom(msg)
    raw = serialize_with_payload(msg, ("prediction", "frames", "data"))
    assert pb.ServerMessage.FromString(raw) == expected
    parsed, frames_data = parse_server_message(raw)
    assert (frames_data is not None) == (size >= LARGE_PAYLOAD_BYTES)
    np.testing.assert_array_equal(
        tensor_to_array(parsed.prediction.frames, name="frames", data=frames_data), frames
    )
    if frames_data is not None:
        parsed.prediction.frames.data = bytes(frames_data)
    assert parsed == expected
    obs = Observation(
        seq=1,
        capture_stamp_ns=2,
        image=CameraImage(
            encoding="rgb8",
            height=1,
            width=size // 3,
            step=size // 3 * 3,
            data=bytes(frames[: size // 3 * 3]),
        ),
    )
    ref = observation_to_proto(obs, send_stamp_ns=3)
    raw = serialize_with_payload(
        observation_to_proto(obs, send_stamp_ns=3), ("observation", "image", "data")
    )
    assert pb.ClientMessage.FromString(raw) == ref
    # The payload given apart (never set in the message): the same bytes on the wire.
    assert serialize_observation(obs, send_stamp_ns=3) == raw
    head = pb.ServerMessage()
    head.CopyFrom(expected)
    head.prediction.frames.data = b""
    raw = serialize_with_payload(head, ("prediction", "frames", "data"), memoryview(frames))
    assert pb.ServerMessage.FromString(raw) == expected
    with pytest.raises(ValueError, match="already set"):
        serialize_with_payload(expected, ("prediction", "frames", "data"), b"x")


def test_tensor_header_is_the_array_without_a_copy():
    arr = np.arange(12, dtype=np.float32).reshape(3, 4)
    msg = pb.Tensor()
    buf = tensor_header(arr, msg)
    assert (msg.dtype, tuple(msg.shape)) == ("float32", (3, 4))
    assert np.shares_memory(np.frombuffer(buf, np.uint8), arr)
    msg.data = buf.tobytes()
    np.testing.assert_array_equal(tensor_to_array(msg, name="t"), arr)
    big = np.arange(6, dtype=">i4")  # big-endian: converted, values kept
    msg = pb.Tensor()
    msg.data = tensor_header(big, msg).tobytes()
    np.testing.assert_array_equal(tensor_to_array(msg, name="t"), big)
    with pytest.raises(WireError, match="bad_tensor"):
        tensor_header(np.zeros(2, np.complex64), pb.Tensor())


@contextlib.contextmanager
def _camera(*clients: LinkClient, period_s: float = 0.02):
    """Sends each client a frame every ``period_s`` (seq +1 each), as a robot's camera does:
    predictions come for observed slots."""
    stop = threading.Event()

    def run() -> None:
        seq = 0
        frame = rgb_image(np.zeros((16, 16, 3), np.uint8))
        while not stop.wait(period_s):
            seq += 1
            for c in clients:
                c.send_observation(
                    Observation(seq=seq, capture_stamp_ns=time.time_ns(), image=frame)
                )

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(5)


def test_an_error_keeps_the_robot_time_it_happened_at():
    """A reader (the bridge's fallback reason) tells the error that stopped the chunks from
    one before them by ``last_error_ns``; the server's newest drop, repeated in every
    message, is news only when the drop count grew."""
    now_ns = [1_000]
    client = LinkClient(
        "127.0.0.1:1", clock_ns=lambda: now_ns[0], connect_timeout_s=5,
        reconnect_backoff_s=(0.05, 0.2),
    )  # fmt: skip
    client.start()
    try:
        wait_for(lambda: client.stats().last_error, 10, what="the refused connect")
        assert "nothing listens" in client.stats().last_error
        assert client.stats().last_error_ns == 1_000
    finally:
        client.close()
    detail = "bad_image: 3 bytes"
    for t_ns, count, expect_ns in ((2_000, 1, 2_000), (3_000, 1, 2_000), (4_000, 2, 4_000)):
        now_ns[0] = t_ns
        client._counters.take_server_counts(
            pb.StreamCounters(drops={"bad_image": count}, last_drop_detail=detail)
        )
        stats = client.stats()
        assert stats.last_error == f"server dropped: {detail}"
        assert stats.last_error_ns == expect_ns, (t_ns, stats.last_error_ns)


def test_stuck_engine_ends_the_stream_and_the_client_reconnects():
    engine = FakeEngine(slots=4, chunk_ms=1e7)  # never finishes a chunk
    config = FrontendConfig(port=0, limits=SessionLimits(stall_timeout_s=0.3))
    with served(engine, config=config) as (_loop, handle):
        client = LinkClient(
            f"127.0.0.1:{handle.port}", connect_timeout_s=5, reconnect_backoff_s=(0.05, 0.2)
        )
        client.start()
        try:
            with _camera(client):
                wait_for(
                    lambda: client.stats().connections >= 2, 10, what="a reconnect after the stall"
                )
                assert "UNAVAILABLE" in client.stats().last_error
                assert "finished no chunk" in client.stats().last_error
        finally:
            client.close()


def test_a_failed_stream_ends_alone_an_engine_failure_ends_all():
    """StreamFailed naming a stream (a rank holding it died) ends that stream only: its
    client reconnects, the other stream keeps its call and its predictions. A failure naming
    no stream ends every stream."""
    engine = FakeEngine(slots=3, chunk_ms=3.0)
    with served(engine) as (loop, handle):
        target = f"127.0.0.1:{handle.port}"
        clients = [
            LinkClient(
                target, client_name=name, connect_timeout_s=5, reconnect_backoff_s=(0.05, 0.2)
            )
            for name in ("victim", "bystander")
        ]
        victim, bystander = clients
        for c in clients:
            c.start()
        try:
            with _camera(*clients):
                for c in clients:
                    wait_for(lambda c=c: c.get_prediction(0.1), 10, what="a first prediction")
                victim_id = victim.stats().promise.stream_id
                engine.fail(victim_id)
                wait_for(
                    lambda: victim.stats().connections >= 2, 10, what="the victim reconnecting"
                )
                assert "stream failed in the engine" in victim.stats().last_error
                # The bystander's call went on: same connection, predictions still coming.
                while bystander.get_prediction(0) is not None:
                    pass
                wait_for(lambda: bystander.get_prediction(0.1), 5, what="bystander predictions")
                assert bystander.stats().connections == 1
                assert bystander.stats().state == "streaming"
                assert loop.error == ""
                assert victim.stats().promise.stream_id != victim_id
                wait_for(lambda: victim.get_prediction(0.1), 10, what="the victim's new stream")

                engine.fail(None)
                for c in clients:
                    wait_for(
                        lambda c=c: c.stats().connections >= (3 if c is victim else 2),
                        10,
                        what="every client reconnecting after the engine failure",
                    )
                assert "engine failed" in loop.error
        finally:
            for c in clients:
                c.close()


def _glibc() -> bool:
    import platform

    return platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"


def test_retain_freed_memory_checks_its_values_and_applies_on_glibc():
    from physis_ros.memtune import retain_freed_memory

    with pytest.raises(ValueError, match="mmap_threshold_bytes"):
        retain_freed_memory(mmap_threshold_bytes=64 * 1024 * 1024)
    with pytest.raises(ValueError, match="trim_threshold_bytes"):
        retain_freed_memory(trim_threshold_bytes=1024, mmap_threshold_bytes=4096)
    assert retain_freed_memory() is _glibc()


def test_idle_trim_trims_once_after_large_messages_stop():
    from physis_ros.memtune import IdleTrim

    now = [100.0]
    trim = IdleTrim(2.0, large_bytes=1000, clock=lambda: now[0])
    trim.note(999)  # small messages never arm it
    now[0] += 10
    assert not trim.poll()
    trim.note(1000)
    now[0] += 1.9
    assert not trim.poll()  # large messages still flowing
    now[0] += 0.2
    assert trim.poll() is _glibc()
    assert not trim.poll()  # once per burst
    assert trim.trims == int(_glibc())


def _rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


@pytest.mark.skipif(not _glibc(), reason="malloc_trim is glibc's")
def test_idle_trim_gives_the_buffers_a_burst_left_back_to_the_kernel():
    from physis_ros.memtune import IdleTrim, _malloc_trim, retain_freed_memory

    retain_freed_memory()  # as the server runs: freed buffers are kept for reuse
    trim = IdleTrim(1.0, clock=lambda: 0.0)
    _malloc_trim()  # what earlier tests left free: 48 MB more stays under the trim threshold
    burst = [bytearray(os.urandom(1 << 20) * 4) for _ in range(12)]  # 48 MB, heap-allocated
    held_mb = _rss_mb()
    del burst
    kept_mb = _rss_mb()
    trim._clock = lambda: 10.0
    trim.note(1 << 20)
    trim._clock = lambda: 20.0
    assert trim.poll()
    # Kept for reuse until the trim (most of the 48 MB), given back by it.
    assert held_mb - kept_mb < 24, (held_mb, kept_mb)
    assert kept_mb - _rss_mb() > 24, (kept_mb, _rss_mb())


def test_prediction_queue_keeps_the_newest_when_the_caller_falls_behind():
    engine = FakeEngine(slots=1, chunk_ms=1.0)
    with served(engine) as (_loop, handle):
        client = LinkClient(
            f"127.0.0.1:{handle.port}", connect_timeout_s=5, prediction_queue_size=3
        )
        client.start()
        try:
            with _camera(client, period_s=0.005):
                wait_for(
                    lambda: client.stats().drops.get("client:prediction_queue_full", 0) >= 5,
                    10,
                    what="predictions dropped from the full queue",
                )
            received = client.stats().predictions_received
            taken = []
            while (p := client.get_prediction(0)) is not None and len(taken) < 10:
                taken.append(p.chunk_index)
            # The queue held at most its size, the oldest went first, the newest were kept.
            assert 1 <= len(taken) <= 3 + 2  # a chunk or two may land while draining
            assert taken == sorted(taken)
            assert taken[0] >= received - 3 - 2
        finally:
            client.close()


def _client_message_cases():
    from google.protobuf.internal.encoder import _VarintBytes

    rng = np.random.default_rng(7)
    big = rng.integers(0, 255, 200 * 300 * 3, dtype=np.uint8)
    obs = Observation(
        seq=4,
        capture_stamp_ns=5,
        image=CameraImage(encoding="rgb8", height=200, width=300, step=900, data=big.tobytes()),
        wrench=np.arange(6, dtype=np.float32),
        action=np.ones((16, 7), np.float32),
    )
    trailing = serialize_observation(obs, send_stamp_ns=6)  # pixels appended at the end
    embedded = observation_to_proto(obs, send_stamp_ns=6).SerializeToString()  # in the middle
    other = observation_to_proto(obs, send_stamp_ns=6)
    other.observation.image.data = big[::-1].tobytes()
    # Unknown fields of every wire type inside the image, around the pixels.
    image_tag = _VarintBytes(5 << 3 | 2)
    unknown = _VarintBytes(99 << 3 | 0) + b"\x05"  # varint field 99
    unknown += _VarintBytes(98 << 3 | 1) + b"\0" * 8 + _VarintBytes(97 << 3 | 5) + b"\0" * 4
    pixels = _VarintBytes(5 << 3 | 2) + _VarintBytes(len(big)) + big.tobytes()
    inner = unknown + pixels + unknown
    observation = image_tag + _VarintBytes(len(inner)) + inner
    with_unknown = b"\x08\x01" + _VarintBytes(2 << 3 | 2) + _VarintBytes(len(observation))
    with_unknown += observation
    # 100k tiny unknown fields before the observation: over the walk's budget of records.
    many_fields = b"".join([_VarintBytes(99 << 3 | 0) + b"\x01"] * 100_000) + trailing
    no_image = pb.ClientMessage(protocol_version=1)
    array_to_tensor(np.zeros(20_000, np.float32), no_image.observation.action)
    return {
        "trailing": trailing,
        "embedded": embedded,
        "merged_last_wins": trailing + other.SerializeToString(),
        "unknown_fields": with_unknown,
        "large_without_image": no_image.SerializeToString(),
        "many_fields": many_fields,
    }


@pytest.mark.parametrize(
    "case",
    [
        "trailing",
        "embedded",
        "merged_last_wins",
        "unknown_fields",
        "large_without_image",
        "many_fields",
    ],
)
def test_parse_client_message_equals_the_parser_without_copying_pixels(case):
    raw = _client_message_cases()[case]
    expected = pb.ClientMessage.FromString(raw)
    msg, pixels = parse_client_message(raw)
    if case in ("large_without_image", "many_fields"):
        assert pixels is None  # nothing to take out / left to the C parser
    else:
        assert pixels is not None and pixels.readonly
        assert np.shares_memory(np.frombuffer(pixels, np.uint8), np.frombuffer(raw, np.uint8))
        assert msg.observation.image.data == b""
        msg.observation.image.data = bytes(pixels)
    assert msg == expected


def test_parse_client_message_refuses_what_the_parser_refuses():
    from google.protobuf.message import DecodeError

    raw = _client_message_cases()["trailing"]
    for bad in (raw[:-10], b"\xff" * 70_000, raw[:3] + b"\x07" + raw[4:]):
        with pytest.raises(DecodeError):
            pb.ClientMessage.FromString(bad)
        with pytest.raises(DecodeError):
            parse_client_message(bad)


def test_large_frames_cross_the_link_intact():
    """Frames above LARGE_PAYLOAD_BYTES take the no-copy paths on both ends (appended on the
    server, a view of the received bytes on the client): the pixels must arrive as sent."""
    engine = FakeEngine(slots=1, chunk_ms=2.0, height=160, width=160)
    assert LARGE_PAYLOAD_BYTES <= 160 * 160 * 3
    with served(engine) as (_loop, handle):
        client = LinkClient(f"127.0.0.1:{handle.port}", connect_timeout_s=5)
        client.start()
        try:
            got = []
            deadline_s = time.monotonic() + 15
            seq = 0
            while len(got) < 5 and time.monotonic() < deadline_s:
                seq += 1  # predictions follow observed slots: the camera goes on
                frame = rgb_image(np.zeros((160, 160, 3), np.uint8))
                client.send_observation(
                    Observation(seq=seq, capture_stamp_ns=time.time_ns(), image=frame)
                )
                if (p := client.get_prediction(0.1)) is not None:
                    got.append(p)
            assert len(got) == 5, client.stats()
            for p in got:
                assert p.frames.shape == (1, 160, 160, 3) and p.frames.dtype == np.uint8
                assert (p.frames == p.chunk_index % 256).all(), p.chunk_index
        finally:
            client.close()
