"""What a world-action model's stream sends the engine, on the robot's clock.

What belongs here (numpy only): the model's timing (camera frames and joint-target rows per
second, rows per chunk, how far ahead known rows may reach — from the weights' metadata),
the state vector of one observation (joint positions and velocities in the model's joint
order, the wrench, the goal, a tracked object's x and y, as the weights' ``state_names``
list them), and the known rows of a chunk read off the command timeline the robot sends
with each observation (what it commanded before the capture and has committed after it):
the rows after the capture, up to it plus the pipeline's response latency, are known — the
robot executes them before the answer can arrive — and enter clean; the rest is generated to
continue them. The rows before the capture are not given
(``contract.timeline.known_rows`` says why).

Chunk (slot) c's rows are for the time of its first camera frame plus i rows; a generated
chunk's reply states that time (``Prediction.action_start_ns``), so the robot executes each
row when it is due (``contract.timeline``).

``WamStream`` is what a served stream does with these (serve/session.py and
engine_loop.py call it): each observation is checked and gives its state and command timeline
(a bad one is dropped by reason: ``no_joint_state``, ``no_wrench``, ``no_object_position``,
``commands_shape``); each observed slot goes in with its per-frame state and the rows known
as of its newest frame (training's per-slot windows); each generate request carries the rows
known as of the newest observation; each reply states the robot-clock time of its first row.
The response latency is the stream's promise (``expected_response_latency_ms``): the figure
the server stated, which its client sees.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from physis_ros.contract.timeline import interpolate, known_rows, known_until_ns
from physis_ros.link.wire import Observation, WireError
from physis_ros.sim.task import BOX_STATE_NAMES, GOAL_STATE_NAMES
from physis_ros.weights import min_committed_ms, trained_known_rows_ahead

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
    min_committed_ms: float
    """Known rows reach at least this long after the newest frame (the weights' advice)."""
    action_names: tuple[str, ...]
    state_names: tuple[str, ...]

    @property
    def takes_goal(self) -> bool:
        return any(n in GOAL_STATE_NAMES for n in self.state_names)

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
            max_known_rows_ahead=trained_known_rows_ahead(meta),
            min_committed_ms=min_committed_ms(meta),
            action_names=tuple(meta["action_names"].split(",")),
            state_names=tuple(meta["state_names"].split(",")),
        )

    def known_until_ns(self, newest_capture_ns: int, latency_ms: float) -> int:
        """Rows at or before this are known: the newest capture plus the response latency
        (at least min_committed_ms; rounded up to a row), at most max_known_rows_ahead rows
        ahead."""
        return known_until_ns(
            newest_capture_ns,
            latency_ms * 1e6,
            dt_ns=self.row_dt_ns,
            max_rows_ahead=self.max_known_rows_ahead,
            min_committed_ns=self.min_committed_ms * 1e6,
        )


def state_vector(obs: Observation, timing: WamTiming, goal=None) -> np.ndarray:
    """[S] float32 in ``timing.state_names`` order: ``<joint>_pos``/``<joint>_vel`` by joint
    name (the action names are the joints), the wrench's six values by their names, the
    stream's ``goal`` (from its prompt, not the observation) as goal_x, goal_y, and the
    observation's ``object_position`` x, y (the robot's object tracker) as box_x, box_y."""
    values = []
    names = list(obs.joint_names)
    for name in timing.state_names:
        if name in GOAL_STATE_NAMES:
            if goal is None:  # the front end refuses such a stream before it opens
                raise WireError("no_goal", "the model takes the goal; the stream has none")
            values.append(float(goal[GOAL_STATE_NAMES.index(name)]))
            continue
        if name in BOX_STATE_NAMES:
            if obs.object_position is None:
                raise WireError(
                    "no_object_position",
                    f"the model takes {', '.join(BOX_STATE_NAMES)} (an object tracker's "
                    "position); the observation has none: set the bridge's object_topic",
                )
            values.append(float(obs.object_position[BOX_STATE_NAMES.index(name)]))
            continue
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


@dataclass(frozen=True)
class CommandTimeline:
    """values [N, A] float32 at start_ns + i * dt_ns (robot clock)."""

    values: np.ndarray
    start_ns: int
    dt_ns: int


def command_timeline(obs: Observation, timing: WamTiming) -> CommandTimeline | None:
    """The observation's command timeline, checked against the model's joints (None: it sent
    none, e.g. a robot that has commanded nothing yet or executes naively)."""
    if obs.commands is None:
        return None
    commands = np.asarray(obs.commands, np.float32)
    if commands.ndim != 2 or commands.shape[1] != len(timing.action_names) or not len(commands):
        raise WireError(
            "commands_shape",
            f"commands have shape {commands.shape}, the model takes [N>=1, "
            f"{len(timing.action_names)}] ({','.join(timing.action_names)})",
        )
    return CommandTimeline(commands, int(obs.commands_start_ns), int(obs.commands_dt_ns))


def chunk_known_rows(
    timeline: CommandTimeline | None,
    timing: WamTiming,
    *,
    first_frame_ns: int,
    known_until_ns: int,
    known_after_ns: int,
) -> np.ndarray:
    """[H, A] rows of the chunk whose first frame is at first_frame_ns: the command timeline
    interpolated where it covers them, then kept only after known_after_ns (the newest
    frame) and at or before known_until_ns by ``contract.timeline.known_rows`` (the rule
    the closed loop uses, and why); NaN elsewhere (generated; all of them without a
    timeline)."""
    grid = np.full((timing.rows, len(timing.action_names)), np.nan, np.float32)
    if timeline is not None:
        commands = timeline.values.astype(np.float64)
        times = timeline.start_ns + timeline.dt_ns * np.arange(len(commands), dtype=np.int64)
        rows_t = first_frame_ns + timing.row_dt_ns * np.arange(timing.rows, dtype=np.int64)
        covered = (rows_t >= times[0]) & (rows_t <= times[-1])
        if covered.any():
            grid[covered] = interpolate(times, commands, rows_t[covered])
    return known_rows(
        grid,
        row_start_ns=first_frame_ns,
        dt_ns=timing.row_dt_ns,
        known_until_ns=known_until_ns,
        known_after_ns=known_after_ns,
    )


def leading_known(rows: np.ndarray) -> int:
    """Rows known (not NaN) before the first generated one."""
    unknown = np.isnan(rows).any(axis=1)
    return int(np.argmax(unknown)) if unknown.any() else len(rows)


REPLIES_KEPT = 1024
"""Generated slots whose reply timing is kept until their chunk is out."""


@dataclass(frozen=True)
class ActionTiming:
    """A reply's rows on the robot clock (``Prediction`` fields 13-15)."""

    start_ns: int
    dt_ns: int
    known_rows: int


class WamStream:
    """One served stream of a world-action model (see the module docstring). ``check`` runs
    on the gRPC reader thread; the rest on the engine thread."""

    def __init__(self, timing: WamTiming, goal: tuple[float, float] | None = None) -> None:
        self.timing = timing
        self.goal = goal
        """The task's goal from the stream's prompt (a model with goal state columns)."""
        self._replies: dict[int, ActionTiming] = {}
        """Generated slot -> its timing, until its chunk is out."""

    def check(self, obs: Observation) -> tuple[np.ndarray, CommandTimeline | None]:
        """(state [S], command timeline) of one observation; WireError when it lacks what
        the model takes."""
        return state_vector(obs, self.timing, self.goal), command_timeline(obs, self.timing)

    def first_frame_ns(self, anchor, slot: int) -> int:
        """Robot clock of slot's first camera frame, from ``anchor`` (an ObservedChunk: its
        newest frame's capture stamp and frame index) at the model's frame period."""
        offset = slot * self.timing.frames_per_chunk - anchor.newest_frame
        return int(anchor.newest.capture_stamp_ns + offset * self.timing.frame_dt_ns)

    def known_rows(self, anchor, slot: int, latency_ms: float) -> np.ndarray:
        """[H, A] of ``slot`` as the robot knows them when ``anchor``'s newest frame was
        captured (NaN: to generate)."""
        return chunk_known_rows(
            anchor.newest.commands,
            self.timing,
            first_frame_ns=self.first_frame_ns(anchor, slot),
            known_until_ns=self.timing.known_until_ns(anchor.newest.capture_stamp_ns, latency_ms),
            known_after_ns=anchor.newest.capture_stamp_ns,
        )

    def generate_rows(self, anchor, slot: int, latency_ms: float) -> np.ndarray:
        """The committed rows of the generated ``slot``; its reply's timing is kept."""
        rows = self.known_rows(anchor, slot, latency_ms)
        self._replies.pop(slot - REPLIES_KEPT, None)  # a chunk never out (e.g. NaN output)
        self._replies[slot] = ActionTiming(
            self.first_frame_ns(anchor, slot), self.timing.row_dt_ns, leading_known(rows)
        )
        return rows

    def reply_timing(self, slot: int, *, final: bool) -> ActionTiming | None:
        """The timing of ``slot``'s chunk (``final``: the chunk itself, not a preview: forgotten
        after)."""
        return self._replies.pop(slot, None) if final else self._replies.get(slot)
