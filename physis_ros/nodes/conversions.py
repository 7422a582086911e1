"""Conversions between ROS message fields and plain arrays, with validation.

Camera messages become the link's ``CameraImage`` fields (raw rows packed, ``step``
honoured; compressed images checked and measured from their headers), predicted frames
become ``sensor_msgs/Image`` fields, and a side-by-side view is composed for rviz.
Anything malformed raises ``ConversionError`` with a short ``reason`` that the node counts.
Duck-typed on message attributes: no rclpy import, so this is testable without ROS.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np

RAW_CHANNELS = {"rgb8": 3, "bgr8": 3, "mono8": 1, "rgba8": 4, "bgra8": 4}
_PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
# JPEG start-of-frame markers carry the image size (C4 DHT, C8 JPG, CC DAC are not SOFs).
_JPEG_SOF = {0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF}


class ConversionError(ValueError):
    """A message that cannot become an observation; ``reason`` names the drop counter."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


@dataclass(frozen=True, kw_only=True)
class ImageFields:
    """Fields of the link's ``CameraImage`` (kept separate so this module needs no link)."""

    encoding: str
    height: int
    width: int
    step: int
    data: bytes


def image_msg_to_fields(msg) -> ImageFields:
    """``sensor_msgs/Image`` -> packed raw image; rows are copied without their padding."""
    encoding = msg.encoding.lower()
    channels = RAW_CHANNELS.get(encoding)
    if channels is None:
        raise ConversionError(
            "bad_encoding", f"encoding {msg.encoding!r} not in {sorted(RAW_CHANNELS)}"
        )
    height, width, step = int(msg.height), int(msg.width), int(msg.step)
    if height <= 0 or width <= 0:
        raise ConversionError("bad_size", f"image size {width}x{height}")
    row_bytes = width * channels
    if step < row_bytes:
        raise ConversionError("bad_step", f"step {step} < width {width} x {channels} channels")
    data = msg.data
    if len(data) != step * height:
        raise ConversionError(
            "bad_size", f"data has {len(data)} bytes, step x height = {step * height}"
        )
    raw = data.tobytes() if hasattr(data, "tobytes") else bytes(data)
    if step != row_bytes:
        # Padded rows (e.g. aligned strides): keep only the pixels of each row.
        raw = np.frombuffer(raw, np.uint8).reshape(height, step)[:, :row_bytes].tobytes()
    return ImageFields(encoding=encoding, height=height, width=width, step=row_bytes, data=raw)


def compressed_size(data: bytes, kind: str) -> tuple[int, int]:
    """(height, width) read from a PNG or JPEG header; raises ConversionError if corrupt."""
    if kind == "png":
        if len(data) < 24 or not data.startswith(_PNG_MAGIC) or data[12:16] != b"IHDR":
            raise ConversionError("bad_compressed", "not a PNG stream")
        width, height = struct.unpack(">II", data[16:24])
        return height, width
    if len(data) < 4 or data[:2] != b"\xff\xd8":
        raise ConversionError("bad_compressed", "not a JPEG stream")
    pos = 2
    while pos + 9 <= len(data):
        if data[pos] != 0xFF:
            raise ConversionError("bad_compressed", f"JPEG marker expected at byte {pos}")
        marker = data[pos + 1]
        if marker == 0xFF:  # fill byte
            pos += 1
            continue
        (length,) = struct.unpack(">H", data[pos + 2 : pos + 4])
        if marker in _JPEG_SOF:
            height, width = struct.unpack(">HH", data[pos + 5 : pos + 9])
            return height, width
        pos += 2 + length
    raise ConversionError("bad_compressed", "JPEG without a start-of-frame header")


def compressed_msg_to_fields(msg) -> ImageFields:
    """``sensor_msgs/CompressedImage`` (jpeg or png, as image_transport writes ``format``)."""
    fmt = msg.format.lower()
    if "png" in fmt:
        kind = "png"
    elif "jpeg" in fmt or "jpg" in fmt:
        kind = "jpeg"
    else:
        raise ConversionError(
            "bad_encoding", f"compressed format {msg.format!r} is not jpeg or png"
        )
    data = msg.data
    raw = data.tobytes() if hasattr(data, "tobytes") else bytes(data)
    height, width = compressed_size(raw, kind)
    if height <= 0 or width <= 0:
        raise ConversionError("bad_size", f"compressed image size {width}x{height}")
    return ImageFields(encoding=kind, height=height, width=width, step=0, data=raw)


def fields_to_rgb(fields) -> np.ndarray | None:
    """A raw image as [H, W, 3] uint8 rgb for viewing; None for compressed images."""
    channels = RAW_CHANNELS.get(fields.encoding)
    if channels is None:
        return None
    pixels = np.frombuffer(fields.data, np.uint8).reshape(fields.height, fields.width, channels)
    if fields.encoding == "mono8":
        return np.repeat(pixels, 3, axis=2)
    if fields.encoding.startswith("bgr"):
        return np.ascontiguousarray(pixels[:, :, 2::-1])
    return np.ascontiguousarray(pixels[:, :, :3])


def validate_vector(values, *, size: int | None, reason: str) -> np.ndarray:
    """Finite float64 vector of the given size, else ConversionError(reason)."""
    array = np.asarray(values, dtype=np.float64)
    if size is not None and array.shape != (size,):
        raise ConversionError(reason, f"expected {size} values, got shape {array.shape}")
    if not np.all(np.isfinite(array)):
        raise ConversionError(reason, f"non-finite values {array.tolist()}")
    return array


def command_positions(joint_names, positions_of_points: list, order: tuple[str, ...]) -> np.ndarray:
    """The commanded joint positions of a JointTrajectory's first point, as float32 in
    ``order`` (joint names); else ConversionError with reason ``command:<why>``.

    A command message has one point (what ``sim_robot`` and the recorded bags send); with
    more, the first is the target in force at the header stamp, the rest are ignored.
    """
    names = list(joint_names)
    if not positions_of_points:
        raise ConversionError("command:no_points", f"command for joints {names} has no points")
    positions = np.asarray(positions_of_points[0], dtype=np.float64)
    if positions.shape != (len(names),):
        raise ConversionError(
            "command:bad_positions",
            f"point 0 has {positions.size} positions for {len(names)} joints {names}",
        )
    missing = [name for name in order if name not in names]
    if missing:
        raise ConversionError(
            "command:missing_joint",
            f"command for joints {names} lacks {missing}; the actions need {list(order)}",
        )
    picked = positions[[names.index(name) for name in order]]
    if not np.all(np.isfinite(picked)):
        raise ConversionError("command:non_finite", f"non-finite positions {picked.tolist()}")
    return picked.astype(np.float32)


def resize_nearest(image: np.ndarray, height: int, width: int) -> np.ndarray:
    """Nearest-neighbour resize of [H, W, C] (keeps predicted pixels visibly blocky);
    whole-number upscales are plain repeats, the common and cheap case."""
    in_h, in_w = image.shape[:2]
    if (in_h, in_w) == (height, width):
        return image
    if height % in_h == 0 and width % in_w == 0:
        return np.repeat(np.repeat(image, height // in_h, axis=0), width // in_w, axis=1)
    rows = (np.arange(height) * in_h // height).clip(0, in_h - 1)
    cols = (np.arange(width) * in_w // width).clip(0, in_w - 1)
    return np.take(np.take(image, rows, axis=0), cols, axis=1)


def side_by_side(observed: np.ndarray | None, predicted: np.ndarray, height: int = 0) -> np.ndarray:
    """observed | predicted, both scaled to ``height`` rows (0: the observed image's height,
    at most 240, so a small camera image is not scaled at all), with a 2-pixel white divider
    between them. Without an observed image, its half is black."""
    if height <= 0:
        height = min(observed.shape[0], 240) if observed is not None else predicted.shape[0]

    def width_at(image: np.ndarray) -> int:
        return max(1, round(image.shape[1] * height / image.shape[0]))

    right_w = width_at(predicted)
    left_w = width_at(observed) if observed is not None else right_w
    view = np.zeros((height, left_w + 2 + right_w, 3), np.uint8)
    if observed is not None:
        view[:, :left_w] = resize_nearest(observed, height, left_w)
    view[:, left_w : left_w + 2] = 255
    view[:, left_w + 2 :] = resize_nearest(predicted, height, right_w)
    return view


def fill_image_msg(msg, rgb: np.ndarray, *, stamp, frame_id: str) -> None:
    """Fill a ``sensor_msgs/Image`` with an [H, W, 3] uint8 rgb8 array."""
    if rgb.dtype != np.uint8 or rgb.ndim != 3 or rgb.shape[2] != 3:
        raise ValueError(f"expected [H, W, 3] uint8, got {rgb.dtype} {rgb.shape}")
    msg.header.stamp = stamp
    msg.header.frame_id = frame_id
    msg.height, msg.width = int(rgb.shape[0]), int(rgb.shape[1])
    msg.encoding = "rgb8"
    msg.is_bigendian = 0
    msg.step = int(rgb.shape[1]) * 3
    msg.data = np.ascontiguousarray(rgb).tobytes()


def planar_fk(joint_angles: np.ndarray, link_lengths_m, base_xy_m=(0.0, 0.0)) -> np.ndarray:
    """End-effector [..., 2] xy of a planar serial arm: angles are relative, per link."""
    angles = np.cumsum(np.asarray(joint_angles, dtype=np.float64), axis=-1)
    lengths = np.asarray(link_lengths_m, dtype=np.float64)
    x = base_xy_m[0] + np.sum(lengths * np.cos(angles), axis=-1)
    y = base_xy_m[1] + np.sum(lengths * np.sin(angles), axis=-1)
    return np.stack([x, y], axis=-1)


def resize_area_sampled(image: np.ndarray, height: int, width: int, taps: int = 4) -> np.ndarray:
    """Downscale [H, W, C] uint8 by averaging ``taps`` x ``taps`` samples spread over each
    output pixel's footprint: close to an area filter at a small fraction of its cost
    (a 640x480 frame costs well under a millisecond, so it can run in a callback)."""
    in_h, in_w = image.shape[:2]
    if (in_h, in_w) == (height, width):
        return image
    rows = ((np.arange(height * taps) + 0.5) * in_h / (height * taps)).astype(np.intp)
    cols = ((np.arange(width * taps) + 0.5) * in_w / (width * taps)).astype(np.intp)
    grid = image[rows][:, cols].astype(np.uint16)
    channels = image.shape[2]
    summed = grid.reshape(height, taps, width, taps, channels).sum(axis=(1, 3))
    return ((summed + taps * taps // 2) // (taps * taps)).astype(np.uint8)


def resize_fields(fields: ImageFields, height: int, width: int) -> ImageFields:
    """A raw image resized to (height, width) in its own encoding; compressed ones as is."""
    channels = RAW_CHANNELS.get(fields.encoding)
    if channels is None or (fields.height, fields.width) == (height, width):
        return fields
    pixels = np.frombuffer(fields.data, np.uint8).reshape(fields.height, fields.width, channels)
    small = resize_area_sampled(pixels, height, width)
    return ImageFields(
        encoding=fields.encoding,
        height=height,
        width=width,
        step=width * channels,
        data=small.tobytes(),
    )
