"""Closed-loop evaluation: a world-action model drives a simulated task.

What belongs here: one episode of a task (``physis_ros.sim.tasks``; ``ClosedLoopConfig.task``,
push by default) on simulated time, with either the scripted expert acting every control
period or the model answering every observed chunk after a response latency (injected: the
answer to the observation at t is applied at t + delay, however long the computation took);
the robot side's ``ChunkExecutor`` joins the chunks (delay-aware, or the naive baseline); and
the per-episode measurements: success (the task's goal reached within its time limit), time
to goal, the action error against what the expert would command in the same state, and the
joint-target jumps where chunks join. The model is fed through its contract
(``physis_ros.contract.model``): its state inputs by name, its prompt from the task values.
Reports and plots: ``closed_loop_report.py``; the command line: ``physis-eval --closed-loop``
(``cli.py``).
With ``Takeovers`` the expert drives now and then instead of the model, and the episode is
kept as training data (``EpisodeResult.record``: the on-policy episodes of a DAgger round,
``physis_ros.train.wam_onpolicy``).

The model's request on the live timeline (DESIGN.md §3; docs/push_wam/README.md): when the
camera completes slot o (frames oF..oF+F-1), the observed slots o-n+1..o go in as context
(frames, state, the joint-target rows the robot knows) and slot o+1 is generated;
every row at or before (newest frame's time + expected latency) is known — executed, or
committed and executed before the answer arrives — and enters clean, the rest is generated.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from physis_ros.contract.model import WamContract
from physis_ros.contract.timeline import ChunkExecutor, TimedRows, known_rows, known_until_ns
from physis_ros.engine.api import StreamSpec
from physis_ros.sim.base import (
    CONTROL_HZ,
    FRAME_HZ,
    PHYSICS_HZ,
    TICKS_PER_FRAME,
    TICKS_PER_ROW,
    Episode,
    TaskSim,
)
from physis_ros.sim.tasks import TASKS, get_task
from physis_ros.weights import TRAINED_KNOWN_ROWS_AHEAD

NS = 1_000_000_000
TICK_NS = NS // PHYSICS_HZ
ROW_NS = NS // CONTROL_HZ
FRAME_NS = NS // FRAME_HZ
POLICIES = ("model", "expert")
JUMP_WINDOW_ROWS = 2
ROWS_PER_FRAME = CONTROL_HZ // FRAME_HZ


@dataclass(frozen=True, kw_only=True)
class ClosedLoopConfig:
    """How the episodes run."""

    task: str = "push"
    """The simulated task (``physis_ros.sim.tasks``)."""
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
    max_known_rows_ahead: int = TRAINED_KNOWN_ROWS_AHEAD
    """Known rows end at most this many rows after the newest frame (as trained)."""
    min_committed_ms: float = 0.0
    """Delay-aware: the rows up to at least this long after the newest frame are committed
    (told to the model and executed as planned) even when the answer comes sooner."""
    time_limit_s: float | None = None
    """Simulated seconds an episode may take to reach the goal (None: the task's)."""
    after_goal_s: float = 0.5
    """Simulated time kept after the goal was reached (the end of the strip)."""

    def __post_init__(self) -> None:
        if self.task not in TASKS:
            raise ValueError(f"task {self.task!r} is not one of {sorted(TASKS)}")
        if self.time_limit_s is None:  # frozen: the task's limit, resolved once
            object.__setattr__(self, "time_limit_s", get_task(self.task).time_limit_s)
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
        if not (math.isfinite(self.min_committed_ms) and self.min_committed_ms >= 0):
            raise ValueError(f"min_committed_ms must be >= 0, got {self.min_committed_ms}")


@dataclass
class SlotObservation:
    """One observed slot as the robot recorded it."""

    slot: int
    frames: np.ndarray
    """[F, H, W, 3] uint8."""
    values: np.ndarray
    """[F, K] float32 the task's state values at each frame (columns ``names``: joint
    positions and velocities, a wrench, tracked objects' coordinates, as the robot's topics
    carry them)."""
    names: tuple[str, ...]


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
    path: np.ndarray
    """[T, 2] at each frame, where what the task moves onto the goal was (push: the box
    centre; reach: the tool tip)."""
    goal_xy: tuple[float, float]
    task: str
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
    record: Episode | None = None
    """With takeovers: the episode as training data (the model's rows flagged, the expert's
    rows the targets)."""

    @property
    def box_path(self) -> np.ndarray:
        """``path``, by the name push's readers know it."""
        return self.path


class ModelDecider:
    """Answers a request with a ``StreamEngine``: one stream per request (the observed slots,
    then the generated slot), so each answer sees exactly the window it was trained on. The
    model is fed as its contract (the weights' metadata) says: each frame's state inputs by
    name, from the robot's values and the episode's task values; a prompted model's stream
    conditioned on its task values (``prompt_features``)."""

    def __init__(self, engine, *, meta: dict[str, str], poll_timeout_s: float = 120.0) -> None:
        self.engine = engine
        self.contract = WamContract.from_metadata(meta)
        if self.contract.prompt.kind == "text":
            raise ValueError("a text-prompted model is not run in the closed loop")
        self.poll_timeout_s = poll_timeout_s

    def answer(
        self,
        contexts: list[SlotObservation],
        known: list[np.ndarray],
        gen_known,
        seed: int,
        task: dict[str, float],
    ) -> Answer:
        eng = self.engine
        # the engine makes the conditioning of the task's values (its contract's prompt)
        task_values = dict(task) if self.contract.task_names else {}
        sid = eng.open_stream(StreamSpec(seed=seed, task=task_values)).stream_id
        try:
            for ctx, rows in zip(contexts, known, strict=True):
                eng.submit_context(sid, ctx.frames, rows, self.state(ctx, task))
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

    def state(self, ctx: SlotObservation, task: dict[str, float]) -> np.ndarray:
        """[F, S] float32: each frame's state inputs in the contract's order."""
        rows = [
            dict(zip(ctx.names, (float(v) for v in frame), strict=True)) for frame in ctx.values
        ]
        return np.stack([self.contract.state_vector(values, task) for values in rows])


class Takeovers:
    """When the expert takes the robot over from the model (on-policy training data, the
    idea of DAgger: the expert's rows from the states the model's own actions lead to are
    the labels the model is missing): the model drives for MODEL_S, then the expert for
    EXPERT_S, alternating, both drawn from the seed. The model drives first, so its first
    requests see the arm at rest as a served robot's do."""

    MODEL_S = (0.4, 1.6)
    EXPERT_S = (0.6, 1.4)

    def __init__(self, seed: int, time_limit_s: float) -> None:
        rng = np.random.default_rng([seed, 0xDA66E4])
        self.spans_ns: list[tuple[int, int]] = []
        t = 0.0
        while t < time_limit_s:
            start = t + float(rng.uniform(*self.MODEL_S))
            t = start + float(rng.uniform(*self.EXPERT_S))
            self.spans_ns.append((round(start * NS), round(t * NS)))

    def expert_at(self, t_ns: int) -> bool:
        return any(a <= t_ns < b for a, b in self.spans_ns)


def run_episode(
    cfg: ClosedLoopConfig,
    seed: int,
    decider: ModelDecider | None,
    *,
    keep_frames=False,
    takeovers: Takeovers | None = None,
) -> EpisodeResult:
    """One episode (see the module docstring); ``decider`` answers for the model policy;
    ``takeovers``: when the expert drives instead (the rows it commands are recorded)."""
    return _Episode(cfg, seed, decider, takeovers).run(keep_frames=keep_frames)


class _Episode:
    """The state of one running episode: the sim, the executor, the requests in flight."""

    def __init__(
        self,
        cfg: ClosedLoopConfig,
        seed: int,
        decider: ModelDecider | None,
        takeovers: Takeovers | None = None,
    ) -> None:
        if cfg.policy == "model" and decider is None:
            raise ValueError("the model policy needs a decider")
        self.cfg, self.seed, self.decider, self.takeovers = cfg, seed, decider, takeovers
        self.task = get_task(cfg.task)
        setup = self.task.sample(seed)
        self.sim = TaskSim(self.task, setup)
        self.shadow = self.task.expert(setup)
        self.task_values = self.task.task_values(setup)
        self.expert = cfg.policy == "expert"
        if self.expert:  # the expert's row for the next period replaces the rest
            self.executor = ChunkExecutor(join="replace")
        else:
            self.executor = ChunkExecutor(
                join=cfg.join, fade_rows=cfg.fade_rows, delay_aware=cfg.delay_aware
            )
        self.executor.seed(0, self.sim.joint_positions())
        self.delay_ticks = math.ceil(cfg.delay_ms * 1e-3 * PHYSICS_HZ - 1e-9)
        model_cfg = decider.engine.cfg if decider is not None else None
        self.frames_per_slot = model_cfg.frames_per_chunk if model_cfg else 1
        self.horizon = model_cfg.action_horizon if model_cfg else 0
        self.slots: list[SlotObservation] = []
        self.frames: list[np.ndarray] = []
        self.states: list[np.ndarray] = []
        self.path: list[np.ndarray] = []
        self.pending: list[tuple[int, int, Answer, int]] = []
        """(arrival tick, generated slot, answer, ns of its first row)"""
        self.commanded: list[np.ndarray] = []
        self.expert_rows: set[int] = set()
        """Control rows the expert commanded (all of them for the expert policy)."""
        self.switches: list[int] = []
        self.errors: list[float] = []
        self.proposal: np.ndarray | None = None
        goal = (float(self.sim.goal[0]), float(self.sim.goal[1]))
        self.result = EpisodeResult(
            seed, False, None, 0.0, 0.0, np.zeros((0, 2)), goal, cfg.task, 0.0
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
        self.states.append(sim.state())
        self.path.append(sim.moved_xy().copy())
        if self.decider is None or len(self.frames) % f:
            return
        o = len(self.frames) // f - 1  # slot o is complete: ask for slot o + 1
        self.slots.append(
            SlotObservation(
                o, np.stack(self.frames[-f:]), np.stack(self.states[-f:]), self.task.state_names
            )
        )
        if self._expert_drives((sim.tick + self.delay_ticks) * TICK_NS):
            return  # its answer would arrive while the expert drives
        answer, first_row_ns = self._ask(o, t_ns)
        self.pending.append((sim.tick + self.delay_ticks, o + 1, answer, first_row_ns))

    def _ask(self, o: int, t_obs_ns: int) -> tuple[Answer, int]:
        cfg, f, h = self.cfg, self.frames_per_slot, self.horizon
        if cfg.delay_aware:
            known_until = known_until_ns(
                t_obs_ns,
                cfg.delay_ms * 1e6,
                dt_ns=ROW_NS,
                max_rows_ahead=cfg.max_known_rows_ahead,
                min_committed_ns=cfg.min_committed_ms * 1e6,
            )
        else:
            known_until = -1  # the baseline tells the model nothing about its actions

        def known_from(slot: int) -> np.ndarray:
            start = slot * f * FRAME_NS
            grid = self.executor.rows_on_grid(start, ROW_NS, h)
            return known_rows(
                grid,
                row_start_ns=start,
                dt_ns=ROW_NS,
                known_until_ns=known_until,
                known_after_ns=t_obs_ns,
            )

        ctx = self.slots[-cfg.context_chunks :]
        answer = self.decider.answer(
            ctx,
            [known_from(s.slot) for s in ctx],
            known_from(o + 1),
            self.seed * 10_000 + o,
            self.task_values,
        )
        return answer, (o + 1) * f * FRAME_NS

    def _deliver(self, t_ns: int) -> None:
        due = [p for p in self.pending if p[0] <= self.sim.tick]
        for item in due:
            self.pending.remove(item)
            _, slot, answer, first_row_ns = item
            self.result.predicted[slot] = answer.frames
            if self._expert_drives(t_ns):
                continue
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
        if self.expert or self._expert_drives(t_ns):
            self.expert_rows.add(self.sim.tick // TICKS_PER_ROW + 1)
            self.executor.take_over(
                TimedRows(t_ns, ROW_NS, np.stack([current, self.proposal])), now_ns=t_ns - 1
            )

    def _expert_drives(self, t_ns: int) -> bool:
        return self.takeovers is not None and self.takeovers.expert_at(t_ns)

    def _finish(self, keep_frames: bool) -> EpisodeResult:
        sim, r = self.sim, self.result
        r.success = sim.reached_s is not None and sim.reached_s <= self.cfg.time_limit_s
        r.time_to_goal_s = sim.reached_s
        r.final_error_m = sim.error_m()
        r.duration_s = sim.time_s
        r.path = np.asarray(self.path)
        joints = len(self.task.joint_names)
        r.action_rmse_rad = float(np.sqrt(np.mean(self.errors) / joints)) if self.errors else 0.0
        _jumps(r, np.asarray(self.commanded), self.switches)
        if self.takeovers is not None:
            r.record = self._record()
        if keep_frames:
            r.observed = self.frames
        else:
            r.predicted = {}
        return r

    def _record(self) -> Episode:
        """Frames and the task's state values at each frame; the commanded target at each
        control row (row i at i / CONTROL_HZ: the knots of the commanded trajectory lie on
        that grid), flagged where the model, not the expert, commanded it."""
        n_rows = (len(self.frames) - 1) * ROWS_PER_FRAME + 1
        ticks = np.arange(1, n_rows) * TICKS_PER_ROW - 1  # commanded[k]: the target at k + 1
        start = self.sim.setup.joints
        rows = np.concatenate([[start], np.asarray(self.commanded)[ticks]])
        flags = np.array([i > 0 and i not in self.expert_rows for i in range(n_rows)])
        return self.task.episode_type(
            setup=self.sim.setup,
            frames=np.stack(self.frames),
            state=np.stack(self.states),
            state_names=self.task.state_names,
            rows=rows.astype(np.float32),
            perturbed=flags,
            task_values=self.task_values,
            reached_s=self.sim.reached_s,
        )


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
