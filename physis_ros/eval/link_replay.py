"""physis-eval over the link: replay bags into a running physis-serve and score what comes back.

Live semantics, not windows. Each bag frame i goes out through ``LinkClient`` as one
``Observation`` (seq i, capture stamp = the frame's bag stamp, action = the command in force
when it was captured), at the recorded timing (``realtime``) or as fast as the server takes
them (the next one once a prediction conditioned on the previous one came back, so none is
superseded). The server's EngineLoop paces generation: before a generate request it puts the
newest observation in as a context chunk (its stream's newest ``chunk_frames`` frames), and
each prediction names the observation it is conditioned on (``observation_seq``).

Horizon of a prediction. A stream's context chunks and generate requests share one chunk
counter (``submit_context`` and ``submit_generate`` each take the next index), and the server
puts a context chunk in right before the generate request conditioned on it; later generate
requests keep that conditioning until the next context chunk. So the chunks conditioned on
observation s are a run ctx+1, ctx+2, ... right after s's context chunk ctx, and the chunk at
index c is h = c - ctx chunks ahead: it predicts bag frames s + (h-1)F + 1 .. s + hF (F frames
per chunk). ctx is the run's first index minus 1, known exactly when the previous prediction
received (conditioned on an earlier observation, or on none) sits two indices before the run's
first: the one index between is the context chunk. A wider gap means predictions were lost
(``client_slow``, ``prediction_queue_full``): that run's horizon is unknown and not scored.

Each scored prediction is compared with the frames that followed its observation in the bag,
and with the copy-last-frame / hold-last-command baselines of that observation, per horizon
step; a report "window" is one conditioning observation. No torch, no rclpy.
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
from physis_ros.link.client import LinkClient, LinkPromise, Observation, Prediction
from physis_ros.link.wire import rgb_image

REFUSALS = ("UNAUTHENTICATED", "PERMISSION_DENIED", "INVALID_ARGUMENT", "FAILED_PRECONDITION")
"""gRPC status codes (as the client's last error starts) that a retry cannot turn into a
stream; a full server (RESOURCE_EXHAUSTED) or an unreachable one may still come good."""


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
    """Target interval the stream asks for; 0: as fast as the server can generate."""
    max_seconds: float = 0.0
    """Bag seconds replayed per bag; 0: all of it."""

    def __post_init__(self) -> None:
        if not self.connect_timeout_s > 0:
            raise ValueError(f"connect_timeout_s must be > 0, got {self.connect_timeout_s}")
        if self.interval_ms < 0 or self.max_seconds < 0:
            raise ValueError(
                f"interval_ms {self.interval_ms} and max_seconds {self.max_seconds} must be >= 0"
            )


def make_client(opts: LinkOptions, *, seed: int) -> LinkClient:
    return LinkClient(
        opts.target,
        seed=seed,
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
        if st.last_error.startswith(REFUSALS):
            break  # retrying will not change the answer
        time.sleep(0.02)
    st = client.stats()
    client.close(timeout_s=2.0)
    if st.last_error.startswith(REFUSALS):
        raise LinkUnavailable(f"physis-serve at {opts.target} refused the stream: {st.last_error}")
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
    """What one bag's replay brought back."""

    frames_sent: int = 0
    sent_ns: dict[int, int] = field(default_factory=dict)
    """seq -> wall clock (ns, the client's clock) when it was handed to the client."""
    predictions: list[Prediction] = field(default_factory=list)
    drops: dict[str, int] = field(default_factory=dict)
    """The client's counts at the end: ``client:<reason>`` and ``server:<reason>``."""
    connections: int = 0
    notes: list[str] = field(default_factory=list)


def command_at(ep: Episode, frame: int) -> np.ndarray | None:
    """[A] the command in force just before ``frame`` was captured (what the robot sends)."""
    return ep.actions_for_chunk(frame, 1, 1)[0] if ep.has_commands else None


def replay_bag(
    ep: Episode, opts: LinkOptions, cfg: EvalConfig, *, seed: int, send_actions: bool
) -> BagReplay:
    """Streams ``ep``'s frames to the server on a stream of its own and collects every
    prediction. Capture stamps are the bag stamps moved onto this host's clock by one offset
    per bag (frame 0 is "captured" when the replay starts), so that in realtime the server's
    capture-to-receive latency means what it means for a robot."""
    stamps = ep.frame_stamps_ns
    n = len(stamps)
    if opts.max_seconds:
        n = int(np.searchsorted(stamps, stamps[0] + int(opts.max_seconds * 1e9), side="right"))
    out = BagReplay()
    client = make_client(opts, seed=seed)
    wait_streaming(client, opts)
    play_offset_ns = time.time_ns() - int(stamps[0])
    t_play_s = time.monotonic()
    newest_seq = [-1]
    lost_since = [None]

    def take(timeout_s: float) -> None:
        p = client.get_prediction(timeout_s)
        while p is not None:
            out.predictions.append(p)
            newest_seq[0] = max(newest_seq[0], p.observation_seq)
            p = client.get_prediction(0.0)

    def check_link() -> None:
        st = client.stats()
        if st.state == "streaming":
            lost_since[0] = None
        elif lost_since[0] is None:
            lost_since[0] = time.monotonic()
        elif time.monotonic() - lost_since[0] > opts.connect_timeout_s + 1.0:
            raise LinkUnavailable(f"lost physis-serve at {opts.target}: {st.last_error}")

    def server_drops() -> int:
        return sum(v for k, v in client.stats().drops.items() if k.startswith("server:"))

    def wait_used(seq: int) -> None:
        """Until a prediction conditioned on ``seq`` came back (in chunk order, so every
        chunk conditioned on an earlier one is in too) or the server counted a drop."""
        drops_before = server_drops()
        deadline = time.monotonic() + cfg.poll_timeout_s
        while newest_seq[0] < seq and server_drops() == drops_before:
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"no prediction conditioned on observation {seq} in {cfg.poll_timeout_s:g} s"
                )
            check_link()
            take(0.05)

    try:
        for i in range(n):
            check_link()
            if cfg.realtime:
                due_s = t_play_s + (int(stamps[i]) - int(stamps[0])) / 1e9
                while (wait_s := due_s - time.monotonic()) > 0:
                    take(min(wait_s, 0.05))
            elif i > 0:
                wait_used(i - 1)  # as fast as the server takes them: none superseded
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
        # the chunks still in flight, up to the first conditioned on the last observation
        wait_used(n - 1)
    except TimeoutError as err:
        out.notes.append(f"replay stopped after {out.frames_sent} frames: {err}")
    finally:
        st = client.stats()
        client.close(timeout_s=2.0)
        take(0.0)
    out.drops, out.connections = dict(st.drops), st.connections
    if st.connections > 1:
        out.notes.append(f"the stream was reopened {st.connections - 1} time(s): {st.last_error}")
    if n < len(stamps):
        out.notes.append(f"replayed the first {n} of {len(stamps)} frames (max_seconds)")
    return out


def horizons(predictions: list[Prediction]) -> tuple[list[tuple[Prediction, int]], Counter]:
    """(prediction, chunks ahead of its observation) where that is known (module docstring),
    and the count of the others by reason."""
    known: list[tuple[Prediction, int]] = []
    unscored: Counter = Counter()
    streams: dict[int, list[Prediction]] = defaultdict(list)
    for p in predictions:
        streams[p.stream_id].append(p)
    for preds in streams.values():
        prev_chunk, prev_seq, ctx = -1, -1, None  # a stream's chunk indices start at 0
        for p in sorted(preds, key=lambda p: p.chunk_index):
            if p.observation_seq != prev_seq:
                ctx = p.chunk_index - 1 if p.chunk_index - prev_chunk == 2 else None
            prev_chunk, prev_seq = p.chunk_index, p.observation_seq
            if p.observation_seq < 0:
                unscored["unconditioned (no observation yet)"] += 1
            elif ctx is None:
                unscored["horizon unknown (predictions before it were lost)"] += 1
            else:
                known.append((p, p.chunk_index - ctx))
    return known, unscored


def score_bag(
    ep: Episode, replay: BagReplay, model: ModelInfo, cfg: EvalConfig
) -> tuple[list[WindowResult], Counter, list[dict]]:
    """One WindowResult per conditioning observation with a scored prediction, the unscored
    predictions by reason, and strip-plot rows (observations predicted from h = 1 on)."""
    f, h_act = model.frames_per_chunk, model.action_horizon
    n_steps, n_act_steps = cfg.horizon_chunks * f, cfg.horizon_chunks * h_act
    known, unscored = horizons(replay.predictions)
    by_seq: dict[int, list[tuple[Prediction, int]]] = defaultdict(list)
    first_received: dict[int, int] = {}
    for p in replay.predictions:
        if p.observation_seq >= 0:
            s = p.observation_seq
            first_received[s] = min(first_received.get(s, p.received_ns), p.received_ns)
    for p, h in known:
        if h > cfg.horizon_chunks:
            unscored[f"beyond the evaluated horizon ({cfg.horizon_chunks} chunks)"] += 1
        elif p.observation_seq + h * f >= len(ep.frames):
            unscored["predicts past the end of the bag"] += 1
        else:
            by_seq[p.observation_seq].append((p, h))
    actions = model.action_mode != "none" and ep.has_commands
    windows, strips = [], []
    for s, items in sorted(by_seq.items()):
        last_seen = ep.frames[s]
        nones = lambda k: [None] * k  # noqa: E731
        win = WindowResult(
            bag=ep.path,
            start_frame=s,
            psnr=nones(n_steps) if items[0][0].frames is not None else [],
            ssim=nones(n_steps) if items[0][0].frames is not None else [],
            baseline_psnr=nones(n_steps),
            baseline_ssim=nones(n_steps),
            frame_mse=nones(n_steps) if items[0][0].frames is not None else [],
            baseline_frame_mse=nones(n_steps),
            action_mse=nones(n_act_steps) if model.action_mode == "predict" else None,
            baseline_action_mse=nones(n_act_steps) if actions else None,
            response_latency_ms=(first_received[s] - replay.sent_ns[s]) / 1e6,
            output_times_s=[p.received_ns / 1e9 for p, _ in items],
            chunk_latency_ms=[
                (p.server_times_ns["decoded"] - p.server_times_ns["entered"]) / 1e6
                for p, _ in items
            ],
        )
        for p, h in items:
            first = s + (h - 1) * f + 1
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
        ahead = sorted(h for _, h in items)
        run = next((k for k in range(len(ahead)) if ahead[k] != k + 1), len(ahead))
        if run and s + 1 >= f and items[0][0].frames is not None:
            pred = {h: p for p, h in items}
            strips.append(
                {
                    "bag": ep.path,
                    "start_frame": s + 1 - f,
                    "observed": ep.frames[s + 1 - f : s + 1 + run * f],
                    "predicted": np.concatenate([pred[h].frames[:f] for h in range(1, run + 1)]),
                }
            )
    return windows, unscored, strips


def stream_output_times(replay: BagReplay) -> list[list[float]]:
    """Per stream, the receive times (s) of its conditioned predictions in chunk order."""
    streams: dict[int, list[Prediction]] = defaultdict(list)
    for p in replay.predictions:
        if p.observation_seq >= 0:
            streams[p.stream_id].append(p)
    return [
        [p.received_ns / 1e9 for p in sorted(ps, key=lambda p: p.chunk_index)]
        for ps in streams.values()
    ]


def evaluate_link(
    opts: LinkOptions,
    bag_paths: list,
    cfg: EvalConfig,
    *,
    topics=None,
    progress: bool = True,
    strip_windows: int = 3,
) -> EvalResult:
    """Replay every readable bag over the link (one stream each) and score it; bags that
    cannot be read are skipped with the reason; LinkUnavailable when the server is not there."""
    from tqdm import tqdm

    t0 = time.perf_counter()
    promise = probe(opts)
    # The promise does not say whether the model predicts actions or is conditioned on
    # them: assume conditioned (commands are sent) until a prediction carries actions.
    action_mode = "none" if promise.action_dim == 0 else "condition"
    model = model_info(promise, action_mode)
    result = EvalResult(model=model, config=cfg, mode="link", output_sequences_s=[])
    episodes = load_episodes(
        bag_paths, model, cfg, result, topics=topics, require_commands=promise.action_dim > 0
    )
    hops: dict[str, list[float]] = defaultdict(list)
    drops: Counter = Counter()
    unscored_all: Counter = Counter()
    received = connections = 0
    for index, ep in enumerate(tqdm(episodes, desc="bags", unit="bag", disable=not progress)):
        replay = replay_bag(
            ep, opts, cfg, seed=cfg.seed + index, send_actions=promise.action_dim > 0
        )
        if any(p.actions is not None for p in replay.predictions) and action_mode != "predict":
            action_mode = "predict"
            result.model = model = model_info(promise, action_mode)
        windows, unscored, strips = score_bag(ep, replay, model, cfg)
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
        drops.update(replay.drops)
        unscored_all.update(unscored)
        received += len(replay.predictions)
        connections += replay.connections
        ep.notes.extend(replay.notes)
        result.bags.append(bag_entry(ep, len(windows)))
    result.link = {
        "target": opts.target,
        "requested_interval_ms": opts.interval_ms,
        "promise": dataclasses.asdict(promise),
        "streams_opened": connections,
        "predictions_received": received,
        "predictions_scored": sum(len(w.output_times_s) for w in result.windows),
        "unscored_predictions": dict(unscored_all),
        "hop_ms": {name: summarize(v) for name, v in sorted(hops.items())},
        "drops": dict(sorted(drops.items())),
        "window": "one conditioning observation: its predictions h = 1.. chunks ahead",
    }
    result.wall_s = time.perf_counter() - t0
    return result
