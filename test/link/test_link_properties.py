"""Property-based tests of the wire (hypothesis): whatever bytes or fields a client sends, the
server's checks end in a named, counted reason — never an exception out of the reader, never
the catch-all "internal_error" — and what the client library serialises parses back as sent."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from physis_ros.engine.api import StreamPromise
from physis_ros.link.encoding import (
    LARGE_PAYLOAD_BYTES,
    TENSOR_DTYPES,
    serialize_with_payload,
    tensor_to_array,
)
from physis_ros.link.proto_gen import physis_pb2 as pb
from physis_ros.link.wire import PROTOCOL_VERSION, WireError, parse_client_message
from physis_ros.serve.frontend_config import SessionLimits
from physis_ros.serve.session import Session

H, W = 8, 6
PROPERTY = settings(
    max_examples=300,
    deadline=None,  # no per-example time limit: the suite runs on busy machines
    derandomize=True,  # the same examples in every run: CI stays deterministic
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)


def _session() -> Session:
    promise = StreamPromise(
        stream_id=1,
        model="fake",
        steps=2,
        blocks=2,
        expected_interval_ms=10.0,
        pipeline_depth=2,
        expected_response_latency_ms=30.0,
        chunk_frames=2,
        image_height=H,
        image_width=W,
        action_horizon=3,
        action_dim=2,
    )
    taken: list = []  # the frames handed on to the engine's live timeline
    session = Session(
        promise=promise,
        limits=SessionLimits(max_observation_bytes=1 << 20, drop_log_interval_s=3600.0),
        add_frame=lambda frame: (taken.append(frame), (0, 0))[1],
        slot_counters=lambda: None,
    )
    session.taken = taken
    return session


def _outcome(session: Session, raw: bytes) -> str:
    """What became of one message: a drop reason, "kept" (an observed slot's frame) or
    "pong"."""
    before = sum(session.drops.values())
    outbound = len(session._outbound)
    session.offer(raw, 0)
    if sum(session.drops.values()) > before:
        return session.last_drop_detail.split(":")[0]
    if session.taken:  # handed on as a frame of the stream
        return "kept"
    assert len(session._outbound) > outbound, "a message vanished without a trace"
    return "pong"


dims = st.one_of(
    st.integers(0, 8),
    st.integers(0, 2**63 - 1),
    st.sampled_from([2**31, 2**32, 2**62, 2**63 - 1]),  # products that wrap int64
)
tensors = st.builds(
    lambda dtype, shape, data: pb.Tensor(dtype=dtype, shape=shape, data=data),
    st.one_of(st.sampled_from(TENSOR_DTYPES), st.text(max_size=8)),
    st.lists(dims, max_size=6),
    st.one_of(st.just(b""), st.binary(max_size=256)),
)
images = st.builds(
    lambda encoding, h, w, step, data: pb.CameraImage(
        encoding=encoding, height=h, width=w, step=step, data=data
    ),
    st.sampled_from(["rgb8", "bgr8", "mono8", "rgba8", "bgra8", "jpeg", "png", "yuv422", ""]),
    st.one_of(st.just(H), st.integers(0, 2**32 - 1)),
    st.one_of(st.just(W), st.integers(0, 2**32 - 1)),
    st.one_of(st.just(W * 3), st.integers(0, 2**32 - 1)),
    st.one_of(st.binary(max_size=512), st.just(b"\x89PNG\r\n\x1a\n" + b"\0" * 64)),
)
int64s = st.one_of(st.integers(-(2**63), 2**63 - 1), st.integers(-5, 10**19 // 10))


@st.composite
def client_messages(draw) -> bytes:
    msg = pb.ClientMessage(protocol_version=draw(st.sampled_from([PROTOCOL_VERSION, 0, 7])))
    if draw(st.booleans()):
        msg.ping.client_send_ns = draw(int64s)
        return msg.SerializeToString()
    o = msg.observation
    o.protocol_version = draw(st.sampled_from([PROTOCOL_VERSION, PROTOCOL_VERSION, 0]))
    o.seq = draw(int64s)
    o.capture_stamp_ns = draw(int64s)
    o.send_stamp_ns = draw(int64s)
    if draw(st.booleans()):
        o.image.CopyFrom(draw(images))
    for name in ("wrench", "joint_positions", "joint_velocities", "action"):
        if draw(st.booleans()):
            getattr(o, name).CopyFrom(draw(tensors))
    o.joint_names.extend(draw(st.lists(st.text(max_size=4), max_size=3)))
    return msg.SerializeToString()


@PROPERTY
@given(raw=client_messages())
def test_any_client_message_ends_in_a_named_reason(raw):
    outcome = _outcome(_session(), raw)
    assert outcome != "internal_error"


@PROPERTY
@given(raw=st.binary(max_size=2048))
def test_any_bytes_end_in_a_named_reason(raw):
    assert _outcome(_session(), raw) != "internal_error"


@PROPERTY
@given(tensor=tensors)
@example(tensor=pb.Tensor(dtype="float32", shape=[2**32, 2**32]))  # 2**64 elements wrap to 0
def test_tensor_to_array_returns_the_declared_array_or_a_wire_error(tensor):
    try:
        arr = tensor_to_array(tensor, name="t")
    except WireError as exc:
        assert exc.reason == "bad_tensor"
        return
    assert arr.shape == tuple(tensor.shape)
    assert arr.nbytes == len(tensor.data)


@PROPERTY
@given(
    seq=st.integers(0, 2**63 - 1),
    payload=st.binary(min_size=0, max_size=3 * LARGE_PAYLOAD_BYTES),
    names=st.lists(st.text(max_size=10), max_size=4),
)
def test_serialize_with_payload_parses_back_as_sent(seq, payload, names):
    msg = pb.ClientMessage(protocol_version=PROTOCOL_VERSION)
    msg.observation.seq = seq
    msg.observation.joint_names.extend(names)
    msg.observation.image.encoding = "rgb8"
    raw = serialize_with_payload(msg, ("observation", "image", "data"), payload)
    parsed, data = parse_client_message(raw)
    assert parsed.observation.seq == seq
    assert list(parsed.observation.joint_names) == names
    got = bytes(data) if data is not None else parsed.observation.image.data
    assert got == payload


@pytest.mark.parametrize("dtype", ["float32", "float64", "float16"])
def test_non_finite_values_are_named_in_every_float_dtype(dtype):
    session = _session()
    msg = pb.ClientMessage(protocol_version=PROTOCOL_VERSION)
    o = msg.observation
    o.protocol_version, o.seq = PROTOCOL_VERSION, 1
    o.image.encoding, o.image.height, o.image.width, o.image.step = "rgb8", H, W, W * 3
    o.image.data = bytes(H * W * 3)
    wrench = np.zeros(6, dtype)
    wrench[2] = np.inf
    o.wrench.dtype, o.wrench.data = dtype, wrench.tobytes()
    o.wrench.shape[:] = [6]
    assert _outcome(session, msg.SerializeToString()) == "non_finite"
