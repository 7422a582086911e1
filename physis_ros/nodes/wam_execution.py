"""The bridge's execution of a world-action model's chunks (no ROS here, so it is tested bare).

What belongs here: turning timed chunks (``Prediction.action_start_ns``/``action_dt_ns``: the
time each row is for, on the robot's clock) into the one trajectory the controller follows,
through ``contract.timeline.ChunkExecutor`` (past rows skipped, older chunks refused, the
past kept, ``replace`` or ``crossfade`` joins); the command timeline each observation carries
back to the server (what the robot commanded before the capture, from ``joint_command``, and
what it has committed after it), so the model continues the committed rows instead of
restarting; and the counts the bridge reports. ``execution: naive`` is the baseline without
delay handling: each chunk's row 0 is executed on arrival and nothing is sent back.
Previews acted on (``act_on_previews``, nodes/preview_actions.py) join the same way, ordered
before their chunk.
"""

from __future__ import annotations

import functools
import threading
from dataclasses import dataclass, field

import numpy as np

from physis_ros.contract.timeline import ChunkExecutor, JoinReport, TimedRows
from physis_ros.nodes.pairing import CommandHistory
from physis_ros.nodes.preview_actions import PreviewActing
from physis_ros.nodes.stats import RollingWindow

EXECUTIONS = ("delay_aware", "naive")
JOINS_KEPT = 3000
"""Joins whose step the median and p99 are over (with previews acted on, K per chunk: at 5
chunks a second and K = 4, the last 2.5 minutes)."""


@dataclass(frozen=True, kw_only=True)
class ExecutionConfig:
    execution: str = "delay_aware"
    """``delay_aware`` (rows at the time they are for, joined to the committed ones) or
    ``naive`` (row 0 on arrival; the model is told nothing about committed rows)."""
    join: str = "crossfade"
    """``crossfade`` (blend over the overlap) or ``replace``."""
    fade_rows: int = 4
    commands_dt_s: float = 0.05
    """Spacing of the command timeline sent with each observation."""
    commands_past_s: float = 1.0
    """How far before the capture the timeline reaches."""
    resync_rad: float = 0.2
    """When the robot's reported command is this far from the plan (it was reset, or another
    controller took over), the plan restarts from what the robot reports."""

    def __post_init__(self) -> None:
        if self.execution not in EXECUTIONS:
            raise ValueError(f"execution {self.execution!r} is not one of {EXECUTIONS}")
        if not (self.commands_dt_s > 0 and self.commands_past_s >= 0 and self.resync_rad > 0):
            raise ValueError("commands_dt_s and resync_rad must be > 0, commands_past_s >= 0")


@dataclass
class ExecutionStats:
    accepted: int = 0
    refused: dict[str, int] = field(default_factory=dict)
    rows_skipped: int = 0
    resyncs: int = 0
    last_discontinuity: float = 0.0
    max_discontinuity: float = 0.0
    """max |new - old| at a join's first future row before blending (what ``replace`` jumps
    there; 0 when that row is a committed one the model kept)."""
    max_join_step: float = 0.0
    """The largest change of the commanded target from one row period to the next (joint
    units) from a join's time through its rows, over joins of two chunks (or previews; the
    first chunk's join to the robot's own target is not one): a jump shows here wherever the
    join puts it, beside the model's own motion (max_chunk_step)."""
    join_steps: RollingWindow = field(default_factory=lambda: RollingWindow(JOINS_KEPT))
    max_chunk_step: float = 0.0
    """The largest change from one row to the next inside a chunk's (or preview's) rows."""


def _locked(method):
    """The bridge's callbacks (commands, observations), its receive thread (chunks) and its
    timers (reports) all reach one execution: one at a time."""

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        with self._lock:
            return method(self, *args, **kwargs)

    return wrapper


class ActionExecution:
    """One stream's chunks -> the commanded trajectory (see the module docstring).
    Thread-safe."""

    def __init__(self, cfg: ExecutionConfig, commands: CommandHistory) -> None:
        self.cfg = cfg
        self.commands = commands
        self.stats = ExecutionStats()
        self._lock = threading.RLock()
        self._off_plan = 0
        self.previews = PreviewActing()
        self._order = 0  # over everything admitted (chunks and previews): the executor's ids
        self._new_executor()

    def _new_executor(self) -> None:
        self._joined = False  # no chunk in the plan yet (only, maybe, the robot's target)
        self.executor = ChunkExecutor(
            join=self.cfg.join,
            fade_rows=self.cfg.fade_rows,
            delay_aware=self.cfg.execution == "delay_aware",
        )

    @_locked
    def restart(self) -> None:
        """A new stream: chunk numbering restarts, the old plan is dropped."""
        self._new_executor()
        self.previews.restart()

    @_locked
    def on_command(self, stamp_ns: int, positions: np.ndarray) -> None:
        """What the robot reports it commanded: restart the plan when it is not ours."""
        target = self.executor.target_at(stamp_ns)
        if target is None or len(target) != len(positions):
            return
        if np.abs(target - positions).max() > self.cfg.resync_rad:
            self._off_plan += 1
            if self._off_plan >= 3:
                self._new_executor()
                self.executor.seed(stamp_ns, positions)
                self.stats.resyncs += 1
                self._off_plan = 0
        else:
            self._off_plan = 0

    @_locked
    def arrived(self, *, chunk_index: int, preview_steps: int, received_ns: int) -> tuple[str, int]:
        """A chunk (preview_steps 0) or a preview of it came: ("", its order) when it may go
        on to be executed (the order: increasing, for ``accept`` and the safety gate), else
        (why not, 0): a preview's reason is counted (preview_actions.py)."""
        reason = self.previews.admit(chunk_index, preview_steps, received_ns)
        if reason:
            return reason, 0
        self._order += 1
        return "", self._order

    @_locked
    def ignore_preview(self, reason: str) -> None:
        """A preview the safety gate refused (counted with the others)."""
        self.previews.ignore(reason)

    @_locked
    def accept(
        self,
        *,
        actions: np.ndarray,
        start_ns: int,
        dt_ns: int,
        chunk_index: int,
        now_ns: int,
        order: int | None = None,
        preview_steps: int = 0,
        received_ns: int = 0,
    ) -> JoinReport:
        """Join a chunk whose row i is for start_ns + i * dt_ns; ``order``: what ``arrived``
        gave it (None: the chunk index, for chunks only); ``preview_steps`` k > 0: a preview
        of it after k denoising steps (counted apart, see preview_actions.py)."""
        if self.executor.empty:
            latest, _ = self.commands.before(now_ns + 1)
            if latest is not None and len(latest) == actions.shape[1]:
                self.executor.seed(now_ns, np.asarray(latest, np.float64))
        report = self.executor.accept(
            TimedRows(start_ns, dt_ns, actions),
            now_ns=now_ns,
            chunk_id=chunk_index if order is None else order,
        )
        s = self.stats
        s.rows_skipped += report.skipped_rows
        if not report.accepted:
            if preview_steps:
                self.previews.ignore(report.reason)
            else:
                s.refused[report.reason] = s.refused.get(report.reason, 0) + 1
            return report
        if preview_steps:
            self.previews.acted_on(chunk_index, preview_steps, received_ns)
        else:
            s.accepted += 1
        if len(actions) > 1:
            s.max_chunk_step = max(s.max_chunk_step, float(np.abs(np.diff(actions, axis=0)).max()))
        if self._joined:
            s.last_discontinuity = report.discontinuity
            s.max_discontinuity = max(s.max_discontinuity, report.discontinuity)
            # the plan now and at each new row's time
            rows_left = len(actions) - report.skipped_rows
            grid = report.switch_ns + dt_ns * np.arange(rows_left, dtype=np.int64)
            plan = self.executor.target_at(np.concatenate([[now_ns], grid]))
            step = float(np.abs(np.diff(plan, axis=0)).max())
            s.max_join_step = max(s.max_join_step, step)
            s.join_steps.add(step)
        self._joined = True
        return report

    @_locked
    def values(self, *, previews: bool) -> dict[str, float | int]:
        """For /diagnostics (the output status); ``previews``: with the acted previews'."""
        s = self.stats
        out: dict[str, float | int] = {
            "timed_chunks_executed": s.accepted,
            "timed_chunks_refused": sum(s.refused.values()),
            "timed_rows_skipped": s.rows_skipped,
            "join_max_step": s.max_join_step,
            "join_step_median": s.join_steps.summary()["median"],
            "join_step_p99": s.join_steps.summary()["p99"],
            "chunk_max_step": s.max_chunk_step,
            "plan_resyncs": s.resyncs,
        }
        if previews:
            out.update(self.previews.values())
        return out

    @_locked
    def trajectory(self, now_ns: int) -> tuple[np.ndarray, np.ndarray]:
        """(time_from_start [P] ns measured from now, rows [P, A]) for ``joint_trajectory``."""
        times, rows = self.executor.points_from(now_ns)
        return times - now_ns, rows

    @_locked
    def command_timeline(self, capture_ns: int) -> tuple[np.ndarray, int, int] | None:
        """(commands [N, A], start_ns, dt_ns) for the observation captured at capture_ns:
        reported commands up to the capture, the committed plan after it; None when there is
        nothing to tell (naive execution, or no command yet)."""
        if self.cfg.execution != "delay_aware":
            return None
        dt_ns = int(self.cfg.commands_dt_s * 1e9)
        back = int(self.cfg.commands_past_s * 1e9) // dt_ns
        start_ns = capture_ns - back * dt_ns
        ahead = max(0, (self.executor.plan_end_ns() - capture_ns) // dt_ns) + 1
        count = back + 1 + int(ahead)
        past = self.commands.on_grid(start_ns, dt_ns, count)
        plan = self.executor.rows_on_grid(start_ns, dt_ns, count)
        if past.shape[1] == 0 and plan.shape[1] == 0:
            return None
        if past.shape[1] == 0:
            past = np.full_like(plan, np.nan)
        if plan.shape[1] == 0:
            plan = np.full_like(past, np.nan)
        if past.shape[1] != plan.shape[1]:
            return None
        t = start_ns + dt_ns * np.arange(count)
        out = np.where((t <= capture_ns)[:, None] & ~np.isnan(past), past, plan)
        known = ~np.isnan(out).any(axis=1)
        if not known.any():
            return None
        first, last = int(np.argmax(known)), len(known) - int(np.argmax(known[::-1]))
        out = out[first:last]
        if np.isnan(out).any():  # a gap inside: hold the previous value across it
            for i in range(1, len(out)):
                out[i] = np.where(np.isnan(out[i]), out[i - 1], out[i])
        return out.astype(np.float32), int(start_ns + first * dt_ns), dt_ns
