"""What a world-action model's served stream sends the engine, on the robot's clock.

The model's contract (``contract.model.WamContract``, from its weights) gives the timing:
camera frames and joint-target rows per second, rows per chunk, how far ahead known rows may
reach. Each observation comes with the robot's command timeline (what it commanded before the
capture and has committed after it): the rows after the capture, up to it plus the pipeline's
response latency, are known (the robot executes them before the answer can arrive) and enter
clean; the rest is generated to continue them. The rows before the capture are not given
(``contract.timeline.known_rows`` says why).

Chunk (slot) c's rows are for the time of its first camera frame plus i rows; a generated
chunk's reply states that time (``Prediction.action_start_ns``), so the robot executes each
row when it is due (``contract.timeline``). Each observed slot goes in with the rows known as
of its newest frame (training's per-slot windows); each generate request with the rows known as
of the newest observation. The response latency is the stream's promise
(``expected_response_latency_ms``): the figure the server stated, which its client sees.
numpy only.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from physis_ros.contract.model import WamContract
from physis_ros.contract.timeline import interpolate, known_rows, known_until_ns


@dataclass(frozen=True)
class CommandTimeline:
    """values [N, A] float32 at start_ns + i * dt_ns (robot clock)."""

    values: np.ndarray
    start_ns: int
    dt_ns: int


@dataclass(frozen=True)
class ActionTiming:
    """A reply's rows on the robot clock (``Prediction`` fields 13-15)."""

    start_ns: int
    dt_ns: int
    known_rows: int


def frame_dt_ns(contract: WamContract) -> int:
    return round(1e9 / contract.frame_hz)


def row_dt_ns(contract: WamContract) -> int:
    return round(1e9 / contract.action_hz)


def known_until(contract: WamContract, newest_capture_ns: int, latency_ms: float) -> int:
    """Rows at or before this are known: the newest capture plus the response latency (at
    least the contract's min_committed_ms; rounded up to a row), at most
    max_known_rows_ahead rows ahead."""
    return known_until_ns(
        newest_capture_ns,
        latency_ms * 1e6,
        dt_ns=row_dt_ns(contract),
        max_rows_ahead=contract.max_known_rows_ahead,
        min_committed_ns=contract.min_committed_ms * 1e6,
    )


def chunk_known_rows(
    timeline: CommandTimeline | None,
    contract: WamContract,
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
    rows, dt = contract.rows_per_chunk, row_dt_ns(contract)
    grid = np.full((rows, len(contract.action_names)), np.nan, np.float32)
    if timeline is not None:
        commands = timeline.values.astype(np.float64)
        times = timeline.start_ns + timeline.dt_ns * np.arange(len(commands), dtype=np.int64)
        rows_t = first_frame_ns + dt * np.arange(rows, dtype=np.int64)
        covered = (rows_t >= times[0]) & (rows_t <= times[-1])
        if covered.any():
            grid[covered] = interpolate(times, commands, rows_t[covered])
    return known_rows(
        grid,
        row_start_ns=first_frame_ns,
        dt_ns=dt,
        known_until_ns=known_until_ns,
        known_after_ns=known_after_ns,
    )


def leading_known(rows: np.ndarray) -> int:
    """Rows known (not NaN) before the first generated one."""
    unknown = np.isnan(rows).any(axis=1)
    return int(np.argmax(unknown)) if unknown.any() else len(rows)


REPLIES_KEPT = 1024
"""Generated slots whose reply timing is kept until their chunk is out."""


class WamRows:
    """The rows of one served world-action stream's requests and the timing of its replies
    (module docstring); the engine core's thread calls it."""

    def __init__(self, contract: WamContract) -> None:
        self.contract = contract
        self._replies: dict[int, ActionTiming] = {}
        """Generated slot -> its timing, until its chunk is out."""

    def first_frame_ns(self, anchor, slot: int) -> int:
        """Robot clock of slot's first camera frame, from ``anchor`` (an ObservedChunk: its
        newest frame's capture stamp and frame index) at the model's frame period."""
        offset = slot * self.contract.frames_per_chunk - anchor.newest_frame
        return int(anchor.newest.capture_stamp_ns + offset * frame_dt_ns(self.contract))

    def known_rows(self, anchor, slot: int, latency_ms: float) -> np.ndarray:
        """[H, A] of ``slot`` as the robot knows them when ``anchor``'s newest frame was
        captured (NaN: to generate)."""
        capture_ns = anchor.newest.capture_stamp_ns
        return chunk_known_rows(
            anchor.newest.commands,
            self.contract,
            first_frame_ns=self.first_frame_ns(anchor, slot),
            known_until_ns=known_until(self.contract, capture_ns, latency_ms),
            known_after_ns=capture_ns,
        )

    def generate_rows(self, anchor, slot: int, latency_ms: float) -> np.ndarray:
        """The committed rows of the generated ``slot``; its reply's timing is kept."""
        rows = self.known_rows(anchor, slot, latency_ms)
        self._replies.pop(slot - REPLIES_KEPT, None)  # a chunk never out (e.g. NaN output)
        self._replies[slot] = ActionTiming(
            self.first_frame_ns(anchor, slot), row_dt_ns(self.contract), leading_known(rows)
        )
        return rows

    def reply_timing(self, slot: int, *, final: bool) -> ActionTiming | None:
        """The timing of ``slot``'s chunk (``final``: the chunk itself, not a preview: forgotten
        after)."""
        return self._replies.pop(slot, None) if final else self._replies.get(slot)
