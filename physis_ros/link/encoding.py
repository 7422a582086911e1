"""How arrays and large payloads are encoded in the wire's protobuf messages.

Tensors travel as raw little-endian bytes with a dtype name and a shape (``pb.Tensor``),
checked against their declared size before anything is allocated; nothing is pickled. A
message with one large bytes field (camera pixels, predicted frames) keeps it out of the
message: serialised around it, parsed around it, the payload copied once. The wire format's
own messages use these through ``link/wire.py``.
"""

from __future__ import annotations

import math

import numpy as np

from physis_ros.link.proto_gen import physis_pb2 as pb


class WireError(ValueError):
    """A message that cannot be used. ``reason`` is the short key it is counted under."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


TENSOR_DTYPES = ("uint8", "int32", "int64", "float16", "float32", "float64")
"""dtypes a Tensor may carry (little-endian); anything else is refused."""
_LITTLE_ENDIAN = {name: np.dtype(name).newbyteorder("<") for name in TENSOR_DTYPES}
_NAME_OF = {np.dtype(name): name for name in TENSOR_DTYPES}
MAX_TENSOR_DIMS = 4
MAX_TENSOR_BYTES = 64 * 1024 * 1024
"""A tensor may declare at most this many bytes (shape x itemsize), checked before anything
is allocated for it; a message's real size is bounded by the gRPC limit anyway."""


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
