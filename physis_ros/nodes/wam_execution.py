"""The bridge's execution of a world-action model's chunks (no ROS here, so it is tested bare).

What belongs here: turning timed chunks (``Prediction.action_start_ns``/``action_dt_ns``: the
time each row is for, on the robot's clock) into the one trajectory the controller follows,
through ``link.action_timeline.ChunkExecutor`` (past rows skipped, older chunks refused, the
past kept, ``replace`` or ``crossfade`` joins); the command timeline each observation carries
back to the server (what the robot commanded before the capture, from ``joint_command``, and
what it has committed after it), so the model continues the committed rows instead of
restarting; and the counts the bridge reports. ``execution: naive`` is the baseline without
delay handling: each chunk's row 0 is executed on arrival and nothing is sent back.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from physis_ros.link.action_timeline import ChunkExecutor, JoinReport, TimedRows
from physis_ros.nodes.pairing import CommandHistory

EXECUTIONS = ("delay_aware", "naive")


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


class ActionExecution:
    """One stream's chunks -> the commanded trajectory (see the module docstring)."""

    def __init__(self, cfg: ExecutionConfig, commands: CommandHistory) -> None:
        self.cfg = cfg
        self.commands = commands
        self.stats = ExecutionStats()
        self._off_plan = 0
        self._new_executor()

    def _new_executor(self) -> None:
        self.executor = ChunkExecutor(
            join=self.cfg.join,
            fade_rows=self.cfg.fade_rows,
            delay_aware=self.cfg.execution == "delay_aware",
        )

    def restart(self) -> None:
        """A new stream: chunk numbering restarts, the old plan is dropped."""
        self._new_executor()

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

    def accept(
        self, *, actions: np.ndarray, start_ns: int, dt_ns: int, chunk_index: int, now_ns: int
    ) -> JoinReport:
        """Join a chunk whose row i is for start_ns + i * dt_ns."""
        if self.executor.empty:
            latest, _ = self.commands.before(now_ns + 1)
            if latest is not None and len(latest) == actions.shape[1]:
                self.executor.seed(now_ns, np.asarray(latest, np.float64))
        report = self.executor.accept(
            TimedRows(start_ns, dt_ns, actions), now_ns=now_ns, chunk_id=chunk_index
        )
        s = self.stats
        if report.accepted:
            s.accepted += 1
            s.rows_skipped += report.skipped_rows
            s.last_discontinuity = report.discontinuity
            s.max_discontinuity = max(s.max_discontinuity, report.discontinuity)
        else:
            s.refused[report.reason] = s.refused.get(report.reason, 0) + 1
            s.rows_skipped += report.skipped_rows
        return report

    def trajectory(self, now_ns: int) -> tuple[np.ndarray, np.ndarray]:
        """(time_from_start [P] ns measured from now, rows [P, A]) for ``joint_trajectory``."""
        times, rows = self.executor.points_from(now_ns)
        return times - now_ns, rows

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
