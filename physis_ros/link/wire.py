"""The wire format's Python face: link dataclasses and their conversion to/from protobuf.

Everything that turns an array into bytes or bytes into an array lives here, for both sides
(the robot's client and the server's front end). Tensors travel as raw little-endian bytes
with a dtype name and a shape; nothing is pickled. numpy + protobuf only.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from physis_ros.link.encoding import (
    WireError,
    array_to_tensor,
    parse_without_payload,
    serialize_with_payload,
    tensor_header,
    tensor_to_array,
)
from physis_ros.link.proto_gen import physis_pb2 as pb

PROTOCOL_VERSION = pb.PROTOCOL_VERSION_CURRENT
"""Carried by every message; a peer with another version is refused or its message dropped."""

RAW_ENCODINGS: dict[str, int] = {"rgb8": 3, "bgr8": 3, "mono8": 1, "rgba8": 4, "bgra8": 4}
"""ROS image encodings accepted raw, with their bytes per pixel."""
COMPRESSED_ENCODINGS = ("jpeg", "png")
MAX_IMAGE_PIXELS = 1 << 26
"""A raw image may declare at most this many pixels (8192 x 8192), checked before decoding."""
MAX_STAMP_NS = 4_102_444_800 * 10**9
"""Stamps (robot clock, ns) must lie in [0, 2100-01-01): a negative or later one is a client
bug (an unset or garbage clock), refused before it enters latency figures."""

STREAM_ID_METADATA_KEY = "x-physis-stream-id"
"""Call metadata naming the stream a Stream call belongs to."""
RESUME_TOKEN_METADATA_KEY = "x-physis-resume-token"
"""Call metadata of a Stream call that re-attaches to its stream: the stream's resume token."""
AUTH_METADATA_KEY = "authorization"


@dataclass(frozen=True, kw_only=True)
class CameraImage:
    """One camera frame as it came from the robot."""

    encoding: str
    """ROS encodings rgb8, bgr8, mono8, rgba8, bgra8; or "jpeg" / "png"."""
    height: int
    width: int
    step: int
    """Bytes per row (raw only; 0 for compressed)."""
    data: bytes | memoryview
    """The pixels (on the server: a read-only view of the received message)."""


@dataclass(frozen=True, kw_only=True)
class Observation:
    """What the robot saw and did at one instant."""

    seq: int
    """Strictly increasing per stream."""
    capture_stamp_ns: int
    """Robot clock (ROS time of the camera header), ns."""
    image: CameraImage | None = None
    wrench: np.ndarray | None = None
    """[6] float: force xyz, torque xyz."""
    joint_names: tuple[str, ...] = ()
    joint_positions: np.ndarray | None = None
    joint_velocities: np.ndarray | None = None
    action: np.ndarray | None = None
    """[A] or [H, A] commanded action, float32."""
    commands: np.ndarray | None = None
    """[N, A] float32 joint targets at commands_start_ns + i * commands_dt_ns (robot clock):
    what was commanded before the capture and what is committed after it."""
    commands_start_ns: int = 0
    commands_dt_ns: int = 0
    state: dict[str, float] = field(default_factory=dict)
    """The robot's state by the names the model's contract gives its inputs (a world-action
    model's: joint positions and velocities, wrench, tracked objects' coordinates)."""


@dataclass(frozen=True, kw_only=True)
class Prediction:
    """One generated chunk as the robot receives it."""

    stream_id: int
    chunk_index: int
    frames: np.ndarray | None
    """[F, H, W, 3] uint8."""
    actions: np.ndarray | None
    """[H, A] float32."""
    observation_seq: int
    """Seq of the newest observation of its anchor slot (-1: no anchor yet)."""
    observation_stamp_ns: int
    """Capture stamp of that observation, robot clock (0 if none)."""
    server_times_ns: dict[str, int]
    """received, queued, entered, left, decoded, sent (server wall clock; 0: not applicable)."""
    received_ns: int
    """Robot clock when the client got it."""
    hop_ms: dict[str, float]
    """Per-hop latencies; the cross-host ones (uplink, downlink) corrected by the clock offset."""
    server_drops: dict[str, int] = field(default_factory=dict)
    """Server-side drop counts of this stream so far, by reason."""
    action_start_ns: int = 0
    """Robot clock: the time row 0 of ``actions`` is for (0: not stated)."""
    action_dt_ns: int = 0
    """Robot clock ns between rows (with action_start_ns)."""
    known_action_rows: int = 0
    """Leading rows that are the robot's own committed ones."""
    anchor_slot: int = -1
    """The newest observed slot when it entered (-1: none): it reads the stream's
    observations up to that slot."""
    horizon: int = 0
    """chunk_index - anchor_slot: how many chunks ahead of its anchor it predicts."""
    first_frame_seq: int = -1
    """The observation seq its first predicted frame corresponds to (-1: unknown)."""
    preview_steps: int = 0
    """0: the chunk; k > 0: a preview of it, its x0 estimate after k of K denoising steps
    (``LinkClient(previews=True)``), sent before the chunk."""


HOP_NAMES = ("received", "queued", "entered", "left", "decoded", "sent")


def observation_to_proto(
    obs: Observation, *, send_stamp_ns: int, image_data: bool = True
) -> pb.ClientMessage:
    """Observation -> ClientMessage (send stamp: robot clock, taken just before sending).
    ``image_data=False`` leaves the image's pixels out (serialize_observation appends them)."""
    msg = pb.ClientMessage(protocol_version=PROTOCOL_VERSION)
    o = msg.observation
    o.protocol_version = PROTOCOL_VERSION
    o.seq = obs.seq
    o.capture_stamp_ns = obs.capture_stamp_ns
    o.send_stamp_ns = send_stamp_ns
    if obs.image is not None:
        img = obs.image
        o.image.encoding = img.encoding
        o.image.height = img.height
        o.image.width = img.width
        o.image.step = img.step
        if image_data:
            o.image.data = bytes(img.data)
    if obs.wrench is not None:
        array_to_tensor(obs.wrench, o.wrench)
    o.joint_names.extend(obs.joint_names)
    if obs.joint_positions is not None:
        array_to_tensor(obs.joint_positions, o.joint_positions)
    if obs.joint_velocities is not None:
        array_to_tensor(obs.joint_velocities, o.joint_velocities)
    if obs.action is not None:
        array_to_tensor(np.asarray(obs.action, dtype=np.float32), o.action)
    if obs.commands is not None:
        array_to_tensor(np.asarray(obs.commands, dtype=np.float32), o.commands)
        o.commands_start_ns = obs.commands_start_ns
        o.commands_dt_ns = obs.commands_dt_ns
    if obs.state:
        o.state.update(obs.state)
    return msg


IMAGE_DATA_PATH = ("observation", "image", "data")
IMAGE_DATA_NUMBERS = (
    pb.ClientMessage.DESCRIPTOR.fields_by_name["observation"].number,
    pb.Observation.DESCRIPTOR.fields_by_name["image"].number,
    pb.CameraImage.DESCRIPTOR.fields_by_name["data"].number,
)


def parse_client_message(raw: bytes) -> tuple[pb.ClientMessage, memoryview | None]:
    """A raw ClientMessage -> (the message, its image's pixels or None); parse_without_payload."""
    return parse_without_payload(raw, pb.ClientMessage, IMAGE_DATA_NUMBERS)


FRAMES_DATA_NUMBERS = (
    pb.ServerMessage.DESCRIPTOR.fields_by_name["prediction"].number,
    pb.Prediction.DESCRIPTOR.fields_by_name["frames"].number,
    pb.Tensor.DESCRIPTOR.fields_by_name["data"].number,
)


def parse_server_message(raw: bytes) -> tuple[pb.ServerMessage, memoryview | None]:
    """A raw ServerMessage -> (the message, its predicted frames' bytes or None);
    parse_without_payload."""
    return parse_without_payload(raw, pb.ServerMessage, FRAMES_DATA_NUMBERS)


def serialize_observation(obs: Observation, *, send_stamp_ns: int) -> bytes:
    """Observation -> serialised ClientMessage, the image's pixels copied once (see
    serialize_with_payload)."""
    msg = observation_to_proto(obs, send_stamp_ns=send_stamp_ns, image_data=False)
    if obs.image is None:
        return msg.SerializeToString()
    return serialize_with_payload(msg, IMAGE_DATA_PATH, obs.image.data)


def observation_from_proto(
    o: pb.Observation, *, image_data: memoryview | None = None
) -> Observation:
    """Observation message -> dataclass, its tensors decoded (``tensor_to_array``: dtype and
    size); what they hold is checked by the server (``serve/observations.py``).
    ``image_data``: the image's pixels when parse_client_message kept them out of ``o``."""
    if o.protocol_version != PROTOCOL_VERSION:
        raise WireError(
            "protocol_version",
            f"observation has version {o.protocol_version}, server speaks {PROTOCOL_VERSION}",
        )

    def opt(field_name: str) -> np.ndarray | None:
        if not o.HasField(field_name):
            return None
        return tensor_to_array(getattr(o, field_name), name=field_name)

    commands = opt("commands")
    image = None
    if o.HasField("image"):
        img = o.image
        image = CameraImage(
            encoding=img.encoding,
            height=img.height,
            width=img.width,
            step=img.step,
            data=img.data if image_data is None else image_data,
        )
    return Observation(
        seq=o.seq,
        capture_stamp_ns=o.capture_stamp_ns,
        image=image,
        wrench=opt("wrench"),
        joint_names=tuple(o.joint_names),
        joint_positions=opt("joint_positions"),
        joint_velocities=opt("joint_velocities"),
        action=opt("action"),
        commands=commands,
        commands_start_ns=o.commands_start_ns if commands is not None else 0,
        commands_dt_ns=o.commands_dt_ns if commands is not None else 0,
        state=dict(o.state),
    )


def rgb_image(frame: np.ndarray) -> CameraImage:
    """[H, W, 3] uint8 -> an rgb8 CameraImage (for tests, benchmarks and simulators)."""
    arr = np.ascontiguousarray(frame, dtype=np.uint8)
    if arr.ndim != 3 or arr.shape[2] != 3:
        raise ValueError(f"expected [H, W, 3] uint8, got shape {arr.shape}")
    h, w, _ = arr.shape
    return CameraImage(encoding="rgb8", height=h, width=w, step=w * 3, data=arr.tobytes())


# ---- counters, clock probes -----------------------------------------------------------------


@dataclass(frozen=True)
class StreamCounts:
    """A stream's counters as the server reports them (every prediction and stats message)."""

    observations_received: int = 0
    observations_used: int = 0
    predictions_sent: int = 0
    observed_chunks: int = 0
    filled_frames: int = 0
    incomplete_chunks: int = 0
    last_drop_detail: str = ""
    drops: dict[str, int] = field(default_factory=dict)


def counts_to_proto(counts: StreamCounts, out: pb.StreamCounters) -> pb.StreamCounters:
    out.observations_received = counts.observations_received
    out.observations_used = counts.observations_used
    out.predictions_sent = counts.predictions_sent
    out.observed_chunks = counts.observed_chunks
    out.filled_frames = counts.filled_frames
    out.incomplete_chunks = counts.incomplete_chunks
    out.last_drop_detail = counts.last_drop_detail
    if counts.drops:
        out.drops.update(counts.drops)
    return out


def serialize_stats(counts: StreamCounts) -> bytes:
    msg = pb.ServerMessage(protocol_version=PROTOCOL_VERSION)
    counts_to_proto(counts, msg.stats)
    return msg.SerializeToString()


def serialize_ping(client_send_ns: int) -> bytes:
    return pb.ClientMessage(
        protocol_version=PROTOCOL_VERSION, ping=pb.ClockPing(client_send_ns=client_send_ns)
    ).SerializeToString()


def serialize_pong(client_send_ns: int, server_receive_ns: int, server_send_ns: int) -> bytes:
    """The answer to a clock probe: its send stamp echoed, the server's receive and send
    stamps (server wall clock)."""
    pong = pb.ClockPong(
        client_send_ns=client_send_ns,
        server_receive_ns=server_receive_ns,
        server_send_ns=server_send_ns,
    )
    return pb.ServerMessage(protocol_version=PROTOCOL_VERSION, pong=pong).SerializeToString()


# ---- predictions --------------------------------------------------------------------------

FRAMES_DATA_PATH = ("prediction", "frames", "data")


def serialize_prediction(
    out: Any,
    *,
    stream_id: int,
    anchor: Any,
    action_timing: Any,
    first_frame_seq: int,
    counts: StreamCounts,
    sent_ns: int,
) -> bytes:
    """A finished chunk (the engine's ``ChunkOutput``) as a Prediction: ``anchor`` the stamps
    of the observation it is anchored on (seq, capture_stamp_ns, send_stamp_ns, received_ns,
    queued_ns; None: none), ``action_timing`` a world-action chunk's rows on the robot clock
    (start_ns, dt_ns, known_rows; None: not timed); its frames appended once (no copy into
    the message, ``payload.serialize_with_payload``)."""
    msg = pb.ServerMessage(protocol_version=PROTOCOL_VERSION)
    p = msg.prediction
    p.stream_id = stream_id
    p.chunk_index = out.chunk
    p.preview_steps = out.preview_steps
    frames = None if out.frames is None else tensor_header(out.frames, p.frames)
    if out.actions is not None:
        array_to_tensor(out.actions, p.actions)
    if action_timing is not None:  # row i is for action_start_ns + i * action_dt_ns
        p.action_start_ns = action_timing.start_ns
        p.action_dt_ns = action_timing.dt_ns
        p.known_action_rows = action_timing.known_rows
    p.observation_seq = -1
    p.anchor_slot = out.anchor
    p.horizon = out.horizon
    p.first_frame_seq = first_frame_seq
    t = p.server_times
    if anchor is not None:
        p.observation_seq = anchor.seq
        p.observation_stamp_ns = anchor.capture_stamp_ns
        p.observation_send_stamp_ns = anchor.send_stamp_ns
        t.received_ns = anchor.received_ns
        t.queued_ns = anchor.queued_ns
    # One wall-minus-monotonic offset for all three, so their order is kept exactly.
    wall_minus_mono_ns = time.time_ns() - time.monotonic_ns()
    t.entered_ns = wall_minus_mono_ns + int(out.entered_s * 1e9)
    t.left_ns = wall_minus_mono_ns + int(out.left_s * 1e9)
    t.decoded_ns = wall_minus_mono_ns + int(out.decoded_s * 1e9)
    t.sent_ns = sent_ns
    counts_to_proto(counts, p.counters)
    if frames is None:
        return msg.SerializeToString()
    return serialize_with_payload(msg, FRAMES_DATA_PATH, frames)


def prediction_from_proto(
    p: pb.Prediction,
    *,
    received_ns: int,
    offset_ns: int | None,
    drops: dict[str, int],
    frames_data: memoryview | None = None,
) -> Prediction:
    """A Prediction off the wire, with its per-hop latencies (the cross-host ones corrected
    by the clock offset, server minus robot, when known). Every reply runs this on a cold
    processor (the link idles between chunks): each field is read once."""
    st = p.server_times
    received, queued, entered = st.received_ns, st.queued_ns, st.entered_ns
    left, decoded, sent = st.left_ns, st.decoded_ns, st.sent_ns
    times = dict(zip(HOP_NAMES, (received, queued, entered, left, decoded, sent), strict=True))
    hop_ms: dict[str, float] = {}
    for name, start, end in (
        ("server_queue", received, queued),
        ("pipeline_wait", queued, entered),
        ("pipeline", entered, left),
        ("decode", left, decoded),
        ("server_send", decoded, sent),
    ):
        if start and end:
            hop_ms[name] = (end - start) / 1e6
    if offset_ns is not None:
        if p.observation_send_stamp_ns and received:
            hop_ms["uplink"] = (received - offset_ns - p.observation_send_stamp_ns) / 1e6
        if sent:
            hop_ms["downlink"] = (received_ns - sent + offset_ns) / 1e6
    seq = p.observation_seq
    if seq >= 0 and p.observation_stamp_ns:
        hop_ms["capture_to_received"] = (received_ns - p.observation_stamp_ns) / 1e6
    frames = None
    if p.HasField("frames"):
        frames = tensor_to_array(p.frames, name="frames", data=frames_data)
    return Prediction(
        stream_id=p.stream_id,
        chunk_index=p.chunk_index,
        frames=frames,
        actions=tensor_to_array(p.actions, name="actions") if p.HasField("actions") else None,
        observation_seq=seq,
        observation_stamp_ns=p.observation_stamp_ns,
        server_times_ns=times,
        received_ns=received_ns,
        hop_ms=hop_ms,
        server_drops=drops,
        action_start_ns=p.action_start_ns,
        action_dt_ns=p.action_dt_ns,
        known_action_rows=p.known_action_rows,
        anchor_slot=p.anchor_slot,
        horizon=p.horizon,
        first_frame_seq=p.first_frame_seq,
        preview_steps=p.preview_steps,
    )
