"""Reading a safetensors file's header without torch (the robot side reads model contracts
too): tensor names, dtypes and shapes, and the ``__metadata__`` a trainer wrote."""

from __future__ import annotations

import json
import struct
from pathlib import Path

MAX_HEADER_BYTES = 16 * 1024 * 1024
MODEL_CONFIG_KEY = "model_config"
"""Metadata key of weights that carry their architecture (the engine's ``ModelConfig`` as
JSON) instead of naming a preset in ``model``: a robot no preset describes."""


def read_header(path: str | Path) -> dict:
    """The JSON header of a safetensors file: tensor name -> {dtype, shape, data_offsets},
    plus ``__metadata__`` when present."""
    path = Path(path)
    with path.open("rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise ValueError(f"{path} is not a safetensors file (shorter than 8 bytes)")
        (size,) = struct.unpack("<Q", head)
        if size > MAX_HEADER_BYTES:
            raise ValueError(f"{path}: safetensors header of {size} bytes is implausible")
        try:
            header = json.loads(f.read(size))
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise ValueError(f"{path}: safetensors header is not JSON: {err}") from err
    if not isinstance(header, dict):
        raise ValueError(f"{path}: safetensors header is not a mapping")
    return header


def read_metadata(path: str | Path) -> dict[str, str]:
    """The ``__metadata__`` of a safetensors file (empty if it has none)."""
    meta = read_header(path).get("__metadata__") or {}
    return {str(k): str(v) for k, v in meta.items()}


def read_shapes(path: str | Path) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape of a safetensors file, from its header (no tensor is read)."""
    header = read_header(path)
    try:
        return {
            str(k): tuple(int(d) for d in v["shape"])
            for k, v in header.items()
            if k != "__metadata__"
        }
    except (KeyError, TypeError, ValueError) as err:
        raise ValueError(f"{path}: safetensors header has a bad tensor entry: {err!r}") from None


def write_metadata(path: str | Path, meta: dict[str, str]) -> None:
    """Replace the ``__metadata__`` of a safetensors file, its tensors' bytes unchanged (the
    header is rewritten; the file is replaced atomically)."""
    path = Path(path)
    header = read_header(path)
    with path.open("rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        f.seek(8 + size)
        data = f.read()
    header["__metadata__"] = {str(k): str(v) for k, v in meta.items()}
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data stays 8-byte aligned, as the format advises
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(struct.pack("<Q", len(text)) + text + data)
    tmp.replace(path)
