"""What a world-action model's stream sends the engine, on the robot's clock.

What belongs here (numpy only): the model's timing (camera frames and joint-target rows per
second, rows per chunk, how far ahead known rows may reach — from the weights' metadata),
the state vector of one observation (joint positions and velocities in the model's joint
order, then the wrench, as the weights' ``state_names`` list them), and the known rows of a
chunk read off the command timeline the robot sends with each observation (what it
commanded before the capture and has committed after it): rows up to the capture plus the
pipeline's response latency are known — the robot executes them before the answer can
arrive — and enter clean; the rest is generated to continue them.

Chunk (slot) c's rows are for the time of its first camera frame plus i rows; a generated
chunk's reply states that time (``Prediction.action_start_ns``), so the robot executes each
row when it is due (``link.action_timeline``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from physis_ros.link.action_timeline import interpolate
from physis_ros.link.wire import Observation, WireError

POSITION, VELOCITY = "_pos", "_vel"
WRENCH_NAMES = ("force_x", "force_y", "force_z", "torque_x", "torque_y", "torque_z")


@dataclass(frozen=True, kw_only=True)
class WamTiming:
    frame_dt_ns: int
    """Camera frame period the model was trained at."""
    row_dt_ns: int
    """Joint-target row period."""
    rows: int
    """Rows per chunk (from the chunk's first frame on)."""
    frames_per_chunk: int
    max_known_rows_ahead: int
    """Known rows end at most this many rows after the newest frame (as trained)."""
    action_names: tuple[str, ...]
    state_names: tuple[str, ...]

    @classmethod
    def from_metadata(cls, meta: dict[str, str], *, rows: int, frames_per_chunk: int):
        missing = [
            k for k in ("frame_hz", "action_hz", "action_names", "state_names") if k not in meta
        ]
        if missing:
            raise ValueError(f"weights metadata lacks {missing}: not a world-action model's")
        return cls(
            frame_dt_ns=round(1e9 / float(meta["frame_hz"])),
            row_dt_ns=round(1e9 / float(meta["action_hz"])),
            rows=rows,
            frames_per_chunk=frames_per_chunk,
            max_known_rows_ahead=int(meta.get("max_known_rows_ahead", "8")),
            action_names=tuple(meta["action_names"].split(",")),
            state_names=tuple(meta["state_names"].split(",")),
        )

    def known_until_ns(self, newest_capture_ns: int, latency_ms: float) -> int:
        """Rows at or before this are known: the newest capture plus the response latency
        (rounded up to a row), at most max_known_rows_ahead rows ahead."""
        ahead = min(math.ceil(latency_ms * 1e6 / self.row_dt_ns - 1e-9), self.max_known_rows_ahead)
        return newest_capture_ns + max(0, ahead) * self.row_dt_ns


def state_vector(obs: Observation, timing: WamTiming) -> np.ndarray:
    """[S] float32 in ``timing.state_names`` order: ``<joint>_pos``/``<joint>_vel`` by joint
    name (the action names are the joints), the wrench's six values by their names."""
    values = []
    names = list(obs.joint_names)
    for name in timing.state_names:
        if name in WRENCH_NAMES:
            if obs.wrench is None:
                raise WireError("no_wrench", "the model takes the wrench; the observation has none")
            values.append(float(obs.wrench[WRENCH_NAMES.index(name)]))
            continue
        joint, kind = name[:-4], name[-4:]
        source = obs.joint_positions if kind == POSITION else obs.joint_velocities
        if kind not in (POSITION, VELOCITY) or source is None or joint not in names:
            raise WireError(
                "no_joint_state",
                f"the model takes {name}; the observation has joints {names} "
                f"({'with' if obs.joint_velocities is not None else 'without'} velocities)",
            )
        values.append(float(source[names.index(joint)]))
    return np.asarray(values, np.float32)


def chunk_known_rows(
    obs: Observation, timing: WamTiming, *, first_frame_ns: int, known_until_ns: int
) -> np.ndarray | None:
    """[H, A] rows of the chunk whose first frame is at first_frame_ns, from the observation's
    command timeline: interpolated where it covers them and they are at or before
    known_until_ns, NaN elsewhere (generated). None when the observation sent no timeline."""
    if obs.commands is None:
        return None
    commands = np.asarray(obs.commands, np.float64)
    if commands.shape[1] != len(timing.action_names):
        raise WireError(
            "commands_shape",
            f"commands have {commands.shape[1]} joints, the model takes {len(timing.action_names)}",
        )
    times = obs.commands_start_ns + obs.commands_dt_ns * np.arange(len(commands), dtype=np.int64)
    rows_t = first_frame_ns + timing.row_dt_ns * np.arange(timing.rows, dtype=np.int64)
    out = np.full((timing.rows, commands.shape[1]), np.nan, np.float32)
    inside = (rows_t >= times[0]) & (rows_t <= times[-1]) & (rows_t <= known_until_ns)
    if inside.any():
        out[inside] = interpolate(times, commands, rows_t[inside])
    return out
