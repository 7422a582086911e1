"""Decoding camera messages into RGB arrays, whatever encoding ROS used.

What belongs here: ``sensor_msgs/Image`` (rgb8, bgr8, mono8, rgba8, bgra8, with the row
``step`` honoured, and 16-bit mono/rgb scaled to 8 bits) and ``sensor_msgs/CompressedImage``
(JPEG, PNG, anything Pillow opens) to [H, W, 3] uint8 RGB, and resizing to a model's size.
Bad input raises ``ImageDecodeError`` with a reason a report can count; nothing else.
"""

from __future__ import annotations

import io

import numpy as np
from PIL import Image, UnidentifiedImageError

RAW_CHANNELS = {
    "rgb8": 3,
    "bgr8": 3,
    "mono8": 1,
    "rgba8": 4,
    "bgra8": 4,
    "mono16": 1,
    "16UC1": 1,
    "8UC1": 1,
    "8UC3": 3,
}


class ImageDecodeError(ValueError):
    """A message that is not a decodable image; ``reason`` is a short key for counting."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


def decode_raw(
    *,
    height: int,
    width: int,
    encoding: str,
    step: int,
    data: bytes | np.ndarray,
    is_bigendian: int = 0,
) -> np.ndarray:
    """[H, W, 3] uint8 RGB from the fields of a ``sensor_msgs/Image``."""
    if encoding not in RAW_CHANNELS:
        raise ImageDecodeError(
            "unsupported_encoding", f"encoding {encoding!r} (known: {sorted(RAW_CHANNELS)})"
        )
    if height <= 0 or width <= 0:
        raise ImageDecodeError("bad_size", f"height {height} x width {width}")
    channels = RAW_CHANNELS[encoding]
    bytes_per_value = 2 if encoding in ("mono16", "16UC1") else 1
    row_bytes = width * channels * bytes_per_value
    if step < row_bytes:
        raise ImageDecodeError("bad_step", f"step {step} < width*channels*bytes {row_bytes}")
    buf = (
        np.frombuffer(data, np.uint8)
        if not isinstance(data, np.ndarray)
        else data.view(np.uint8).reshape(-1)
    )
    if buf.size < step * (height - 1) + row_bytes:
        raise ImageDecodeError(
            "bad_size",
            f"data has {buf.size} bytes, {height} rows of step {step} need {step * height}",
        )
    if buf.size >= step * height:
        rows = buf[: step * height].reshape(height, step)[:, :row_bytes]
    else:  # last row not padded to step: tolerated, as image_transport does
        padded = np.zeros(step * height, np.uint8)
        padded[: buf.size] = buf
        rows = padded.reshape(height, step)[:, :row_bytes]
    if bytes_per_value == 2:
        dtype = ">u2" if is_bigendian else "<u2"
        mono = np.ascontiguousarray(rows).view(dtype).reshape(height, width)
        gray = (mono.astype(np.uint32) >> 8).astype(np.uint8)
        return np.repeat(gray[..., None], 3, axis=-1)
    pix = rows.reshape(height, width, channels)
    if encoding in ("rgb8", "8UC3"):
        return np.ascontiguousarray(pix)
    if encoding == "bgr8":
        return np.ascontiguousarray(pix[..., ::-1])
    if encoding in ("mono8", "8UC1"):
        return np.repeat(pix, 3, axis=-1)
    if encoding == "rgba8":
        return np.ascontiguousarray(pix[..., :3])
    return np.ascontiguousarray(pix[..., 2::-1])  # bgra8


def decode_compressed(data: bytes | np.ndarray, fmt: str = "") -> np.ndarray:
    """[H, W, 3] uint8 RGB from a ``sensor_msgs/CompressedImage`` payload (format is a hint)."""

    raw = data.tobytes() if isinstance(data, np.ndarray) else bytes(data)
    if not raw:
        raise ImageDecodeError("empty_image", f"compressed image (format {fmt!r}) has no data")
    try:
        with Image.open(io.BytesIO(raw)) as img:
            return np.asarray(img.convert("RGB"), dtype=np.uint8).copy()
    except (UnidentifiedImageError, OSError, ValueError) as err:
        raise ImageDecodeError("corrupt_compressed", f"format {fmt!r}: {err}") from err


def resize_rgb(img: np.ndarray, height: int, width: int) -> np.ndarray:
    """Resize an [H, W, 3] uint8 image (area averaging when shrinking, bilinear otherwise)."""
    if img.shape[:2] == (height, width):
        return img

    shrink = img.shape[0] >= height and img.shape[1] >= width
    method = Image.Resampling.BOX if shrink else Image.Resampling.BILINEAR
    return np.asarray(Image.fromarray(img).resize((width, height), method), dtype=np.uint8)
