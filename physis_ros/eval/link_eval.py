"""physis-eval over the link: score what a replayed bag's stream brought back.

A report "window" is one anchor of the window set (``evaluate.window_anchors``, the same
windows an in-process run scores): the predictions anchored on that frame's slot are scored
at their horizon against the frames that followed, next to the copy-last-frame (the anchor
frame) and hold-last-command baselines. Predictions anchored elsewhere (every observed slot
is an anchor on a served stream) are counted, not scored, so the server's timing cannot
change which windows are scored, only whether a window's prediction came. Also measured: the
anchoring lag (frames sent after the anchor's newest frame by the time its prediction came
back, and milliseconds from sending that frame to the prediction) and the rate achieved
(predictions and observed slots per second of replay). No torch, no rclpy.
"""

from __future__ import annotations

import dataclasses
import time
from collections import Counter, defaultdict

import numpy as np
from tqdm import tqdm

from physis_ros.eval.bag import Episode
from physis_ros.eval.evaluate import (
    EvalConfig,
    EvalResult,
    ModelInfo,
    WindowResult,
    bag_entry,
    load_episodes,
    too_short,
    window_anchors,
)
from physis_ros.eval.link_replay import (
    BagReplay,
    ReplayLink,
    command_at,
    model_info,
    probe,
    replay_bag,
)
from physis_ros.eval.metrics import mse, psnr, ssim, summarize
from physis_ros.eval.previews import score_previews, summarize_previews
from physis_ros.link.client import LinkPromise, Prediction

OUTSIDE_THE_WINDOW_SET = "anchored outside the window set"
"""Why a prediction on an anchor that is no window's goes unscored."""


def _unscored_reason(
    p: Prediction, ep: Episode, f: int, cfg: EvalConfig, anchors: set[int] | None
) -> str:
    """Why ``p`` is not scored ("" when it is)."""
    if p.observation_seq < 0 or p.horizon < 1:
        return "no anchor (no observation yet)"
    if anchors is not None and p.observation_seq not in anchors:
        if (p.anchor_slot + 1) * f - 1 in anchors:
            # the window's slot was observed without its last frame (filled or incomplete)
            return "anchored on a window's slot without its last frame"
        return OUTSIDE_THE_WINDOW_SET
    if p.horizon > cfg.horizon_chunks:
        return f"beyond the evaluated horizon ({cfg.horizon_chunks} chunks)"
    if p.first_frame_seq < 0 or p.first_frame_seq + f > len(ep.frames):
        return "predicts past the end of the bag"
    return ""


def score_bag(
    ep: Episode,
    replay: BagReplay,
    model: ModelInfo,
    cfg: EvalConfig,
    anchors: list[int] | None = None,
) -> tuple[list[WindowResult], Counter, list[dict]]:
    """One WindowResult per anchor with a scored prediction, the unscored predictions by
    reason, and strip-plot rows (anchors with predictions from horizon 1 on). ``anchors``:
    the window set's anchor frames, the only ones scored (None: every anchor)."""
    f, h_act = model.frames_per_chunk, model.action_horizon
    n_steps, n_act_steps = cfg.horizon_chunks * f, cfg.horizon_chunks * h_act
    by_seq: dict[int, list[Prediction]] = defaultdict(list)
    unscored: Counter = Counter()
    wanted = None if anchors is None else set(anchors)
    for p in replay.predictions:
        reason = _unscored_reason(p, ep, f, cfg, wanted)
        if reason:
            unscored[reason] += 1
        else:
            by_seq[p.observation_seq].append(p)
    actions = model.action_mode != "none" and ep.has_commands
    has_frames = any(p.frames is not None for p in replay.predictions)
    windows, strips = [], []
    for s, items in sorted(by_seq.items()):
        last_seen = ep.frames[s]
        nones = lambda k: [None] * k  # noqa: E731
        win = WindowResult(
            bag=ep.path,
            start_frame=s,
            psnr=nones(n_steps) if has_frames else [],
            ssim=nones(n_steps) if has_frames else [],
            baseline_psnr=nones(n_steps),
            baseline_ssim=nones(n_steps),
            frame_mse=nones(n_steps) if has_frames else [],
            baseline_frame_mse=nones(n_steps),
            action_mse=nones(n_act_steps) if model.action_mode == "predict" else None,
            baseline_action_mse=nones(n_act_steps) if actions else None,
            response_latency_ms=(min(p.received_ns for p in items) - replay.sent_ns[s]) / 1e6,
            output_times_s=[p.received_ns / 1e9 for p in items],
            chunk_latency_ms=[
                (p.server_times_ns["decoded"] - p.server_times_ns["entered"]) / 1e6 for p in items
            ],
            anchor_frame=s,
        )
        for p in items:
            h, first = p.horizon, p.first_frame_seq
            for i in range(f):
                j, obs = (h - 1) * f + i, ep.frames[first + i]
                win.baseline_psnr[j] = psnr(last_seen, obs)
                win.baseline_ssim[j] = ssim(last_seen, obs)
                win.baseline_frame_mse[j] = mse(last_seen, obs)
                if p.frames is not None and win.psnr:
                    win.psnr[j] = psnr(p.frames[i], obs)
                    win.ssim[j] = ssim(p.frames[i], obs)
                    win.frame_mse[j] = mse(p.frames[i], obs)
            if actions:
                recorded = ep.actions_for_chunk(first, f, h_act)
                held = command_at(ep, s)
                for i in range(h_act):
                    j = (h - 1) * h_act + i
                    win.baseline_action_mse[j] = mse(held, recorded[i])
                    if win.action_mse is not None and p.actions is not None:
                        win.action_mse[j] = mse(p.actions[i], recorded[i])
        windows.append(win)
        ahead = sorted(p.horizon for p in items)
        run = next((k for k in range(len(ahead)) if ahead[k] != k + 1), len(ahead))
        if run and s + 1 >= f and has_frames:
            pred = {p.horizon: p for p in items}
            strips.append(
                {
                    "bag": ep.path,
                    "start_frame": s + 1 - f,
                    "observed": ep.frames[s + 1 - f : s + 1 + run * f],
                    "predicted": np.concatenate([pred[h].frames[:f] for h in range(1, run + 1)]),
                }
            )
    return windows, unscored, strips


def anchoring(replay: BagReplay) -> dict[str, list[float]]:
    """Per anchored prediction: frames sent after its anchor's newest frame by the time it
    came back, and ms from sending that frame to receiving the prediction."""
    lag_frames, lag_ms = [], []
    for p, newest in zip(replay.predictions, replay.newest_sent, strict=True):
        if p.observation_seq >= 0 and p.observation_seq in replay.sent_ns:
            lag_frames.append(float(newest - p.observation_seq))
            lag_ms.append((p.received_ns - replay.sent_ns[p.observation_seq]) / 1e6)
    return {"frames": lag_frames, "ms": lag_ms}


def stream_output_times(replay: BagReplay) -> list[list[float]]:
    """The receive times (s) of the stream's deliveries: per anchor its first prediction (with
    rollouts the rest of an anchor's rollout is not a new delivery), in anchor order."""
    first: dict[int, int] = {}
    for p in replay.predictions:
        if p.observation_seq >= 0:
            first[p.anchor_slot] = min(first.get(p.anchor_slot, p.received_ns), p.received_ns)
    return [[first[a] / 1e9 for a in sorted(first)]]


class _LinkTally:
    """What the streams of a run add up to, for the report's ``link`` entry."""

    def __init__(self) -> None:
        self.hops: dict[str, list[float]] = defaultdict(list)
        self.drops: Counter = Counter()
        self.unscored: Counter = Counter()
        self.lag: dict[str, list[float]] = {"frames": [], "ms": []}
        self.received = self.connections = self.observed = 0
        self.previews: list[dict] = []
        self.replay_s = 0.0

    def add(self, replay: BagReplay, unscored: Counter, cfg: EvalConfig, f: int) -> None:
        for p in replay.predictions:
            if p.observation_seq < 0:
                continue
            for name, ms in p.hop_ms.items():
                # capture stamps only mean capture times when frames go out at their timing
                if cfg.realtime or name != "capture_to_received":
                    self.hops[name].append(ms)
        for key, values in anchoring(replay).items():
            self.lag[key] += values
        self.drops.update(replay.drops)
        self.unscored.update(unscored)
        self.received += len(replay.predictions)
        self.observed += replay.frames_sent // max(f, 1)
        self.replay_s += replay.wall_s
        self.connections += replay.connections

    def entry(self, opts: ReplayLink, promise: LinkPromise, result: EvalResult) -> dict:
        rate = self.replay_s or None
        entry = {
            "target": opts.target,
            "requested_interval_ms": opts.link.target_interval_ms,
            "horizons": list(opts.horizons) or [promise.horizon],
            "promise": dataclasses.asdict(promise),
            "streams_opened": self.connections,
            "predictions_received": self.received,
            "predictions_scored": sum(len(w.output_times_s) for w in result.windows),
            "unscored_predictions": dict(self.unscored),
            "hop_ms": {name: summarize(v) for name, v in sorted(self.hops.items())},
            "anchoring_lag_frames": summarize(self.lag["frames"]),
            "anchoring_lag_ms": summarize(self.lag["ms"]),
            "rate": {
                "replay_s": round(self.replay_s, 3),
                "predictions_per_s": self.received / rate if rate else None,
                "observed_slots_per_s": self.observed / rate if rate else None,
            },
            "drops": dict(sorted(self.drops.items())),
            "window": "one anchor of the window set (an observed slot's newest frame): its "
            "predictions 1.. chunks ahead of it",
        }
        if opts.link.previews:
            entry["previews"] = summarize_previews(self.previews, promise.steps)
        return entry


def evaluate_link(
    opts: ReplayLink,
    bag_paths: list,
    cfg: EvalConfig,
    *,
    topics=None,
    progress: bool = True,
    strip_windows: int = 3,
) -> EvalResult:
    """Replay every readable bag over the link (one stream per bag and horizon) and score its
    window set; bags that cannot be read are skipped with the reason; LinkUnavailable when
    the server is not there."""

    t0 = time.perf_counter()
    promise = probe(opts)
    action_mode = promise.action_mode or ("none" if promise.action_dim == 0 else "condition")
    model = model_info(promise, action_mode)
    result = EvalResult(model=model, config=cfg, mode="link", output_sequences_s=[])
    episodes = load_episodes(
        bag_paths, model, cfg, result, topics=topics, require_commands=promise.action_dim > 0
    )
    for ep in episodes:
        result.window_set[ep.path] = window_anchors(ep, model, cfg)
    tally = _LinkTally()
    runs = [(ep, h) for ep in episodes for h in opts.horizons or (0,)]
    scored: Counter = Counter()
    for index, (ep, horizon) in enumerate(tqdm(runs, desc="streams", disable=not progress)):
        if not result.window_set[ep.path]:
            continue  # nothing of it would be scored
        replay = replay_bag(
            ep,
            opts,
            cfg,
            seed=cfg.seed + index,
            send_actions=promise.action_dim > 0,
            horizon=horizon,
        )
        if any(p.actions is not None for p in replay.predictions) and action_mode != "predict":
            action_mode = "predict"
            result.model = model = model_info(promise, action_mode)
        windows, unscored, strips = score_bag(ep, replay, model, cfg, result.window_set[ep.path])
        if opts.link.previews:
            tally.previews.append(score_previews(ep, replay.previews, replay.predictions))
        result.windows.extend(windows)
        scored[ep.path] += len(windows)
        result.strips.extend(strips[: max(0, strip_windows - len(result.strips))])
        result.output_sequences_s.extend(stream_output_times(replay))
        tally.add(replay, unscored, cfg, model.frames_per_chunk)
        ep.notes.extend(replay.notes)
    for ep in episodes:
        if not result.window_set[ep.path]:
            ep.notes.append(too_short(ep, model, cfg))
        result.bags.append(bag_entry(ep, scored[ep.path]))
    result.link = tally.entry(opts, promise, result)
    result.wall_s = time.perf_counter() - t0
    return result
