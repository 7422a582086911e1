"""physis-eval over the link: replay bags into a running physis-serve and score what comes back.

The live timeline (DESIGN.md §3), not windows. Each bag frame i goes out through
``LinkClient`` as one ``Observation`` (seq i, capture stamp = the frame's bag stamp, action =
the command in force when it was captured), at the recorded timing (``realtime``) or as fast
as the server takes them (each slot's frames, then a wait for the prediction anchored on that
slot, so every slot is observed before the next and the schedule is the one a real-time
stream gets). The server puts frame i in slot i // F, enters each completed slot as its
observation and generates up to ``horizon`` slots ahead of it; the stream asks for the
horizon ``LinkOptions.horizons`` names (one stream per horizon per bag; none named: the
model's). Each prediction says its anchor (the observed slot it reads last, and that slot's
newest frame ``observation_seq``), its horizon j (chunks ahead of the anchor) and the frame
its first predicted frame stands for (``first_frame_seq``).

A report "window" is one anchor: its predictions are scored at their horizon against the
frames that followed, next to the copy-last-frame (frame ``observation_seq``) and
hold-last-command baselines of that anchor. Also measured: the anchoring lag (frames sent
after the anchor's newest frame by the time its prediction came back, and milliseconds from
sending that frame to the prediction) and the rate achieved (predictions and observed slots
per second of replay). No torch, no rclpy.
"""

from __future__ import annotations

import dataclasses
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field

import numpy as np

from physis_ros.eval.bag import Episode
from physis_ros.eval.evaluate import (
    EvalConfig,
    EvalResult,
    ModelInfo,
    WindowResult,
    bag_entry,
    load_episodes,
)
from physis_ros.eval.metrics import mse, psnr, ssim, summarize
from physis_ros.eval.previews import score_previews, summarize_previews
from physis_ros.link.client import LinkClient, LinkPromise, Observation, Prediction
from physis_ros.link.wire import rgb_image

REFUSALS = ("UNAUTHENTICATED", "PERMISSION_DENIED", "INVALID_ARGUMENT", "FAILED_PRECONDITION")
"""gRPC status codes (as the client's last error starts) that a retry cannot turn into a
stream; a full server (RESOURCE_EXHAUSTED) or an unreachable one may still come good."""
TLS_FAILURES = ("TLS handshake failed", "probably requires TLS")
"""The client's reasons (link.client) for a TLS mismatch: a retry fails the same way."""


def _final(error: str) -> bool:
    return error.startswith(REFUSALS) or any(t in error for t in TLS_FAILURES)


class LinkUnavailable(Exception):
    """The server cannot be reached, refuses the stream, or went away mid-replay."""


@dataclass(frozen=True, kw_only=True)
class LinkOptions:
    """Where the server is and how to talk to it."""

    target: str
    """host:port of physis-serve."""
    token: str | None = None
    root_cert_path: str | None = None
    client_cert_path: str | None = None
    client_key_path: str | None = None
    tls_server_name: str | None = None
    connect_timeout_s: float = 5.0
    """Longest wait for a stream to open (and for a lost one to come back)."""
    interval_ms: float = 0.0
    """Target interval the stream asks for (admission); 0: as fast as the server can."""
    max_seconds: float = 0.0
    """Bag seconds replayed per bag; 0: all of it."""
    horizons: tuple[int, ...] = ()
    """Replay each bag once per horizon, the stream asking for it; empty: the model's."""
    previews: bool = False
    """Streams ask for previews (each chunk's x0 estimate after every step but the last),
    scored apart (``previews.py``); the chunks are scored as without them."""
    rollouts: bool | None = None
    """Whether every observation generates the whole horizon again (None: the server's
    default, on for world models): then one stream scores every horizon up to its own."""

    def __post_init__(self) -> None:
        if not self.connect_timeout_s > 0:
            raise ValueError(f"connect_timeout_s must be > 0, got {self.connect_timeout_s}")
        if self.interval_ms < 0 or self.max_seconds < 0:
            raise ValueError(
                f"interval_ms {self.interval_ms} and max_seconds {self.max_seconds} must be >= 0"
            )
        if any(h < 1 for h in self.horizons):
            raise ValueError(f"horizons must be >= 1, got {list(self.horizons)}")


def make_client(opts: LinkOptions, *, seed: int, horizon: int = 0) -> LinkClient:
    return LinkClient(
        opts.target,
        seed=seed,
        horizon=horizon,
        previews=opts.previews,
        rollouts=opts.rollouts,
        target_interval_ms=opts.interval_ms,
        token=opts.token,
        root_cert_path=opts.root_cert_path,
        client_cert_path=opts.client_cert_path,
        client_key_path=opts.client_key_path,
        tls_server_name=opts.tls_server_name,
        connect_timeout_s=opts.connect_timeout_s,
        client_name="physis-eval",
        # the replay reads between sends; a deep queue loses nothing in a slow moment
        prediction_queue_size=4096,
    )


def wait_streaming(client: LinkClient, opts: LinkOptions) -> LinkPromise:
    """Starts ``client`` and waits for its stream to open; LinkUnavailable (with the server's
    or gRPC's reason) when it has not within the connect timeout plus a grace second."""
    client.start()
    deadline = time.monotonic() + opts.connect_timeout_s + 1.0
    while time.monotonic() < deadline:
        st = client.stats()
        if st.state == "streaming" and st.promise is not None:
            return st.promise
        if _final(st.last_error):
            break  # retrying will not change the answer
        time.sleep(0.02)
    st = client.stats()
    client.close(timeout_s=2.0)
    if st.last_error.startswith(REFUSALS):
        raise LinkUnavailable(f"physis-serve at {opts.target} refused the stream: {st.last_error}")
    if _final(st.last_error):
        raise LinkUnavailable(f"no stream from physis-serve: {st.last_error}")
    raise LinkUnavailable(
        f"no stream from physis-serve at {opts.target} within {opts.connect_timeout_s:g} s: "
        f"{st.last_error or st.state}"
    )


def probe(opts: LinkOptions) -> LinkPromise:
    """What the server promises a stream (model, image size, chunk frames): opened, closed."""
    client = make_client(opts, seed=0)
    promise = wait_streaming(client, opts)
    client.close(timeout_s=2.0)
    return promise


def model_info(promise: LinkPromise, action_mode: str) -> ModelInfo:
    return ModelInfo(
        name=promise.model,
        frames_per_chunk=promise.chunk_frames,
        image_height=promise.image_height,
        image_width=promise.image_width,
        action_horizon=promise.action_horizon,
        action_dim=promise.action_dim,
        action_mode=action_mode,
    )


@dataclass
class BagReplay:
    """What one bag's replay on one stream brought back."""

    horizon: int = 0
    """The horizon the stream asked for (0: the model's)."""
    frames_sent: int = 0
    sent_ns: dict[int, int] = field(default_factory=dict)
    """seq -> wall clock (ns, the client's clock) when it was handed to the client."""
    predictions: list[Prediction] = field(default_factory=list)
    previews: list[Prediction] = field(default_factory=list)
    """Previews of its chunks (``LinkOptions.previews``), kept apart from the predictions."""
    newest_sent: list[int] = field(default_factory=list)
    """Per prediction (same order): the newest seq handed to the client when it came."""
    drops: dict[str, int] = field(default_factory=dict)
    """The client's counts at the end: ``client:<reason>`` and ``server:<reason>``."""
    observed_chunks: int = 0
    """Slots the server observed (its counters at the end)."""
    wall_s: float = 0.0
    connections: int = 0
    notes: list[str] = field(default_factory=list)


def command_at(ep: Episode, frame: int) -> np.ndarray | None:
    """[A] the command in force just before ``frame`` was captured (what the robot sends)."""
    return ep.actions_for_chunk(frame, 1, 1)[0] if ep.has_commands else None


class _Stream:
    """One bag's stream: sends frames, takes predictions, watches the link."""

    def __init__(self, client: LinkClient, opts: LinkOptions, out: BagReplay, horizon: int) -> None:
        self.client, self.opts, self.out = client, opts, out
        self.horizon = horizon
        self.newest_anchor = -1
        self.newest_complete = -1
        """The newest anchor whose prediction at the stream's horizon came (the last of its
        rollout, with rollouts)."""
        self.lost_since: float | None = None

    def take(self, timeout_s: float) -> None:
        p = self.client.get_prediction(timeout_s)
        while p is not None:
            if p.preview_steps:
                self.out.previews.append(p)
                p = self.client.get_prediction(0.0)
                continue
            self.out.predictions.append(p)
            self.out.newest_sent.append(self.out.frames_sent - 1)
            self.newest_anchor = max(self.newest_anchor, p.anchor_slot)
            if p.horizon >= self.horizon:
                self.newest_complete = max(self.newest_complete, p.anchor_slot)
            p = self.client.get_prediction(0.0)

    def check_link(self) -> None:
        st = self.client.stats()
        if st.state == "streaming":
            self.lost_since = None
        elif self.lost_since is None:
            self.lost_since = time.monotonic()
        elif time.monotonic() - self.lost_since > self.opts.connect_timeout_s + 1.0:
            raise LinkUnavailable(f"lost physis-serve at {self.opts.target}: {st.last_error}")

    def wait(self, done, what: str, timeout_s: float) -> None:
        """Take predictions until ``done()`` or the server counts a drop; TimeoutError after
        ``timeout_s``."""
        drops_before = self.server_drops()
        deadline = time.monotonic() + timeout_s
        while not done() and self.server_drops() == drops_before:
            if time.monotonic() > deadline:
                raise TimeoutError(f"no {what} in {timeout_s:g} s")
            self.check_link()
            self.take(0.02)

    def server_drops(self) -> int:
        return sum(v for k, v in self.client.stats().drops.items() if k.startswith("server:"))


def replay_bag(
    ep: Episode, opts: LinkOptions, cfg: EvalConfig, *, seed: int, send_actions: bool, horizon=0
) -> BagReplay:
    """Streams ``ep``'s frames to the server on a stream of its own (asking for ``horizon``
    chunks ahead; 0: the model's) and collects every prediction. Capture stamps are the bag
    stamps moved onto this host's clock by one offset per bag (frame 0 is "captured" when the
    replay starts), so that in realtime the capture-to-receive latency means what it means
    for a robot."""
    stamps = ep.frame_stamps_ns
    n = len(stamps)
    if opts.max_seconds:
        n = int(np.searchsorted(stamps, stamps[0] + int(opts.max_seconds * 1e9), side="right"))
    out = BagReplay(horizon=horizon)
    client = make_client(opts, seed=seed, horizon=horizon)
    promise = wait_streaming(client, opts)
    frames_per_slot = max(promise.chunk_frames, 1)
    stream = _Stream(client, opts, out, promise.horizon)
    play_offset_ns = time.time_ns() - int(stamps[0])
    t_play_s = time.monotonic()
    try:
        for i in range(n):
            stream.check_link()
            if cfg.realtime:
                due_s = t_play_s + (int(stamps[i]) - int(stamps[0])) / 1e9
                while (wait_s := due_s - time.monotonic()) > 0:
                    stream.take(min(wait_s, 0.05))
            else:  # never two waiting in the client (it would keep the newest only)
                sent = out.frames_sent
                stream.wait(
                    lambda sent=sent: client.stats().observations_sent >= sent,
                    "send of the previous frame",
                    cfg.poll_timeout_s,
                )
            client.send_observation(
                Observation(
                    seq=i,
                    capture_stamp_ns=int(stamps[i]) + play_offset_ns,
                    image=rgb_image(ep.frames[i]),
                    action=command_at(ep, i) if send_actions else None,
                )
            )
            out.sent_ns[i] = time.time_ns()
            out.frames_sent = i + 1
            slot, last_of_slot = divmod(i + 1, frames_per_slot)
            if not cfg.realtime and last_of_slot == 0:  # its slot is observed: wait for it
                stream.wait(
                    lambda s=slot - 1: stream.newest_anchor >= s,
                    f"prediction anchored on slot {slot - 1}",
                    cfg.poll_timeout_s,
                )
        # the chunks still in flight, up to those anchored on the last full slot (with
        # rollouts, its whole rollout)
        last = n // frames_per_slot - 1
        newest = (
            (lambda: stream.newest_complete) if promise.rollouts else (lambda: stream.newest_anchor)
        )
        stream.wait(lambda: newest() >= last, "last prediction", cfg.poll_timeout_s)
    except TimeoutError as err:
        out.notes.append(f"replay stopped after {out.frames_sent} frames: {err}")
    finally:
        out.wall_s = time.monotonic() - t_play_s
        st = client.stats()
        client.close(timeout_s=2.0)
        stream.take(0.0)
    out.drops, out.connections = dict(st.drops), st.connections
    if st.connections > 1:
        out.notes.append(f"the stream was reopened {st.connections - 1} time(s): {st.last_error}")
    if n < len(stamps):
        out.notes.append(f"replayed the first {n} of {len(stamps)} frames (max_seconds)")
    return out


def score_bag(
    ep: Episode, replay: BagReplay, model: ModelInfo, cfg: EvalConfig
) -> tuple[list[WindowResult], Counter, list[dict]]:
    """One WindowResult per anchor with a scored prediction, the unscored predictions by
    reason, and strip-plot rows (anchors with predictions from horizon 1 on)."""
    f, h_act = model.frames_per_chunk, model.action_horizon
    n_steps, n_act_steps = cfg.horizon_chunks * f, cfg.horizon_chunks * h_act
    by_seq: dict[int, list[Prediction]] = defaultdict(list)
    unscored: Counter = Counter()
    for p in replay.predictions:
        if p.observation_seq < 0 or p.horizon < 1:
            unscored["no anchor (no observation yet)"] += 1
        elif p.horizon > cfg.horizon_chunks:
            unscored[f"beyond the evaluated horizon ({cfg.horizon_chunks} chunks)"] += 1
        elif p.first_frame_seq < 0 or p.first_frame_seq + f > len(ep.frames):
            unscored["predicts past the end of the bag"] += 1
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


def evaluate_link(
    opts: LinkOptions,
    bag_paths: list,
    cfg: EvalConfig,
    *,
    topics=None,
    progress: bool = True,
    strip_windows: int = 3,
) -> EvalResult:
    """Replay every readable bag over the link (one stream per bag and horizon) and score it;
    bags that cannot be read are skipped with the reason; LinkUnavailable when the server is
    not there."""
    from tqdm import tqdm

    t0 = time.perf_counter()
    promise = probe(opts)
    action_mode = promise.action_mode or ("none" if promise.action_dim == 0 else "condition")
    model = model_info(promise, action_mode)
    result = EvalResult(model=model, config=cfg, mode="link", output_sequences_s=[])
    episodes = load_episodes(
        bag_paths, model, cfg, result, topics=topics, require_commands=promise.action_dim > 0
    )
    horizons = opts.horizons or (0,)
    hops: dict[str, list[float]] = defaultdict(list)
    drops: Counter = Counter()
    unscored_all: Counter = Counter()
    lag: dict[str, list[float]] = {"frames": [], "ms": []}
    received = connections = observed = 0
    previews: list[dict] = []
    replay_s = 0.0
    runs = [(ep, h) for ep in episodes for h in horizons]
    for index, (ep, horizon) in enumerate(tqdm(runs, desc="streams", disable=not progress)):
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
        windows, unscored, strips = score_bag(ep, replay, model, cfg)
        if opts.previews:
            previews.append(score_previews(ep, replay.previews, replay.predictions))
        result.windows.extend(windows)
        result.strips.extend(strips[: max(0, strip_windows - len(result.strips))])
        result.output_sequences_s.extend(stream_output_times(replay))
        for p in replay.predictions:
            if p.observation_seq < 0:
                continue
            for name, ms in p.hop_ms.items():
                # capture stamps only mean capture times when frames go out at their timing
                if cfg.realtime or name != "capture_to_received":
                    hops[name].append(ms)
        for key, values in anchoring(replay).items():
            lag[key] += values
        drops.update(replay.drops)
        unscored_all.update(unscored)
        received += len(replay.predictions)
        observed += replay.frames_sent // max(model.frames_per_chunk, 1)
        replay_s += replay.wall_s
        connections += replay.connections
        ep.notes.extend(replay.notes)
        result.bags.append(bag_entry(ep, len(windows)))
    result.link = {
        "target": opts.target,
        "requested_interval_ms": opts.interval_ms,
        "horizons": list(opts.horizons) or [promise.horizon],
        "promise": dataclasses.asdict(promise),
        "streams_opened": connections,
        "predictions_received": received,
        "predictions_scored": sum(len(w.output_times_s) for w in result.windows),
        "unscored_predictions": dict(unscored_all),
        "hop_ms": {name: summarize(v) for name, v in sorted(hops.items())},
        "anchoring_lag_frames": summarize(lag["frames"]),
        "anchoring_lag_ms": summarize(lag["ms"]),
        "rate": {
            "replay_s": round(replay_s, 3),
            "predictions_per_s": received / replay_s if replay_s else None,
            "observed_slots_per_s": observed / replay_s if replay_s else None,
        },
        "drops": dict(sorted(drops.items())),
        "window": "one anchor (observed slot): its predictions 1.. chunks ahead of it",
    }
    if opts.previews:
        result.link["previews"] = summarize_previews(previews, promise.steps)
    result.wall_s = time.perf_counter() - t0
    return result
