"""Closed-loop evaluation: a world-action model drives the goal-push task in simulation.

What belongs here: one episode of the task (``physis_ros.sim.task``) on simulated time, with
either the scripted expert acting every control period or the model answering every
observed chunk after a response latency (injected: the answer to the observation at t is
applied at t + delay, however long the computation took); the robot side's
``ChunkExecutor`` joins the chunks (delay-aware, or the naive baseline); and the per-episode
measurements: success (box within GOAL_TOLERANCE_M of the goal within the time limit), time
to goal, the action error against what the expert would command in the same state, and the
joint-target jumps where chunks join. Reports and plots: ``closed_loop_report.py``; the
command line: ``physis-eval --closed-loop`` (``cli.py``).

The model's request on the live timeline (DESIGN.md §3; docs/push_wam/README.md): when the
camera completes slot o (frames oF..oF+F-1), the observed slots o-n+1..o go in as context
(frames, proprioception, the joint-target rows the robot knows) and slot o+1 is generated;
every row at or before (newest frame's time + expected latency) is known — executed, or
committed and executed before the answer arrives — and enters clean, the rest is generated.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from physis_ros.link.action_timeline import ChunkExecutor, TimedRows, known_rows
from physis_ros.sim.task import (
    CONTROL_HZ,
    FRAME_HZ,
    PHYSICS_HZ,
    STATE_NAMES,
    TICKS_PER_FRAME,
    TICKS_PER_ROW,
    TIME_LIMIT_S,
    GoalPushExpert,
    TaskSim,
    sample_task,
)

NS = 1_000_000_000
TICK_NS = NS // PHYSICS_HZ
ROW_NS = NS // CONTROL_HZ
FRAME_NS = NS // FRAME_HZ
POLICIES = ("model", "expert")
JUMP_WINDOW_ROWS = 2


@dataclass(frozen=True, kw_only=True)
class ClosedLoopConfig:
    """How the episodes run."""

    episodes: int = 20
    seed0: int = 10_000
    """Episode i uses task seed seed0 + i (held-out: never trained on)."""
    policy: str = "model"
    delay_ms: float = 0.0
    """Response latency: the answer to an observation is applied this long after it."""
    delay_aware: bool = True
    """False: the naive baseline (row 0 executed on arrival, nothing known to the model)."""
    join: str = "crossfade"
    fade_rows: int = 4
    context_chunks: int = 3
    """Observed chunks per request (at most the model's window)."""
    max_known_rows_ahead: int = 8
    """Known rows end at most this many rows after the newest frame (as trained)."""
    time_limit_s: float = TIME_LIMIT_S
    after_goal_s: float = 0.5
    """Simulated time kept after the box reached the goal (the end of the strip)."""

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"policy {self.policy!r} is not one of {POLICIES}")
        if self.episodes < 1 or self.seed0 < 0:
            raise ValueError(
                f"need episodes >= 1 and seed0 >= 0, got {self.episodes}, {self.seed0}"
            )
        if not (math.isfinite(self.delay_ms) and self.delay_ms >= 0):
            raise ValueError(f"delay_ms must be >= 0, got {self.delay_ms}")
        if self.context_chunks < 1 or self.max_known_rows_ahead < 0 or self.fade_rows < 1:
            raise ValueError("context_chunks and fade_rows must be >= 1, max_known_rows_ahead >= 0")
        if not self.time_limit_s > 0:
            raise ValueError(f"time_limit_s must be > 0, got {self.time_limit_s}")

    @property
    def delay_rows(self) -> float:
        return self.delay_ms / (1e3 / CONTROL_HZ)


@dataclass
class SlotObservation:
    """One observed slot as the robot recorded it."""

    slot: int
    frames: np.ndarray
    """[F, H, W, 3] uint8."""
    state: np.ndarray
    """[F, S] float32 (the model's state columns)."""


@dataclass
class Answer:
    """The model's chunk for the generated slot."""

    rows: np.ndarray
    """[H, A] joint targets from the slot's first frame on."""
    frames: np.ndarray | None = None
    """[F, H, W, 3] predicted frames of the slot."""


@dataclass
class EpisodeResult:
    seed: int
    success: bool
    time_to_goal_s: float | None
    final_error_m: float
    duration_s: float
    box_path: np.ndarray
    """[T, 2] box centre at each frame."""
    goal_xy: tuple[float, float]
    action_rmse_rad: float
    """RMS over control periods of (commanded target - what the expert would command)."""
    boundary_jumps: list[float] = field(default_factory=list)
    """Per accepted chunk: the largest per-tick (1 / PHYSICS_HZ) change of the commanded
    target, max over joints, from the tick before the chunk was accepted to JUMP_WINDOW_ROWS
    rows after."""
    max_step: float = 0.0
    """The largest per-tick change of the commanded target in the episode."""
    discontinuities: list[float] = field(default_factory=list)
    chunks_accepted: int = 0
    chunks_refused: dict = field(default_factory=dict)
    rows_skipped: int = 0
    observed: list[np.ndarray] = field(default_factory=list)
    """Camera frames (kept for the strip of one episode)."""
    predicted: dict = field(default_factory=dict)
    """slot -> predicted frames of that slot."""


class ModelDecider:
    """Answers a request with a ``StreamEngine``: one stream per request (the observed slots,
    then the generated slot), so each answer sees exactly the window it was trained on."""

    def __init__(self, engine, *, state_names: tuple[str, ...], poll_timeout_s: float = 120.0):
        self.engine = engine
        self.state_cols = [STATE_NAMES.index(n) for n in state_names]
        self.poll_timeout_s = poll_timeout_s

    def answer(
        self, contexts: list[SlotObservation], known: list[np.ndarray], gen_known, seed: int
    ) -> Answer:
        from physis_ros.engine.api import StreamSpec

        eng = self.engine
        sid = eng.open_stream(StreamSpec(seed=seed)).stream_id
        try:
            for ctx, rows in zip(contexts, known, strict=True):
                eng.submit_context(sid, ctx.frames, rows, ctx.state[:, self.state_cols])
            chunk = eng.submit_generate(sid, gen_known)
            waited = 0.0
            while waited < self.poll_timeout_s:
                for out in eng.poll(0.5):
                    if out.stream_id == sid and out.chunk == chunk:
                        return Answer(rows=out.actions.astype(np.float64), frames=out.frames)
                waited += 0.5
            raise TimeoutError(f"no answer in {self.poll_timeout_s} s")
        finally:
            eng.close_stream(sid)


def run_episode(
    cfg: ClosedLoopConfig, seed: int, decider: ModelDecider | None, *, keep_frames=False
) -> EpisodeResult:
    """One episode (see the module docstring); ``decider`` answers for the model policy."""
    return _Episode(cfg, seed, decider).run(keep_frames=keep_frames)


class _Episode:
    """The state of one running episode: the sim, the executor, the requests in flight."""

    def __init__(self, cfg: ClosedLoopConfig, seed: int, decider: ModelDecider | None) -> None:
        if cfg.policy == "model" and decider is None:
            raise ValueError("the model policy needs a decider")
        self.cfg, self.seed, self.decider = cfg, seed, decider
        self.sim = TaskSim(sample_task(seed))
        self.shadow = GoalPushExpert(self.sim.goal)
        self.expert = cfg.policy == "expert"
        if self.expert:  # the expert's row for the next period replaces the rest
            self.executor = ChunkExecutor(join="replace")
        else:
            self.executor = ChunkExecutor(
                join=cfg.join, fade_rows=cfg.fade_rows, delay_aware=cfg.delay_aware
            )
        self.executor.seed(0, self.sim.scene.joint_positions())
        self.delay_ticks = math.ceil(cfg.delay_ms * 1e-3 * PHYSICS_HZ - 1e-9)
        model_cfg = decider.engine.cfg if decider is not None else None
        self.frames_per_slot = model_cfg.frames_per_chunk if model_cfg else 1
        self.horizon = model_cfg.action_horizon if model_cfg else 0
        self.slots: list[SlotObservation] = []
        self.frames: list[np.ndarray] = []
        self.states: list[np.ndarray] = []
        self.box: list[np.ndarray] = []
        self.pending: list[tuple[int, int, Answer, int]] = []
        """(arrival tick, generated slot, answer, ns of its first row)"""
        self.commanded: list[np.ndarray] = []
        self.switches: list[int] = []
        self.errors: list[float] = []
        self.proposal: np.ndarray | None = None
        self.result = EpisodeResult(
            seed, False, None, 0.0, 0.0, np.zeros((0, 2)), self.sim.setup.goal_xy, 0.0
        )

    def run(self, *, keep_frames: bool) -> EpisodeResult:
        sim, cfg = self.sim, self.cfg
        while sim.tick <= int(cfg.time_limit_s * PHYSICS_HZ):
            t_ns = sim.tick * TICK_NS
            if sim.tick % TICKS_PER_FRAME == 0:
                self._camera(t_ns)
            if sim.reached_s is not None and sim.time_s >= sim.reached_s + cfg.after_goal_s:
                break
            self._deliver(t_ns)
            if sim.tick % TICKS_PER_ROW == 0:
                self._control_period(t_ns)
            target = self.executor.target_at(t_ns + TICK_NS)
            self.commanded.append(target)
            sim.step(target)
        return self._finish(keep_frames)

    def _camera(self, t_ns: int) -> None:
        sim, f = self.sim, self.frames_per_slot
        self.frames.append(sim.render())
        self.states.append(sim.proprio())
        self.box.append(sim.scene.box_pose()[:2].copy())
        if self.decider is None or len(self.frames) % f:
            return
        o = len(self.frames) // f - 1  # slot o is complete: ask for slot o + 1
        self.slots.append(
            SlotObservation(o, np.stack(self.frames[-f:]), np.stack(self.states[-f:]))
        )
        answer, first_row_ns = self._ask(o, t_ns)
        self.pending.append((sim.tick + self.delay_ticks, o + 1, answer, first_row_ns))

    def _ask(self, o: int, t_obs_ns: int) -> tuple[Answer, int]:
        cfg, f, h = self.cfg, self.frames_per_slot, self.horizon
        if cfg.delay_aware:
            ahead = min(math.ceil(cfg.delay_rows - 1e-9), cfg.max_known_rows_ahead)
            known_until = t_obs_ns + ahead * ROW_NS
        else:
            known_until = -1  # the baseline tells the model nothing about its actions

        def known_from(slot: int) -> np.ndarray:
            start = slot * f * FRAME_NS
            grid = self.executor.rows_on_grid(start, ROW_NS, h)
            return known_rows(grid, row_start_ns=start, dt_ns=ROW_NS, known_until_ns=known_until)

        ctx = self.slots[-cfg.context_chunks :]
        answer = self.decider.answer(
            ctx, [known_from(s.slot) for s in ctx], known_from(o + 1), self.seed * 10_000 + o
        )
        return answer, (o + 1) * f * FRAME_NS

    def _deliver(self, t_ns: int) -> None:
        due = [p for p in self.pending if p[0] <= self.sim.tick]
        for item in due:
            self.pending.remove(item)
            _, slot, answer, first_row_ns = item
            self.result.predicted[slot] = answer.frames
            report = self.executor.accept(
                TimedRows(first_row_ns, ROW_NS, answer.rows), now_ns=t_ns, chunk_id=slot
            )
            if report.accepted:
                self.result.chunks_accepted += 1
                self.result.rows_skipped += report.skipped_rows
                self.result.discontinuities.append(report.discontinuity)
                self.switches.append(self.sim.tick)
            else:
                refused = self.result.chunks_refused
                refused[report.reason] = refused.get(report.reason, 0) + 1

    def _control_period(self, t_ns: int) -> None:
        """The expert's proposal for the next row from the state now and the target in force
        (the action error's reference); the expert policy commands it."""
        current = self.executor.target_at(t_ns)
        if self.proposal is not None:
            self.errors.append(float(np.sum((current - self.proposal) ** 2)))
        self.proposal = self.shadow.joint_targets(self.sim.scene, current, 1.0 / CONTROL_HZ)
        if self.expert:
            self.executor.accept(
                TimedRows(t_ns, ROW_NS, np.stack([current, self.proposal])),
                now_ns=t_ns - 1,
                chunk_id=self.sim.tick,
            )

    def _finish(self, keep_frames: bool) -> EpisodeResult:
        sim, r = self.sim, self.result
        r.success = sim.reached_s is not None and sim.reached_s <= self.cfg.time_limit_s
        r.time_to_goal_s = sim.reached_s
        r.final_error_m = sim.box_error_m()
        r.duration_s = sim.time_s
        r.box_path = np.asarray(self.box)
        r.action_rmse_rad = float(np.sqrt(np.mean(self.errors) / 2)) if self.errors else 0.0
        _jumps(r, np.asarray(self.commanded), self.switches)
        if keep_frames:
            r.observed = self.frames
        else:
            r.predicted = {}
        return r


def _jumps(result: EpisodeResult, commanded: np.ndarray, switches: list[int]) -> None:
    """Per accepted chunk, the largest per-tick change of the commanded target from the tick
    before it was accepted to JUMP_WINDOW_ROWS rows after (where a replace jumps and a
    crossfade starts blending); and the largest per-tick change of the whole episode."""
    if len(commanded) < 2:
        return
    step = np.abs(np.diff(commanded, axis=0)).max(axis=1)  # step[i]: tick i -> i+1
    for s in switches:
        lo, hi = max(0, s - 1), min(len(step), s + JUMP_WINDOW_ROWS * TICKS_PER_ROW)
        if hi > lo:
            result.boundary_jumps.append(float(step[lo:hi].max()))
    result.max_step = float(step.max())
