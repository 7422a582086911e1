"""physis-eval over the link: replay bags into a running physis-serve, collect what comes back.

The live timeline (DESIGN.md §3), not windows. Each bag frame i goes out through
``LinkClient`` as one ``Observation`` (seq i, capture stamp = the frame's bag stamp, action =
the command in force when it was captured), at the recorded timing (``realtime``) or as fast
as the server takes them (each slot's frames, then a wait for the prediction anchored on that
slot, so every slot is observed before the next and the schedule is the one a real-time
stream gets). The server puts frame i in slot i // F, enters each completed slot as its
observation and generates up to ``horizon`` slots ahead of it; the stream asks for the
horizon ``ReplayLink.horizons`` names (one stream per horizon per bag; none named: the
model's). Each prediction says its anchor (the observed slot it reads last, and that slot's
newest frame ``observation_seq``), its horizon j (chunks ahead of the anchor) and the frame
its first predicted frame stands for (``first_frame_seq``). A bag is replayed up to the end of
the evaluation's last window (``evaluate.frames_in_use``); scoring is ``link_eval.py``'s. No
torch, no rclpy.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from physis_ros.eval.bag import Episode
from physis_ros.eval.evaluate import EvalConfig, ModelInfo, frames_in_use
from physis_ros.link.client import LinkClient, LinkPromise, Observation, Prediction
from physis_ros.link.options import LinkOptions
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
class ReplayLink:
    """Where the server is, how to talk to it and what its streams ask for (``link``: the
    credentials; the connect timeout, also the longest wait for a lost stream to come back;
    the target interval; previews, scored apart by ``previews.py``; rollouts), and the
    horizons the bags are replayed at."""

    target: str
    """host:port of physis-serve."""
    link: LinkOptions = field(default_factory=LinkOptions)
    horizons: tuple[int, ...] = ()
    """Replay each bag once per horizon, the stream asking for it; empty: the model's."""

    def __post_init__(self) -> None:
        if any(h < 1 for h in self.horizons):
            raise ValueError(f"horizons must be >= 1, got {list(self.horizons)}")


def make_client(opts: ReplayLink, *, seed: int, horizon: int = 0) -> LinkClient:
    return LinkClient(
        opts.target,
        opts.link,
        seed=seed,
        horizon=horizon,
        client_name="physis-eval",
        # the replay reads between sends; a deep queue loses nothing in a slow moment
        prediction_queue_size=4096,
    )


def wait_streaming(client: LinkClient, opts: ReplayLink) -> LinkPromise:
    """Starts ``client`` and waits for its stream to open; LinkUnavailable (with the server's
    or gRPC's reason) when it has not within the connect timeout plus a grace second."""
    client.start()
    deadline = time.monotonic() + opts.link.connect_timeout_s + 1.0
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
        f"no stream from physis-serve at {opts.target} within {opts.link.connect_timeout_s:g} s: "
        f"{st.last_error or st.state}"
    )


def probe(opts: ReplayLink) -> LinkPromise:
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

    def __init__(self, client: LinkClient, opts: ReplayLink, out: BagReplay, horizon: int) -> None:
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
        elif time.monotonic() - self.lost_since > self.opts.link.connect_timeout_s + 1.0:
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
    ep: Episode, opts: ReplayLink, cfg: EvalConfig, *, seed: int, send_actions: bool, horizon=0
) -> BagReplay:
    """Streams ``ep``'s frames (those the evaluation uses: ``frames_in_use``) to the server on
    a stream of its own (asking for ``horizon`` chunks ahead; 0: the model's) and collects
    every prediction. Capture stamps are the bag stamps moved onto this host's clock by one
    offset per bag (frame 0 is "captured" when the replay starts), so that in realtime the
    capture-to-receive latency means what it means for a robot."""
    stamps = ep.frame_stamps_ns
    out = BagReplay(horizon=horizon)
    client = make_client(opts, seed=seed, horizon=horizon)
    promise = wait_streaming(client, opts)
    frames_per_slot = max(promise.chunk_frames, 1)
    n = frames_in_use(ep, frames_per_slot, cfg)
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
        out.notes.append(
            f"replayed the first {n} of {len(stamps)} frames (the windows evaluated lie in them)"
        )
    return out
