"""Replay recorded episodes through an engine and score what it predicted against what followed.

What belongs here: cutting an episode into evaluation windows (``context_chunks`` observed
chunks, then ``horizon_chunks`` predicted ones, all anchored on the last observed chunk, as a
served stream's chunks are: DESIGN.md §3), feeding them to any ``StreamEngine`` (the
in-process engine, or a client of the server) as fast as possible or at the recorded timing,
collecting the outputs with their timing, and the per-horizon-step metrics against the
copy-last-frame / hold baselines measured on the same windows. A world model conditioned on
commands gets, for its predicted chunks, the last observed command held (what a server knows;
``future_commands``: the recorded ones instead). Reports and plots live in ``report.py``; the
command line in ``cli.py``. No torch, no rclpy: the engine is a protocol.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from tqdm import tqdm

from physis_ros.engine.api import StreamEngine, StreamSpec
from physis_ros.eval.bag import BagReadError, Episode, TopicChoice, read_episode
from physis_ros.eval.metrics import mse, psnr, ssim


@dataclass(frozen=True, kw_only=True)
class EvalConfig:
    """How episodes are cut into windows and replayed."""

    context_chunks: int = 5
    """Observed chunks fed as context before predicting (as many as the model's window W
    reads: a served stream's steady state)."""
    horizon_chunks: int = 4
    """Chunks predicted after the context; horizon steps are their frames/actions."""
    window_stride_chunks: int = 4
    """Chunks between the starts of consecutive windows in an episode."""
    max_windows_per_bag: int = 0
    """0: every window that fits."""
    max_seconds: float = 0.0
    """Bag seconds used from each bag's first frame (0: all of it). With the window geometry
    and ``max_windows_per_bag`` it fixes the window set (``window_anchors``), the same in
    process and over the link."""
    frame_hz: float = 10.0
    """Camera rate the model was trained at; faster bags are subsampled to it."""
    realtime: bool = False
    """Submit each context chunk at its recorded time (relative to the window start)."""
    seed: int = 0
    """Stream seed of window i is seed + i (initial noise)."""
    poll_timeout_s: float = 60.0
    """Longest wait for a window's predictions before it is counted as timed out."""
    future_commands: bool = False
    """Condition predicted chunks on the recorded commands that followed (known to no server:
    an upper bound); default: the last observed command held, as served."""

    def __post_init__(self) -> None:
        if self.context_chunks < 1:
            raise ValueError(f"context_chunks must be >= 1, got {self.context_chunks}")
        if self.horizon_chunks < 1:
            raise ValueError(f"horizon_chunks must be >= 1, got {self.horizon_chunks}")
        if self.window_stride_chunks < 1:
            raise ValueError(f"window_stride_chunks must be >= 1, got {self.window_stride_chunks}")
        if self.max_windows_per_bag < 0:
            raise ValueError(f"max_windows_per_bag must be >= 0, got {self.max_windows_per_bag}")
        if not self.max_seconds >= 0:
            raise ValueError(f"max_seconds must be >= 0, got {self.max_seconds}")
        if not self.frame_hz > 0:
            raise ValueError(f"frame_hz must be > 0, got {self.frame_hz}")
        if not self.poll_timeout_s > 0:
            raise ValueError(f"poll_timeout_s must be > 0, got {self.poll_timeout_s}")


@dataclass(frozen=True, kw_only=True)
class ModelInfo:
    """What the evaluator needs to know about the served model."""

    name: str
    frames_per_chunk: int
    image_height: int
    image_width: int
    action_horizon: int
    action_dim: int
    action_mode: str
    """``none``, ``condition`` (fed the recorded commands) or ``predict`` (scored on them)."""


@dataclass
class WindowResult:
    """Per-window metrics, indexed by horizon step (1-based in reports). Over the link a
    "window" is one conditioning observation, and a step the server did not predict from it
    is None (in metrics and baselines alike, so both are averaged over the same steps)."""

    bag: str
    start_frame: int
    psnr: list[float | None]
    ssim: list[float | None]
    baseline_psnr: list[float | None]
    baseline_ssim: list[float | None]
    frame_mse: list[float | None]
    """Per horizon step: pixel MSE (0..255 units) of the prediction."""
    baseline_frame_mse: list[float | None]
    action_mse: list[float | None] | None
    baseline_action_mse: list[float | None] | None
    response_latency_ms: float
    """Last context submitted -> first predicted chunk decoded."""
    output_times_s: list[float]
    """time.monotonic() at which each predicted chunk was decoded."""
    chunk_latency_ms: list[float]
    """Per predicted chunk: entered the pipeline -> decoded."""
    anchor_frame: int = -1
    """The window's newest observed frame (what copy-last copies): with the bag, the key that
    pairs a window scored in process with the same window scored over the link."""
    observed: np.ndarray | None = None
    """[F_ctx + F_pred, H, W, 3] recorded frames (dropped once the strip plot has them)."""
    predicted: np.ndarray | None = None
    """[F_pred, H, W, 3] predicted frames (dropped likewise)."""


@dataclass
class EvalResult:
    """Everything a report needs."""

    model: ModelInfo
    config: EvalConfig
    windows: list[WindowResult] = field(default_factory=list)
    bags: list[dict] = field(default_factory=list)
    """Per bag: path, storage, frames, windows, skipped messages with reasons, notes."""
    skipped_bags: list[dict] = field(default_factory=list)
    """Bags not evaluated at all: path and reason."""
    skipped_windows: Counter = field(default_factory=Counter)
    """reason -> windows not scored."""
    strips: list[dict] = field(default_factory=list)
    """A few windows' observed and predicted frames for the strip plot."""
    wall_s: float = 0.0
    mode: str = "in-process"
    """``in-process`` (a StreamEngine in this process, window by window) or ``link`` (a
    physis-serve over gRPC, live semantics; see link_replay.py)."""
    window_set: dict[str, list[int]] = field(default_factory=dict)
    """Per bag: the anchor frames of its windows (``window_anchors``), scored or not."""
    output_sequences_s: list[list[float]] | None = None
    """Runs of consecutive outputs' times (s) whose differences are the intervals; None: each
    window's ``output_times_s`` (over the link: each stream's predictions)."""
    link: dict | None = None
    """Over the link: target, promise, per-hop latencies, drop counts, unscored predictions."""


def _check_windows_shape(ep: Episode, model: ModelInfo) -> None:
    h, w = ep.frames.shape[1:3]
    if (h, w) != (model.image_height, model.image_width):
        raise BagReadError(
            f"{ep.path}: frames are {h}x{w}, "
            f"the model needs {model.image_height}x{model.image_width}"
        )


def window_starts(n_frames: int, model: ModelInfo, cfg: EvalConfig) -> list[int]:
    """First frame of each evaluation window that fits in ``n_frames``."""
    f = model.frames_per_chunk
    span = (cfg.context_chunks + cfg.horizon_chunks) * f
    starts = list(range(0, n_frames - span + 1, cfg.window_stride_chunks * f))
    return starts[: cfg.max_windows_per_bag] if cfg.max_windows_per_bag else starts


def frames_in_use(ep: Episode, frames_per_chunk: int, cfg: EvalConfig) -> int:
    """How many of the episode's first frames the evaluation uses: those within
    ``max_seconds``, and with ``max_windows_per_bag`` no more than its windows span."""
    stamps = ep.frame_stamps_ns
    n = len(stamps)
    if cfg.max_seconds and n:
        limit = int(stamps[0]) + int(cfg.max_seconds * 1e9)
        n = int(np.searchsorted(stamps, limit, side="right"))
    if cfg.max_windows_per_bag:
        span = (cfg.context_chunks + cfg.horizon_chunks) * frames_per_chunk
        starts = range(0, n - span + 1, cfg.window_stride_chunks * frames_per_chunk)
        if len(starts) > cfg.max_windows_per_bag:
            n = starts[cfg.max_windows_per_bag - 1] + span
    return n


def window_anchors(ep: Episode, model: ModelInfo, cfg: EvalConfig) -> list[int]:
    """The window set: each window's anchor, its newest observed frame. Fixed by the bag and
    the configuration alone, so both modes score the same windows whatever their timing: in
    process each is a stream of its own; over the link it is the prediction anchored on that
    frame's slot (DESIGN.md §3.1)."""
    n = frames_in_use(ep, model.frames_per_chunk, cfg)
    last_observed = cfg.context_chunks * model.frames_per_chunk - 1
    return [start + last_observed for start in window_starts(n, model, cfg)]


def load_episodes(
    bag_paths: list[str | Path],
    model: ModelInfo,
    cfg: EvalConfig,
    result: EvalResult,
    *,
    topics: TopicChoice | None,
    require_commands: bool,
) -> list[Episode]:
    """The readable bags as episodes at the model's image size and frame rate; the others go
    to ``result.skipped_bags`` with the reason."""
    episodes: list[Episode] = []
    for path in bag_paths:
        try:
            ep = read_episode(
                path,
                topics=topics or TopicChoice(),
                image_size=(model.image_height, model.image_width),
                require_commands=require_commands,
            )
            _check_windows_shape(ep, model)
        except BagReadError as err:
            result.skipped_bags.append({"path": str(path), "reason": str(err)})
            continue
        stride = max(1, round(ep.frame_hz / cfg.frame_hz)) if ep.frame_hz > 0 else 1
        ep = ep.subsample(stride)
        if ep.frame_hz and abs(ep.frame_hz - cfg.frame_hz) > 0.1 * cfg.frame_hz:
            ep.notes.append(
                f"camera at {ep.frame_hz:.2f} Hz, model trained at {cfg.frame_hz:.2f} Hz"
            )
        episodes.append(ep)
    return episodes


def bag_entry(ep: Episode, n_windows: int) -> dict:
    """A bag's entry in the report: what it held, what was scored, what was skipped."""
    return {
        "path": ep.path,
        "storage": ep.storage,
        "image_topic": ep.image_topic,
        "command_topic": ep.command_topic,
        "frames": len(ep.frames),
        "frame_hz": round(ep.frame_hz, 3),
        "source_size": list(ep.source_size),
        "windows": n_windows,
        "skipped_messages": {f"{t}: {r}": n for (t, r), n in sorted(ep.skipped.items())},
        "notes": ep.notes,
    }


def evaluate(
    engine: StreamEngine,
    model: ModelInfo,
    bag_paths: list[str | Path],
    cfg: EvalConfig,
    *,
    topics: TopicChoice | None = None,
    progress: bool = True,
    strip_windows: int = 3,
) -> EvalResult:
    """Evaluate every window of every bag; bags that cannot be read are skipped with the reason."""

    t0 = time.perf_counter()
    result = EvalResult(model=model, config=cfg)
    episodes = load_episodes(
        bag_paths,
        model,
        cfg,
        result,
        topics=topics,
        require_commands=model.action_mode == "condition",
    )
    n_ctx_frames = cfg.context_chunks * model.frames_per_chunk
    for ep in episodes:
        result.window_set[ep.path] = window_anchors(ep, model, cfg)
    plan = [(ep, a + 1 - n_ctx_frames) for ep in episodes for a in result.window_set[ep.path]]
    per_bag_windows: Counter = Counter()
    window_index = 0
    for ep, start in tqdm(plan, desc="windows", unit="win", disable=not progress):
        try:
            win = _run_window(engine, model, cfg, ep, start, seed=cfg.seed + window_index)
        except TimeoutError as err:
            result.skipped_windows[f"timeout: {err}"] += 1
            continue
        finally:
            window_index += 1
        result.windows.append(win)
        per_bag_windows[ep.path] += 1
        if len(result.strips) < strip_windows and win.predicted is not None:
            result.strips.append(
                {
                    "bag": ep.path,
                    "start_frame": start,
                    "observed": win.observed,
                    "predicted": win.predicted,
                }
            )
        win.observed = win.predicted = None  # keep memory flat over long runs
    for ep in episodes:
        n_windows = per_bag_windows[ep.path]
        if n_windows == 0 and not result.window_set[ep.path]:
            ep.notes.append(too_short(ep, model, cfg))
        result.bags.append(bag_entry(ep, n_windows))
    result.wall_s = time.perf_counter() - t0
    return result


def too_short(ep: Episode, model: ModelInfo, cfg: EvalConfig) -> str:
    """The note on a bag that holds no window."""
    need = (cfg.context_chunks + cfg.horizon_chunks) * model.frames_per_chunk
    used = frames_in_use(ep, model.frames_per_chunk, cfg)
    within = f" within its first {cfg.max_seconds:g} s" if used < len(ep.frames) else ""
    return f"too short: {used} frames{within}, a window needs {need}"


def _run_window(
    engine: StreamEngine, model: ModelInfo, cfg: EvalConfig, ep: Episode, start: int, *, seed: int
) -> WindowResult:
    f, h_act = model.frames_per_chunk, model.action_horizon
    n_ctx, n_hor = cfg.context_chunks, cfg.horizon_chunks

    def chunk_actions(c: int) -> np.ndarray | None:
        if model.action_mode == "none" or not ep.has_commands:
            return None
        return ep.actions_for_chunk(start + c * f, f, h_act).astype(np.float32)

    sid = engine.open_stream(StreamSpec(seed=seed, horizon=n_hor)).stream_id
    outputs = []
    try:
        t_window = time.monotonic()
        stamp0 = int(ep.frame_stamps_ns[start])
        for c in range(n_ctx):
            first = start + c * f
            if cfg.realtime:
                # the chunk is observed once its last frame was captured
                due_s = (int(ep.frame_stamps_ns[first + f - 1]) - stamp0) / 1e9
                time.sleep(max(0.0, t_window + due_s - time.monotonic()))
            ctx_actions = chunk_actions(c) if model.action_mode == "condition" else None
            engine.submit_context(sid, ep.frames[first : first + f], ctx_actions)
        t_submit = time.monotonic()
        for c in range(n_ctx, n_ctx + n_hor):
            act = None
            if model.action_mode == "condition" and cfg.future_commands:
                act = chunk_actions(c)
            elif model.action_mode == "condition" and ep.has_commands:
                held = chunk_actions(n_ctx - 1)[-1]  # the newest command a server knows
                act = np.repeat(held[None], h_act, axis=0)
            engine.submit_generate(sid, act)
        deadline = t_submit + cfg.poll_timeout_s
        while len(outputs) < n_hor:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(
                    f"{len(outputs)}/{n_hor} chunks after {cfg.poll_timeout_s:.0f} s"
                )
            outputs.extend(o for o in engine.poll(min(remaining, 1.0)) if o.stream_id == sid)
    finally:
        engine.close_stream(sid)
    outputs.sort(key=lambda o: o.chunk)
    first_pred = start + n_ctx * f
    observed = ep.frames[first_pred : first_pred + n_hor * f]
    last_seen = ep.frames[first_pred - 1]
    predicted = None
    if outputs[0].frames is not None:
        predicted = np.concatenate([o.frames[:f] for o in outputs])
    res = WindowResult(
        bag=ep.path,
        start_frame=start,
        psnr=[],
        ssim=[],
        baseline_psnr=[psnr(last_seen, obs) for obs in observed],
        baseline_ssim=[ssim(last_seen, obs) for obs in observed],
        frame_mse=[],
        baseline_frame_mse=[mse(last_seen, obs) for obs in observed],
        action_mse=None,
        baseline_action_mse=None,
        response_latency_ms=(outputs[0].decoded_s - t_submit) * 1e3,
        output_times_s=[o.decoded_s for o in outputs],
        chunk_latency_ms=[(o.decoded_s - o.entered_s) * 1e3 for o in outputs],
        anchor_frame=first_pred - 1,
        observed=ep.frames[start : first_pred + n_hor * f],
        predicted=predicted,
    )
    if predicted is not None:
        res.psnr = [psnr(p, o) for p, o in zip(predicted, observed, strict=True)]
        res.ssim = [ssim(p, o) for p, o in zip(predicted, observed, strict=True)]
        res.frame_mse = [mse(p, o) for p, o in zip(predicted, observed, strict=True)]
    if model.action_mode != "none" and ep.has_commands:
        recorded = np.concatenate([chunk_actions(c) for c in range(n_ctx, n_ctx + n_hor)])
        held = chunk_actions(n_ctx - 1)[-1]
        res.baseline_action_mse = [mse(held, a) for a in recorded]
        if model.action_mode == "predict" and outputs[0].actions is not None:
            pred_actions = np.concatenate([o.actions for o in outputs])
            res.action_mse = [mse(p, a) for p, a in zip(pred_actions, recorded, strict=True)]
    return res
