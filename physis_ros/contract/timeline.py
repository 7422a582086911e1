"""Action chunks on the robot's clock: joining them into one commanded trajectory, and the
command timeline a world-action model is conditioned on.

What belongs here (numpy only: the bridge, the closed-loop eval and the server share it):

- ``TimedRows``: joint-target rows at ``start_ns + i * dt_ns`` (robot clock, ns), linearly
  interpolated between rows, as a ``JointTrajectory`` follower executes them.
- ``ChunkExecutor``: the robot side's committed trajectory. A chunk says the time of its
  first row (the observation's stamp plus the pipeline's response latency, on the model's
  timeline); the executor never commands a time already past (rows before now are skipped, a
  chunk with none left is refused), never lets an older chunk replace a newer one, keeps what
  was commanded before now unchanged, and joins the new rows to the committed ones either by
  ``replace`` (the new rows from the first future one on) or ``crossfade`` (blended over the
  rows where the old plan and the new chunk overlap, or from the target the old plan holds
  after its last row when they do not). Without delay handling
  (``delay_aware=False``) a chunk's first row is executed on arrival, as if it had been
  computed instantly: the baseline it is measured against. ``take_over`` lets another
  controller (a teleoperator, a safety controller; the expert when on-policy training data
  is collected) replace the plan for a while; the stream's next chunk joins from its rows.
- ``known_rows``: the rows of a chunk that the robot has committed after the newest frame
  (executed before the answer can arrive), read off the command timeline; the model takes
  them clean and generates the rest to continue them (real-time chunking). The rows at or
  before the newest frame are not given: a model shown its own past rows learned to continue
  them rather than correct them (push-wam: 3-4 of 20 held-out episodes with them, 8-11
  without; docs/push_wam).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

JOIN_MODES = ("replace", "crossfade")


@dataclass(frozen=True)
class TimedRows:
    """rows [N, A] at start_ns + i * dt_ns."""

    start_ns: int
    dt_ns: int
    rows: np.ndarray

    def __post_init__(self) -> None:
        rows = np.asarray(self.rows, dtype=np.float64)
        if rows.ndim != 2 or len(rows) == 0:
            raise ValueError(f"rows must be [N>=1, A], got shape {rows.shape}")
        if self.dt_ns <= 0:
            raise ValueError(f"dt_ns must be positive, got {self.dt_ns}")
        if not np.isfinite(rows).all():
            raise ValueError("rows contain NaN or inf")
        object.__setattr__(self, "rows", rows)

    @property
    def times_ns(self) -> np.ndarray:
        return self.start_ns + self.dt_ns * np.arange(len(self.rows), dtype=np.int64)

    @property
    def end_ns(self) -> int:
        return int(self.start_ns + self.dt_ns * (len(self.rows) - 1))


def interpolate(times_ns: np.ndarray, values: np.ndarray, t_ns) -> np.ndarray:
    """Piecewise-linear values [..., A] at t_ns (scalar or [T]); held beyond the ends."""
    t = np.asarray(t_ns, dtype=np.float64)
    cols = [np.interp(t, times_ns.astype(np.float64), values[:, j]) for j in range(values.shape[1])]
    return np.stack(cols, axis=-1)


@dataclass(frozen=True)
class JoinReport:
    """What happened to one arriving chunk."""

    accepted: bool
    reason: str = ""
    """Why refused: ``out_of_order`` (not newer than the last accepted), ``expired`` (no row
    left in the future)."""
    switch_ns: int = 0
    """Time of the first new row that is commanded."""
    skipped_rows: int = 0
    """Rows whose time had passed (never commanded)."""
    overlap_rows: int = 0
    """New rows at times the old plan still covered."""
    discontinuity: float = 0.0
    """max |new - old| at the switch time (joint units): the jump a replace makes there."""


class ChunkExecutor:
    """The commanded trajectory (see the module docstring). Not thread-safe: one caller."""

    def __init__(
        self,
        *,
        join: str = "crossfade",
        fade_rows: int = 4,
        delay_aware: bool = True,
        history_ns: int = 2_000_000_000,
    ) -> None:
        if join not in JOIN_MODES:
            raise ValueError(f"join {join!r} is not one of {JOIN_MODES}")
        if fade_rows < 1:
            raise ValueError(f"fade_rows must be >= 1, got {fade_rows}")
        self.join = join
        self.fade_rows = fade_rows
        self.delay_aware = delay_aware
        self.history_ns = history_ns
        self._times = np.zeros(0, np.int64)
        self._values: np.ndarray | None = None
        self._last_id: int | None = None
        self.last_row_dt_ns = 0

    # ---- the trajectory ------------------------------------------------------------------
    @property
    def empty(self) -> bool:
        return self._values is None

    def target_at(self, t_ns: int) -> np.ndarray | None:
        """The commanded target at t_ns (held after the plan's last row); None before any."""
        if self._values is None:
            return None
        return interpolate(self._times, self._values, t_ns)

    def plan_end_ns(self) -> int:
        return int(self._times[-1]) if len(self._times) else 0

    def points_from(self, now_ns: int) -> tuple[np.ndarray, np.ndarray]:
        """(times [P] ns, rows [P, A]) to publish at now_ns: the target now, then every planned
        row after now (a follower interpolating them commands exactly this trajectory)."""
        if self._values is None:
            return np.zeros(0, np.int64), np.zeros((0, 0))
        later = self._times > now_ns
        times = np.concatenate([[now_ns], self._times[later]])
        rows = np.concatenate([self.target_at(now_ns)[None], self._values[later]])
        return times.astype(np.int64), rows

    def rows_on_grid(self, start_ns: int, dt_ns: int, count: int) -> np.ndarray:
        """The commanded targets at start_ns + i*dt_ns, NaN where nothing was commanded yet
        or beyond the plan's last row."""
        out = np.full((count, self._values.shape[1] if self._values is not None else 0), np.nan)
        if self._values is None:
            return out
        t = start_ns + dt_ns * np.arange(count, dtype=np.int64)
        inside = (t >= self._times[0]) & (t <= self._times[-1])
        out[inside] = interpolate(self._times, self._values, t[inside])
        return out

    def seed(self, now_ns: int, target: np.ndarray) -> None:
        """Start from the robot's current target (before the first chunk), held at now."""
        self._times = np.array([now_ns], np.int64)
        self._values = np.asarray(target, np.float64).reshape(1, -1)

    # ---- joining a chunk -----------------------------------------------------------------
    def take_over(self, rows: TimedRows, *, now_ns: int) -> JoinReport:
        """Another controller's ``rows`` replace the plan from their first future row on,
        whatever chunk the stream has reached (its later chunks are still accepted and join
        from these rows); what was commanded before now stays."""
        last_id, join, aware = self._last_id, self.join, self.delay_aware
        self._last_id, self.join, self.delay_aware = None, "replace", True
        try:
            return self.accept(rows, now_ns=now_ns, chunk_id=0)
        finally:
            self._last_id, self.join, self.delay_aware = last_id, join, aware

    def accept(self, chunk: TimedRows, *, now_ns: int, chunk_id: int) -> JoinReport:
        """Join ``chunk`` (``chunk_id``: its position in the stream, increasing) at now_ns."""
        if self._last_id is not None and chunk_id <= self._last_id:
            return JoinReport(accepted=False, reason="out_of_order")
        if not self.delay_aware:  # the baseline: row 0 is for now, whatever it was computed for
            chunk = TimedRows(now_ns, chunk.dt_ns, chunk.rows)
        times, rows = chunk.times_ns, chunk.rows
        future = times >= now_ns
        skipped = int(np.argmax(future)) if future.any() else len(rows)
        if skipped == len(rows):
            return JoinReport(accepted=False, reason="expired", skipped_rows=skipped)
        times, rows = times[skipped:], rows[skipped:].copy()
        self._last_id = chunk_id
        self.last_row_dt_ns = chunk.dt_ns
        if self._values is None:
            self._times, self._values = times, rows
            return JoinReport(accepted=True, switch_ns=int(times[0]), skipped_rows=skipped)
        old_end = int(self._times[-1])
        overlap = times <= old_end
        old_at = interpolate(self._times, self._values, times)
        discontinuity = float(np.abs(rows[0] - old_at[0]).max())
        if self.join == "crossfade":
            # Over the overlap; a chunk that starts after the plan's last row (the first
            # chunk after seed, one after a gap) fades from the target held there instead:
            # otherwise the largest jump of an episode, its first join, was replace's.
            n = min(int(overlap.sum()) or self.fade_rows, self.fade_rows, len(rows))
            w = np.ones(len(rows))
            w[:n] = (np.arange(n) + 1.0) / (n + 1.0)
            rows = (1.0 - w[:, None]) * old_at + w[:, None] * rows
        # what was commanded before now stays as it was: the old target at now (or just
        # before, when the first new row is for now) is where the new rows start from
        pin_ns = now_ns if times[0] > now_ns else now_ns - 1
        keep = self._times < pin_ns
        self._values = np.concatenate([self._values[keep], self.target_at(pin_ns)[None], rows])
        self._times = np.concatenate([self._times[keep], [pin_ns], times]).astype(np.int64)
        old = self._times < now_ns - self.history_ns
        if old.sum() > 1:
            first = int(old.sum()) - 1
            self._times, self._values = self._times[first:], self._values[first:]
        return JoinReport(
            accepted=True,
            switch_ns=int(times[0]),
            skipped_rows=skipped,
            overlap_rows=int(overlap.sum()),
            discontinuity=discontinuity,
        )


def known_until_ns(
    newest_frame_ns: int,
    latency_ns: float,
    *,
    dt_ns: int,
    max_rows_ahead: int,
    min_committed_ns: float = 0.0,
) -> int:
    """The last committed row time a request gives: the newest frame plus the response
    latency (or ``min_committed_ns``, the plan the robot keeps however soon the answer comes,
    if longer) rounded up to a row, at most ``max_rows_ahead`` rows after the frame."""
    reach_ns = max(latency_ns, min_committed_ns)
    ahead = min(math.ceil(reach_ns / dt_ns - 1e-9), max_rows_ahead)
    return newest_frame_ns + max(0, ahead) * dt_ns


def known_rows(
    timeline: np.ndarray,
    *,
    row_start_ns: int,
    dt_ns: int,
    known_until_ns: int,
    known_after_ns: int | None = None,
) -> np.ndarray:
    """A chunk's known rows [H, A]: ``timeline`` holds the commanded targets at the chunk's
    row times (NaN where none); rows after known_until_ns become NaN (to be generated), and
    so do rows at or before known_after_ns (the newest frame: what the robot did before it is
    in the frames and the state, not given as rows)."""
    out = np.array(timeline, dtype=np.float32, copy=True)
    times = row_start_ns + dt_ns * np.arange(len(out), dtype=np.int64)
    out[times > known_until_ns] = np.nan
    if known_after_ns is not None:
        out[times <= known_after_ns] = np.nan
    return out
