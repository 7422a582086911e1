"""How the ranks frame their messages: the header layout, the shapes every rank agrees on,
and the start-up check that every rank runs the same framing code.

A message is a header int64[18] (see ``_H_*``) followed, for data, by x (float32 [X]) and,
if ``has_h``, h ([N, D], model dtype); for control, by a UTF-8 JSON payload. The x / h
shapes follow from the model config; every rank computes them and they are checked once at
start-up (``check_shapes_agree``: one all-gather of an int64 tensor, no pickle), together
with the wire protocol version and a checksum of the wire code's source: ranks started from
different code (an older install on another machine, or worker ranks spawned after the code
changed under a long-running rank 0) would frame messages differently, and gloo would then
fail mid-run with "Received data size doesn't match expected size". The header still carries
version and shapes so a mismatch is a clear error, never a silent misread.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from physis_ros.engine.transport import Activation

PROTOCOL_VERSION = 4
"""4: header slots 16-17 carry the release ticket and the anchor slot (live timeline);
3: header slot 15 carries the placement epoch; 2: gloo carries header ++ payload as one
message (1: header and payload apart)."""
TAG_HEADER = 0
TAG_PAYLOAD = 1
HEADER_LEN = 18

KIND_DATA = 1
KIND_CONTROL = 2
KIND_HEARTBEAT = 3

# header slots
_H_VERSION, _H_KIND, _H_STREAM, _H_CHUNK, _H_STEP, _H_BLOCK, _H_FLAGS, _H_HAS_H = range(8)
_H_X_NUMEL, _H_H_ROWS, _H_H_COLS, _H_PAYLOAD_BYTES, _H_CREATED, _H_SEQ, _H_DTYPE = range(8, 15)
_H_EPOCH, _H_TICKET, _H_ANCHOR = 15, 16, 17

_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def _float_bits(value: float) -> int:
    return struct.unpack("<q", struct.pack("<d", value))[0]


def _bits_float(bits: int) -> float:
    return struct.unpack("<d", struct.pack("<q", bits))[0]


@dataclass(frozen=True, kw_only=True)
class ActivationShapes:
    """The tensors one activation carries, the same for every stream of a model."""

    x_numel: int
    """X: values of a chunk's flattened state x (float32)."""
    h_tokens: int
    """N: tokens of the hidden state h."""
    h_dim: int
    """D: hidden size."""
    h_dtype: torch.dtype = torch.float32
    """dtype of h (bf16 on CUDA runs)."""
    steps: int
    """K: an activation with ``step == K`` goes to the sink (rank 0's controller)."""

    def __post_init__(self) -> None:
        for name in ("x_numel", "h_tokens", "h_dim", "steps"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.h_dtype not in _DTYPE_CODES:
            raise ValueError(f"h_dtype {self.h_dtype} is not one of {list(_DTYPE_CODES)}")

    @property
    def largest_message_bytes(self) -> int:
        """A data message with both payloads: header, x (float32 on the wire) and h. Control
        messages must fit in it too."""
        h_bytes = self.h_tokens * self.h_dim * self.h_dtype.itemsize
        return HEADER_LEN * 8 + self.x_numel * torch.float32.itemsize + h_bytes

    def as_tensor(self) -> torch.Tensor:
        code = _DTYPE_CODES[self.h_dtype]
        return torch.tensor([self.x_numel, self.h_tokens, self.h_dim, code, self.steps])


@dataclass(frozen=True)
class ControlMessage:
    """A control message between the controller (rank 0) and a worker rank."""

    src: int
    kind: str
    body: dict


def encode_header(
    kind: int, seq: int, shapes: ActivationShapes, msg: Activation | None, payload_bytes: int
) -> list[int]:
    """The header of one message (``msg`` for data, None for control and heartbeats)."""
    values = [0] * HEADER_LEN
    values[_H_VERSION] = PROTOCOL_VERSION
    values[_H_KIND] = kind
    values[_H_PAYLOAD_BYTES] = payload_bytes
    values[_H_SEQ] = seq
    if msg is not None:
        values[_H_STREAM] = msg.stream_id
        values[_H_CHUNK] = msg.chunk
        values[_H_STEP] = msg.step
        values[_H_BLOCK] = msg.block
        values[_H_FLAGS] = msg.flags
        values[_H_HAS_H] = int(msg.h is not None)
        values[_H_X_NUMEL] = shapes.x_numel
        values[_H_H_ROWS] = shapes.h_tokens
        values[_H_H_COLS] = shapes.h_dim
        values[_H_CREATED] = _float_bits(msg.created_s)
        values[_H_DTYPE] = _DTYPE_CODES[shapes.h_dtype]
        values[_H_EPOCH] = msg.epoch
        values[_H_TICKET] = msg.ticket
        values[_H_ANCHOR] = msg.anchor
    return values


def header_kind(src: int, h: list[int]) -> int:
    """The message kind of a received header; a header of another protocol cannot be read
    (the payload layout is unknown and the pair cannot be resynchronised)."""
    if h[_H_VERSION] != PROTOCOL_VERSION:
        raise RuntimeError(f"rank {src} speaks protocol {h[_H_VERSION]}, not {PROTOCOL_VERSION}")
    if h[_H_KIND] not in (KIND_DATA, KIND_CONTROL, KIND_HEARTBEAT):
        raise RuntimeError(f"rank {src} sent unknown message kind {h[_H_KIND]}")
    return h[_H_KIND]


def payload_size(h: list[int]) -> int:
    return h[_H_PAYLOAD_BYTES]


def carries_h(h: list[int]) -> bool:
    return bool(h[_H_HAS_H])


def check_data_header(src: int, h: list[int], shapes: ActivationShapes) -> None:
    agreed = (shapes.x_numel, shapes.h_tokens, shapes.h_dim, _DTYPE_CODES[shapes.h_dtype])
    got = (h[_H_X_NUMEL], h[_H_H_ROWS], h[_H_H_COLS], h[_H_DTYPE])
    if got != agreed:
        raise RuntimeError(f"rank {src} sent shapes {got}, agreed {agreed}")


def activation_of(h: list[int], x: torch.Tensor, hidden: torch.Tensor | None) -> Activation:
    """The activation a data header and its received tensors describe."""
    return Activation(
        stream_id=h[_H_STREAM],
        chunk=h[_H_CHUNK],
        step=h[_H_STEP],
        block=h[_H_BLOCK],
        flags=h[_H_FLAGS],
        x=x,
        h=hidden,
        created_s=_bits_float(h[_H_CREATED]),
        epoch=h[_H_EPOCH],
        ticket=h[_H_TICKET],
        anchor=h[_H_ANCHOR],
    )


def _source_crc32() -> int:
    """CRC-32 of the wire code (this module and the transport) as this process imported it
    (0 if unreadable)."""
    crc = 0
    for name in ("framing.py", "transport.py"):
        try:
            crc = zlib.crc32((Path(__file__).parent / name).read_bytes(), crc)
        except OSError:
            return 0
    return crc


SOURCE_CRC32 = _source_crc32()
"""Read once at import: a rank 0 that imported an older file keeps the older checksum."""


def check_shapes_agree(shapes: ActivationShapes, device: torch.device) -> None:
    """All ranks must run the same wire code and agree on the activation shapes; one
    all-gather at start-up, before any point-to-point message.

    The gathered tensor keeps the five values of ranks from before this check (x_numel, N, D,
    dtype code, K) and carries protocol version and source checksum in the upper bits of the
    dtype code: a gather of a different size would abort gloo itself (C++ terminate), while
    this way an older rank sees "different activation shapes" and this one names the cause.
    """
    mine = shapes.as_tensor()
    mine[3] += (PROTOCOL_VERSION << 8) + (SOURCE_CRC32 << 16)
    mine = mine.to(device)
    gathered = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, mine)
    me = dist.get_rank()
    for rank, theirs in enumerate(gathered):
        values = theirs.tolist()
        version, crc = (values[3] >> 8) & 0xFF, values[3] >> 16
        if version != PROTOCOL_VERSION or crc != SOURCE_CRC32:
            what = f"wire protocol {version}" if version else "a version before wire protocol 2"
            raise RuntimeError(
                f"rank {rank} runs {what} (engine/ranks wire code crc32 {crc:#010x}), "
                f"rank {me} runs {PROTOCOL_VERSION} (crc32 {SOURCE_CRC32:#010x}): every rank "
                "must run the same physis_ros code (reinstall, or restart rank 0 after an update)"
            )
        values[3] &= 0xFF
        if values != shapes.as_tensor().tolist():
            raise RuntimeError(
                f"rank {rank} has activation shapes {values}, rank {me} has "
                f"{shapes.as_tensor().tolist()} (x_numel, N, D, dtype, K)"
            )


class BufferReader:
    """Copies consecutive tensors out of one received gloo message (after its header)."""

    def __init__(self, buffer: torch.Tensor, start: int) -> None:
        self.buffer = buffer
        self.offset = start

    def __call__(self, tensor: torch.Tensor, _src: int) -> None:
        n = tensor.numel() * tensor.element_size()
        if self.offset + n > self.buffer.numel():
            raise RuntimeError(f"message shorter than its header says ({self.offset + n} bytes)")
        tensor.reshape(-1).view(torch.uint8).copy_(self.buffer[self.offset : self.offset + n])
        self.offset += n
