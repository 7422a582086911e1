"""Server side checks of an incoming observation, and its conversion to engine input.

Each check that fails raises ``WireError`` with the reason the observation is counted under
(``image_size``, ``image_encoding``, ``image_decode``, ``non_finite``, ``bad_seq``, ...), so
the session can drop it, count it and tell the client. JPEG / PNG are decoded with Pillow
here, and only after the image header's size is checked: no pixel is decompressed for an
image that is not the model's size.
"""

from __future__ import annotations

import io
import math
import time
import warnings

import numpy as np
from PIL import Image

from physis_ros.contract.model import WamContract
from physis_ros.engine.slots import FrameIn
from physis_ros.engine.wam_rows import CommandTimeline
from physis_ros.link.proto_gen import physis_pb2 as pb
from physis_ros.link.wire import (
    COMPRESSED_ENCODINGS,
    MAX_IMAGE_PIXELS,
    MAX_STAMP_NS,
    RAW_ENCODINGS,
    CameraImage,
    Observation,
    WireError,
)


def check_header(o: pb.Observation) -> None:
    """The observation's sequence number and stamps are usable: seq >= 0 (the proto's
    "strictly increasing" starts somewhere; a negative one is a client bug) and both stamps
    in [0, MAX_STAMP_NS). Checked before the seq order, so a garbage seq cannot block the
    stream's later observations as "out of order"."""
    if o.seq < 0:
        raise WireError("bad_seq", f"seq {o.seq} is negative")
    for name in ("capture_stamp_ns", "send_stamp_ns"):
        stamp = getattr(o, name)
        if not 0 <= stamp < MAX_STAMP_NS:
            raise WireError("bad_stamp", f"observation {o.seq}: {name} {stamp} is out of range")


def check_observation(obs: Observation) -> None:
    """What an observation's tensors hold: float, finite, shaped as the proto says (the
    image and the stream's own sizes are checked by ``context_input`` and ``wam_inputs``)."""
    for name in ("wrench", "joint_positions", "joint_velocities", "action", "commands"):
        _check_float(name, getattr(obs, name))
    bad = sorted(k for k, v in obs.state.items() if not math.isfinite(v))
    if bad:
        raise WireError("non_finite", f"state values {bad} hold NaN or inf")
    if obs.wrench is not None and obs.wrench.shape != (6,):
        raise WireError("bad_tensor", f"wrench has shape {obs.wrench.shape}, expected (6,)")
    names = obs.joint_names
    for label in ("joint_positions", "joint_velocities"):
        arr = getattr(obs, label)
        if arr is not None and (arr.ndim != 1 or (names and arr.shape[0] != len(names))):
            raise WireError(
                "bad_tensor", f"{label} has shape {arr.shape} for {len(names)} joint names"
            )
    if obs.action is not None and obs.action.ndim not in (1, 2):
        raise WireError(
            "bad_tensor", f"action has shape {obs.action.shape}, expected [A] or [H, A]"
        )
    if obs.commands is not None and (obs.commands.ndim != 2 or obs.commands_dt_ns <= 0):
        raise WireError(
            "bad_tensor",
            f"commands have shape {obs.commands.shape} and dt {obs.commands_dt_ns} ns, "
            "expected [N, A] and dt > 0",
        )


def _check_float(name: str, arr: np.ndarray | None) -> None:
    if arr is None:
        return
    if arr.dtype.kind != "f":
        raise WireError("bad_tensor", f"{name}: dtype {arr.dtype.name} is not float")
    if not np.isfinite(arr).all():
        raise WireError("non_finite", f"{name} holds NaN or inf")


def decode_image(img: CameraImage, *, height: int, width: int) -> np.ndarray:
    """CameraImage -> [H, W, 3] uint8 RGB; the size must be the model's (height, width)."""
    if img.encoding in COMPRESSED_ENCODINGS:
        rgb = _decode_compressed(img, height=height, width=width)
    else:
        if (img.height, img.width) != (height, width):
            raise WireError(
                "image_size", f"image is {img.height}x{img.width}, the model takes {height}x{width}"
            )
        rgb = raw_image_to_rgb(img)
    if rgb.shape != (height, width, 3):
        raise WireError(
            "image_size", f"image is {rgb.shape[0]}x{rgb.shape[1]}, expected {height}x{width}"
        )
    return rgb


def _decode_compressed(img: CameraImage, *, height: int, width: int) -> np.ndarray:
    try:
        with warnings.catch_warnings():
            # A decompression-bomb warning is an image far too large: the size check refuses it.
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            pil = Image.open(io.BytesIO(img.data))
            if pil.format is None or pil.format.lower() != img.encoding.replace("jpg", "jpeg"):
                raise WireError(
                    "image_decode",
                    f"data is {pil.format or 'unknown'}, encoding says {img.encoding}",
                )
            # Check the header's size before decoding pixels (no work for a wrong size).
            if pil.size != (width, height):
                raise WireError(
                    "image_size",
                    f"{img.encoding} image is {pil.size[1]}x{pil.size[0]}, the model takes "
                    f"{height}x{width}",
                )
            return np.asarray(pil.convert("RGB"), dtype=np.uint8)
    except WireError:
        raise
    except Image.DecompressionBombError as exc:  # a header far larger than any camera's
        raise WireError("image_size", f"{img.encoding} header: {exc}") from exc
    except Exception as exc:  # hostile bytes: any decoder failure is a counted drop
        # Pillow refuses crafted files with many types (OSError, ValueError for an oversized
        # text chunk, SyntaxError, struct.error, EOFError, DecompressionBombError, ...); each
        # is this one observation's fault, never the stream's.
        raise WireError(
            "image_decode", f"{img.encoding} does not decode: {type(exc).__name__}: {exc}"
        ) from exc


def context_input(
    obs: Observation,
    *,
    send_stamp_ns: int,
    height: int,
    width: int,
    action_horizon: int,
    action_dim: int,
) -> FrameIn:
    """Checks ``obs`` against the stream's promise and makes the engine's context input
    (stamped ``received_ns`` once checked and decoded)."""
    if obs.image is None:
        raise WireError("no_image", f"observation {obs.seq} carries no image to condition on")
    frame = decode_image(obs.image, height=height, width=width)
    actions = None
    if obs.action is not None and action_dim > 0:
        action = np.asarray(obs.action, dtype=np.float32)
        if action.shape == (action_dim,):
            # One commanded action: it holds over the chunk's horizon.
            actions = np.repeat(action[None, :], action_horizon, axis=0)
        elif action.shape == (action_horizon, action_dim):
            actions = np.array(action, copy=True)
        else:
            raise WireError(
                "action_shape",
                f"action has shape {action.shape}, the model takes ({action_dim},) or "
                f"({action_horizon}, {action_dim})",
            )
    return FrameIn(
        seq=obs.seq,
        capture_stamp_ns=obs.capture_stamp_ns,
        send_stamp_ns=send_stamp_ns,
        received_ns=time.time_ns(),
        frames=frame[None],
        actions=actions,
    )


def wam_inputs(
    obs: Observation, contract: WamContract, task: dict[str, float]
) -> tuple[np.ndarray, CommandTimeline | None]:
    """(state [S] in the contract's order, command timeline) of one observation of a
    world-action model's stream; WireError naming what the observation lacks."""
    return state_vector(obs, contract, task), command_timeline(obs, contract)


def state_vector(obs: Observation, contract: WamContract, task: dict[str, float]) -> np.ndarray:
    """[S] float32 in the contract's order: the robot's inputs from the observation's named
    state values (exactly the contract's, checked by name), the task's from the stream's
    task values."""
    want = {s.name for s in contract.robot_state}
    missing, extra = sorted(want - set(obs.state)), sorted(set(obs.state) - want)
    if missing:
        raise WireError(
            "missing_state",
            f"the model takes {missing} (by name, as its contract says); the observation "
            f"has {sorted(obs.state) or 'no state values'}: bind them in the robot's bridge",
        )
    if extra:
        raise WireError(
            "unknown_state", f"state values {extra} are not the model's inputs {sorted(want)}"
        )
    return contract.state_vector(obs.state, task)


def command_timeline(obs: Observation, contract: WamContract) -> CommandTimeline | None:
    """The observation's command timeline, checked against the model's joints (None: it sent
    none, e.g. a robot that has commanded nothing yet or executes naively)."""
    if obs.commands is None:
        return None
    commands = np.asarray(obs.commands, np.float32)
    joints = contract.action_names
    if commands.ndim != 2 or commands.shape[1] != len(joints) or not len(commands):
        raise WireError(
            "commands_shape",
            f"commands have shape {commands.shape}, the model takes [N>=1, {len(joints)}] "
            f"({','.join(joints)})",
        )
    return CommandTimeline(commands, int(obs.commands_start_ns), int(obs.commands_dt_ns))


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
