"""The wire format's Python face: link dataclasses and their conversion to/from protobuf.

Everything that turns an array into bytes or bytes into an array lives here, for both sides
(the robot's client and the server's front end). Tensors travel as raw little-endian bytes
with a dtype name and a shape; nothing is pickled. numpy + protobuf only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from physis_ros.link.proto_gen import physis_pb2 as pb

# Fields of the server's promise that cross the wire unchanged (engine StreamPromise ->
# pb.StreamPromise -> LinkPromise); one list so both directions stay in step.
PROMISE_FIELDS = (
    "stream_id",
    "model",
    "steps",
    "blocks",
    "expected_interval_ms",
    "pipeline_depth",
    "expected_response_latency_ms",
    "chunk_frames",
    "image_height",
    "image_width",
    "action_horizon",
    "action_dim",
    "target_interval_ms",
    "revision",
    "horizon",
    "action_mode",
    "rollouts",
)

PROTOCOL_VERSION = pb.PROTOCOL_VERSION_CURRENT
"""Carried by every message; a peer with another version is refused or its message dropped."""

RAW_ENCODINGS: dict[str, int] = {"rgb8": 3, "bgr8": 3, "mono8": 1, "rgba8": 4, "bgra8": 4}
"""ROS image encodings accepted raw, with their bytes per pixel."""
COMPRESSED_ENCODINGS = ("jpeg", "png")
TENSOR_DTYPES = ("uint8", "int32", "int64", "float16", "float32", "float64")
"""dtypes a Tensor may carry (little-endian); anything else is refused."""
_LITTLE_ENDIAN = {name: np.dtype(name).newbyteorder("<") for name in TENSOR_DTYPES}
_NAME_OF = {np.dtype(name): name for name in TENSOR_DTYPES}
MAX_TENSOR_DIMS = 4
MAX_TENSOR_BYTES = 64 * 1024 * 1024
"""A tensor may declare at most this many bytes (shape x itemsize), checked before anything
is allocated for it; a message's real size is bounded by the gRPC limit anyway."""
MAX_IMAGE_PIXELS = 1 << 26
"""A raw image may declare at most this many pixels (8192 x 8192), checked before decoding."""
MAX_STAMP_NS = 4_102_444_800 * 10**9
"""Stamps (robot clock, ns) must lie in [0, 2100-01-01): a negative or later one is a client
bug (an unset or garbage clock), refused before it enters latency figures."""

STREAM_ID_METADATA_KEY = "x-physis-stream-id"
"""Call metadata naming the stream a Stream call belongs to."""
AUTH_METADATA_KEY = "authorization"


class WireError(ValueError):
    """A message that cannot be used. ``reason`` is the short key it is counted under."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


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
    object_position: np.ndarray | None = None
    """[3] float32 xyz (table frame, m): a tracked object's position at the capture, from an
    object tracker on the robot (push-wam's box_x, box_y state columns)."""


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

_ONE_BYTE = [bytes([v]) for v in range(0x80)]
LARGE_PAYLOAD_BYTES = 64 * 1024
"""Bytes fields at least this large are appended to the serialized message by hand."""


def _varint(value: int) -> bytes:
    if value < 0x80:
        return _ONE_BYTE[value]
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def serialize_with_payload(msg, path: tuple[str, ...], payload=None) -> bytes:
    """``msg`` serialised with the bytes field at ``path`` set to ``payload``, fast when the
    payload is large.

    upb serialises a message holding a large nested bytes field slowly, and setting or
    reading such a field copies it into or out of the message's arena (measured here: ~0.4 ms
    to set 0.9 MB, plus page faults each time the arena grows). Instead the payload never
    enters the message: the rest is serialised, and the payload appended as its own
    length-delimited record nested in the same parents. Protobuf parsers merge repeated
    occurrences of an embedded message, so the bytes decode to the same message. The payload
    (any buffer: bytes, memoryview) is copied once, into the result.

    ``payload=None`` takes the field's current value from ``msg`` (and clears it there).
    """
    parents = [msg]
    for name in path[:-1]:
        parents.append(getattr(parents[-1], name))
    if payload is None:
        payload = getattr(parents[-1], path[-1])
        setattr(parents[-1], path[-1], b"")
    elif getattr(parents[-1], path[-1]):
        raise ValueError(f"{'.'.join(path)} is already set in the message")
    data = memoryview(payload).cast("B")
    if data.nbytes < LARGE_PAYLOAD_BYTES:
        setattr(parents[-1], path[-1], data.tobytes())
        return msg.SerializeToString()
    head = msg.SerializeToString()
    numbers = _field_numbers(msg, path)
    # Innermost first: each header is tag (wire type 2) + length of everything inside it.
    headers: list[bytes] = []
    length = data.nbytes
    for number in reversed(numbers):
        header = _varint(number << 3 | 2) + _varint(length)
        headers.append(header)
        length += len(header)
    return b"".join([head, *reversed(headers), data])


_NUMBERS: dict[tuple, tuple[int, ...]] = {}


def _field_numbers(msg, path: tuple[str, ...]) -> tuple[int, ...]:
    """Field numbers along ``path`` from ``msg``'s type (looked up once per type and path:
    every message that crosses pays for the descriptor walk otherwise)."""
    key = (msg.DESCRIPTOR.full_name, path)
    if key not in _NUMBERS:
        numbers, desc = [], msg.DESCRIPTOR
        for name in path:
            fd = desc.fields_by_name[name]
            numbers.append(fd.number)
            desc = fd.message_type
        _NUMBERS[key] = tuple(numbers)
    return _NUMBERS[key]


def tensor_header(array: np.ndarray, out: pb.Tensor) -> memoryview:
    """Sets ``out``'s dtype and shape for ``array`` and returns its little-endian C-order
    bytes as a buffer (no copy when the array already is), for ``serialize_with_payload``."""
    arr = np.asarray(array)
    name = _NAME_OF.get(arr.dtype) or arr.dtype.name  # (numpy's .name is slow Python)
    if name not in TENSOR_DTYPES:
        raise WireError("bad_tensor", f"dtype {name} is not one of {TENSOR_DTYPES}")
    arr = np.ascontiguousarray(arr, dtype=_LITTLE_ENDIAN[name])
    out.dtype = name
    out.shape[:] = arr.shape
    return memoryview(arr.reshape(-1).view(np.uint8))


def array_to_tensor(array: np.ndarray, out: pb.Tensor | None = None) -> pb.Tensor:
    """numpy array -> Tensor (C order, little-endian)."""
    msg = pb.Tensor() if out is None else out
    msg.data = tensor_header(array, msg).tobytes()
    return msg


def tensor_to_array(
    msg: pb.Tensor,
    *,
    name: str,
    data: memoryview | None = None,
    max_bytes: int = MAX_TENSOR_BYTES,
) -> np.ndarray:
    """Tensor -> numpy array (a read-only view of the message bytes); checks dtype and size.
    ``data``: the tensor's bytes when parse_without_payload kept them out of ``msg``.

    The declared size (shape x itemsize, in Python integers: a crafted shape cannot wrap
    around) is checked against ``max_bytes`` and against the bytes present before any array
    is made, so a shape that disagrees with its data is a counted ``bad_tensor``, never an
    exception from numpy."""
    # Every reply and observation runs this on a cold processor: no generator, one numpy call.
    dtype = _LITTLE_ENDIAN.get(msg.dtype)
    if dtype is None:
        raise WireError("bad_tensor", f"{name}: dtype {msg.dtype!r} is not one of {TENSOR_DTYPES}")
    shape = tuple(msg.shape)
    if len(shape) > MAX_TENSOR_DIMS or (shape and min(shape) < 0):
        raise WireError("bad_tensor", f"{name}: shape {shape} is not allowed")
    declared = math.prod(shape) * dtype.itemsize
    # An empty shape's non-zero dimensions bound too: numpy refuses [0, 2**31, 2**32].
    if declared > max_bytes or (
        not declared and math.prod(d for d in shape if d) * dtype.itemsize > max_bytes
    ):
        raise WireError(
            "bad_tensor",
            f"{name}: shape {shape} {msg.dtype} declares more than {max_bytes} bytes",
        )
    if data is None:
        data = msg.data  # upb copies the bytes out on every read: read once
    if len(data) != declared:
        raise WireError(
            "bad_tensor",
            f"{name}: {len(data)} bytes for shape {shape} {msg.dtype} (expected {declared})",
        )
    return np.ndarray(shape, dtype, data)


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
    if obs.object_position is not None:
        array_to_tensor(np.asarray(obs.object_position, dtype=np.float32), o.object_position)
    return msg


IMAGE_DATA_PATH = ("observation", "image", "data")
IMAGE_DATA_NUMBERS = (
    pb.ClientMessage.DESCRIPTOR.fields_by_name["observation"].number,
    pb.Observation.DESCRIPTOR.fields_by_name["image"].number,
    pb.CameraImage.DESCRIPTOR.fields_by_name["data"].number,
)


def _read_varint(buf: memoryview, pos: int, end: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= end or shift > 63:
            raise ValueError("truncated or overlong varint")
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
        shift += 7


MAX_WALKED_RECORDS = 512
"""parse_without_payload walks at most this many records (a real message has tens) before it
leaves the message to the C parser: a message of millions of tiny fields must not cost
seconds of Python."""


def _without_field(
    buf: memoryview,
    start: int,
    end: int,
    numbers: tuple[int, ...],
    *,
    found: list[tuple[int, int]],
    budget: list[int],
) -> list:
    """The message ``buf[start:end]`` as pieces, every length-delimited occurrence of the
    field at the nested path ``numbers`` left out (their spans appended to ``found``, in
    order) and the lengths of the enclosing records rewritten. Raises ValueError where the
    bytes are not a well-formed message or the walk is over its budget of records."""
    pieces: list = []
    pos = start
    while pos < end:
        budget[0] -= 1
        if budget[0] < 0:
            raise ValueError(f"more than {MAX_WALKED_RECORDS} records")
        record = pos
        key, pos = _read_varint(buf, pos, end)
        number, wire_type = key >> 3, key & 7
        if wire_type == 0:
            _, pos = _read_varint(buf, pos, end)
        elif wire_type == 1:
            pos += 8
        elif wire_type == 5:
            pos += 4
        elif wire_type == 2:
            length, body = _read_varint(buf, pos, end)
            pos = body + length
            if pos <= end and number == numbers[0]:
                if len(numbers) == 1:
                    found.append((body, pos))
                    continue
                inner = _without_field(buf, body, pos, numbers[1:], found=found, budget=budget)
                pieces.append(_varint(key) + _varint(sum(len(p) for p in inner)))
                pieces.extend(inner)
                continue
        else:
            raise ValueError(f"wire type {wire_type} at byte {record}")
        if pos > end:
            raise ValueError(f"record at byte {record} runs past its message")
        pieces.append(buf[record:pos])
    return pieces


def _appended_payload(raw: bytes, numbers: tuple[int, ...]) -> tuple[int, int] | None:
    """(where the last top-level record starts, where its payload starts) when ``raw`` ends
    with the payload as ``serialize_with_payload`` appends it: a last record nested along
    ``numbers`` holding nothing but the payload, to the message's end. None otherwise.
    Reads only the top-level records' keys and lengths: a few, whatever the payload."""
    end, pos, last, records = len(raw), 0, -1, 0
    while pos < end:
        records += 1
        if records > MAX_WALKED_RECORDS:
            return None
        last = pos
        key, pos = _read_varint(raw, pos, end)
        wire_type = key & 7
        if wire_type == 0:
            _, pos = _read_varint(raw, pos, end)
        elif wire_type == 2:
            length, pos = _read_varint(raw, pos, end)
            pos += length
        elif wire_type in (1, 5):
            pos += 8 if wire_type == 1 else 4
        else:
            return None
    if pos != end or last < 0:
        return None
    pos = last
    for number in numbers:
        key, pos = _read_varint(raw, pos, end)
        length, pos = _read_varint(raw, pos, end)
        if key != (number << 3 | 2) or pos + length != end:
            return None
    return last, pos


def parse_without_payload(raw: bytes, message_type, numbers: tuple[int, ...]):
    """A raw ``message_type`` -> (the message, the bytes field at the nested path ``numbers``
    as a read-only view of ``raw``), without copying a large payload: upb would copy it into
    the message (parse) and again out of it (read), ~0.15 ms per 0.9 MB measured here with
    cold caches. The message is parsed with the payload left out; the view is the last
    occurrence, as a protobuf parser would merge it. A message whose payload was appended by
    ``serialize_with_payload`` (as this package's peers send it) is split after reading its
    top-level records alone; any other is walked field by field. Small messages, or bytes
    the walk cannot follow, are parsed as they are (view None: read the field from the
    message); a malformed message raises DecodeError as ``FromString`` does."""
    if len(raw) < LARGE_PAYLOAD_BYTES:
        return message_type.FromString(raw), None
    try:  # this package's peers append the payload last: the head parses on its own
        appended = _appended_payload(raw, numbers)
    except ValueError:
        appended = None
    if appended is not None:
        head_end, start = appended
        return message_type.FromString(raw[:head_end]), memoryview(raw)[start:].toreadonly()
    buf = memoryview(raw).cast("B")
    found: list[tuple[int, int]] = []
    try:
        pieces = _without_field(buf, 0, len(buf), numbers, found=found, budget=[MAX_WALKED_RECORDS])
    except ValueError:
        return message_type.FromString(raw), None  # let the parser say what is wrong
    if not found:
        return message_type.FromString(raw), None
    start, end = found[-1]
    return message_type.FromString(b"".join(pieces)), buf[start:end].toreadonly()


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
    """Observation message -> dataclass; checks tensors and finiteness, not the image content.
    ``image_data``: the image's pixels when parse_client_message kept them out of ``o``."""
    if o.protocol_version != PROTOCOL_VERSION:
        raise WireError(
            "protocol_version",
            f"observation has version {o.protocol_version}, server speaks {PROTOCOL_VERSION}",
        )

    def opt(field_name: str, float_only: bool = True) -> np.ndarray | None:
        if not o.HasField(field_name):
            return None
        arr = tensor_to_array(getattr(o, field_name), name=field_name)
        if float_only and arr.dtype.kind != "f":
            raise WireError("bad_tensor", f"{field_name}: dtype {arr.dtype.name} is not float")
        if arr.dtype.kind == "f" and not np.isfinite(arr).all():
            raise WireError("non_finite", f"{field_name} holds NaN or inf")
        return arr

    wrench = opt("wrench")
    if wrench is not None and wrench.shape != (6,):
        raise WireError("bad_tensor", f"wrench has shape {wrench.shape}, expected (6,)")
    positions = opt("joint_positions")
    velocities = opt("joint_velocities")
    names = tuple(o.joint_names)
    for label, arr in (("joint_positions", positions), ("joint_velocities", velocities)):
        if arr is not None and (arr.ndim != 1 or (names and arr.shape[0] != len(names))):
            raise WireError(
                "bad_tensor", f"{label} has shape {arr.shape} for {len(names)} joint names"
            )
    action = opt("action")
    if action is not None and action.ndim not in (1, 2):
        raise WireError("bad_tensor", f"action has shape {action.shape}, expected [A] or [H, A]")
    commands = opt("commands")
    if commands is not None and (commands.ndim != 2 or o.commands_dt_ns <= 0):
        raise WireError(
            "bad_tensor",
            f"commands have shape {commands.shape} and dt {o.commands_dt_ns} ns, expected "
            "[N, A] and dt > 0",
        )
    object_position = opt("object_position")
    if object_position is not None and object_position.shape != (3,):
        raise WireError(
            "bad_tensor", f"object_position has shape {object_position.shape}, expected (3,)"
        )
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
        wrench=wrench,
        joint_names=names,
        joint_positions=positions,
        joint_velocities=velocities,
        action=action,
        commands=commands,
        commands_start_ns=o.commands_start_ns if commands is not None else 0,
        commands_dt_ns=o.commands_dt_ns if commands is not None else 0,
        object_position=object_position,
    )


def raw_image_to_rgb(img: CameraImage) -> np.ndarray:
    """A raw ROS image -> [H, W, 3] uint8 RGB (copy), honouring the row step."""
    channels = RAW_ENCODINGS.get(img.encoding)
    if channels is None:
        raise WireError(
            "image_encoding",
            f"encoding {img.encoding!r} is not one of {sorted(RAW_ENCODINGS)} "
            f"or {COMPRESSED_ENCODINGS}",
        )
    row_bytes = img.width * channels
    if img.height <= 0 or img.width <= 0:
        raise WireError("image_layout", f"image size {img.height}x{img.width}")
    if img.height * img.width > MAX_IMAGE_PIXELS:
        raise WireError(
            "image_size", f"image size {img.height}x{img.width} is over {MAX_IMAGE_PIXELS} pixels"
        )
    if img.step < row_bytes:
        raise WireError("image_layout", f"step {img.step} < width*channels {row_bytes}")
    if len(img.data) != img.step * img.height:
        raise WireError(
            "image_layout", f"{len(img.data)} bytes for step {img.step} x height {img.height}"
        )
    rows = np.frombuffer(img.data, dtype=np.uint8).reshape(img.height, img.step)
    pixels = rows[:, :row_bytes].reshape(img.height, img.width, channels)
    if img.encoding in ("rgb8", "rgba8"):
        return np.ascontiguousarray(pixels[:, :, :3])
    if img.encoding in ("bgr8", "bgra8"):
        return np.ascontiguousarray(pixels[:, :, 2::-1])
    return np.repeat(pixels, 3, axis=2)  # mono8


def rgb_image(frame: np.ndarray) -> CameraImage:
    """[H, W, 3] uint8 -> an rgb8 CameraImage (for tests, benchmarks and simulators)."""
    arr = np.ascontiguousarray(frame, dtype=np.uint8)
    if arr.ndim != 3 or arr.shape[2] != 3:
        raise ValueError(f"expected [H, W, 3] uint8, got shape {arr.shape}")
    h, w, _ = arr.shape
    return CameraImage(encoding="rgb8", height=h, width=w, step=w * 3, data=arr.tobytes())
