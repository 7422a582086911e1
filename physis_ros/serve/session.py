"""Per-stream pacing between the gRPC front end and the engine.

``Session`` is one admitted stream: the gRPC reader thread offers it client messages (checked
here; bad ones dropped and counted by reason), it keeps the newest checked observation in a
one-slot buffer (newest wins), as a context chunk of the stream's newest frames (every
checked frame enters the stream's frame history), and it queues outgoing messages for the
gRPC writer.

``EngineLoop`` is the one thread that calls the engine (the gRPC threads never block on it):
per stream it keeps ``pipeline_depth`` generate requests in flight (paced by the interval the
stream was admitted at), puts the newest observation in as a context chunk right before a
generate request (at most one context chunk per generated chunk, so observations cannot starve
generation), polls the engine, and maps each finished chunk to a prediction that names the
observation it is conditioned on. Promises the engine revises (another stream joined or
left) replace the stream's own and go to its client.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import itertools
import logging
import queue
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc
import numpy as np
from google.protobuf.message import DecodeError

from physis_ros.engine.api import ChunkOutput, StreamEngine, StreamFailed, StreamPromise
from physis_ros.link.proto_gen import physis_pb2 as pb
from physis_ros.link.wire import (
    PROMISE_FIELDS,
    PROTOCOL_VERSION,
    WireError,
    array_to_tensor,
    observation_from_proto,
    parse_client_message,
    serialize_with_payload,
    tensor_header,
)
from physis_ros.serve.observations import ContextInput, context_input

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class SessionLimits:
    """Front-end limits that apply to every stream."""

    max_observation_bytes: int = 8 * 1024 * 1024
    """Larger observations are dropped ("oversized") and the stream goes on."""
    outbound_queue: int = 16
    """Messages waiting for a slow client; beyond it the oldest prediction is dropped."""
    unattached_timeout_s: float = 10.0
    """A stream opened but never attached to a Stream call is closed after this."""
    stall_timeout_s: float = 60.0
    """Chunks in flight but none finished for this long: the stream ends with UNAVAILABLE
    (the client reconnects) instead of waiting forever on a stuck engine."""

    def __post_init__(self) -> None:
        if self.max_observation_bytes <= 0:
            raise ValueError(f"max_observation_bytes must be > 0, got {self.max_observation_bytes}")
        if self.outbound_queue < 2:
            raise ValueError(f"outbound_queue must be >= 2, got {self.outbound_queue}")
        if self.stall_timeout_s <= 0:
            raise ValueError(f"stall_timeout_s must be > 0, got {self.stall_timeout_s}")
        if self.unattached_timeout_s <= 0:
            raise ValueError(f"unattached_timeout_s must be > 0, got {self.unattached_timeout_s}")


FRAMES_DATA_PATH = ("prediction", "frames", "data")


def fill_promise(out: pb.StreamPromise, promise: StreamPromise, limits: SessionLimits) -> None:
    """The wire form of ``promise`` (OpenStream's reply and every revision)."""
    for name in PROMISE_FIELDS:
        setattr(out, name, getattr(promise, name))
    out.max_observation_bytes = limits.max_observation_bytes


@dataclass(frozen=True)
class ChunkReady:
    """A finished chunk on the outbound queue: the gRPC writer thread turns it into a
    Prediction (so the engine thread does no per-stream serialisation)."""

    out: ChunkOutput
    conditioning: tuple[ContextInput, int] | None
    """The observation it is conditioned on and when that was queued (server wall ns)."""


@dataclass(frozen=True)
class SessionEnded:
    """Put on the outbound queue when a stream ends: the writer ends the call with it."""

    code: grpc.StatusCode
    details: str


class Session:
    """One admitted stream (see the module docstring)."""

    def __init__(
        self,
        *,
        promise: StreamPromise,
        target_interval_ms: float,
        limits: SessionLimits,
        client_name: str = "",
    ) -> None:
        self.promise = promise
        self.stream_id = promise.stream_id
        self.limits = limits
        self.client_name = client_name
        # Paced at what the pool admitted it at (its request, or the default target for a
        # request of 0); an engine without admission paces at the request.
        paced_ms = promise.target_interval_ms or target_interval_ms
        self.interval_s = max(paced_ms, 0.0) / 1000.0
        self.opened_s = time.monotonic()
        self._lock = threading.Lock()
        self._newest: ContextInput | None = None
        # The newest chunk_frames camera frames, in arrival order: every checked observation's
        # frame enters it (also one superseded before it was used), and a context chunk is
        # built from it, as training and the eval build an observed chunk from consecutive
        # real frames. Cleared when the stream ends.
        self._frames: collections.deque[np.ndarray] = collections.deque(
            maxlen=max(promise.chunk_frames, 1)
        )
        self._last_seq: int | None = None
        self._outbound: collections.deque[Any] = collections.deque()
        # One token per item pushed: the writer takes a token, then an item (if one is still
        # there). A C SimpleQueue wakes the writer in about half the time a Condition does.
        self._outbound_tokens: queue.SimpleQueue[None] = queue.SimpleQueue()
        self._stats_pending = False
        self.attached = False
        self.closed = False
        self.on_end: Callable[[str], None] | None = None
        """Called once when the stream ends (the front end forgets it)."""
        self.observations_received = 0
        self.observations_used = 0
        self.predictions_sent = 0
        self.drops: collections.Counter[str] = collections.Counter()
        self.last_drop_detail = ""
        # engine-thread state
        self.inflight = 0
        self.progress_s = 0.0  # monotonic: last chunk out, or first submit after none in flight
        self.next_generate_s = 0.0
        self.conditioning: tuple[ContextInput, int] | None = None  # (input, queued_ns)
        self.chunk_conditioning: dict[int, tuple[ContextInput, int] | None] = {}
        self.left_s: collections.deque[float] = collections.deque(maxlen=33)
        self.chunks_out = 0
        # Response latency as the promise means it: observation handed to the engine -> the
        # first chunk conditioned on it left the pipeline (server clock, ms).
        self.response_ms: collections.deque[float] = collections.deque(maxlen=64)
        self._responded_seq = -1

    # ---- gRPC reader side --------------------------------------------------------------

    def offer(self, raw: bytes, received_ns: int) -> None:
        """One raw ClientMessage from the wire: answered, kept, or dropped and counted."""
        if len(raw) > self.limits.max_observation_bytes:
            self.drop(
                "oversized",
                f"{len(raw)} bytes > max_observation_bytes {self.limits.max_observation_bytes}",
            )
            return
        try:
            msg, image_data = parse_client_message(raw)
        except DecodeError as exc:
            self.drop("malformed", f"not a ClientMessage ({len(raw)} bytes): {exc}")
            return
        if msg.protocol_version != PROTOCOL_VERSION:
            self.drop(
                "protocol_version",
                f"client message version {msg.protocol_version}, server speaks {PROTOCOL_VERSION}",
            )
            return
        kind = msg.WhichOneof("body")
        if kind == "ping":
            pong = pb.ClockPong(
                client_send_ns=msg.ping.client_send_ns, server_receive_ns=received_ns
            )
            self._push(pb.ServerMessage(protocol_version=PROTOCOL_VERSION, pong=pong))
        elif kind == "observation":
            self._offer_observation(msg.observation, image_data)
        else:
            self.drop("malformed", "client message with neither observation nor ping")

    def _offer_observation(self, o: pb.Observation, image_data: memoryview | None) -> None:
        with self._lock:
            self.observations_received += 1
            last = self._last_seq
            if last is not None and o.seq <= last:
                reason = "duplicate_seq" if o.seq == last else "out_of_order_seq"
                detail = f"seq {o.seq} after {last}"
            else:
                reason = None
                self._last_seq = o.seq
        if reason is not None:
            self.drop(reason, detail)
            return
        p = self.promise
        try:
            ctx = context_input(
                observation_from_proto(o, image_data=image_data),
                send_stamp_ns=o.send_stamp_ns,
                height=p.image_height,
                width=p.image_width,
                action_horizon=p.action_horizon,
                action_dim=p.action_dim,
            )
        except WireError as exc:
            self.drop(exc.reason, f"observation {o.seq}: {exc.detail}")
            return
        with self._lock:
            if self.closed:
                return
            self._frames.extend(ctx.frames)
            frames = list(self._frames)
        # A stream's first observations, before chunk_frames frames exist: the oldest frame
        # is repeated in front (the newest stays last). Stacked outside the lock: one reader
        # thread offers a stream's messages, in order.
        frames[:0] = frames[:1] * (self._frames.maxlen - len(frames))
        ctx = dataclasses.replace(ctx, frames=np.stack(frames))
        with self._lock:
            superseded = self._newest
            self._newest = ctx
        if superseded is not None:
            self.drop(
                "superseded",
                f"observation {superseded.seq} replaced by {ctx.seq} before "
                "it entered the pipeline (client sends faster than the interval)",
            )

    def drop(self, reason: str, detail: str) -> None:
        """Count a dropped message and tell the client (one stats message at a time)."""
        with self._lock:
            self.drops[reason] += 1
            self.last_drop_detail = f"{reason}: {detail}"
            send_stats = not self._stats_pending
            self._stats_pending = True
        log.debug("stream %d dropped %s: %s", self.stream_id, reason, detail)
        if send_stats:
            self._push("stats")  # filled in when sent, with the counts of that moment

    # ---- outbound (gRPC writer side) ---------------------------------------------------

    def _push(self, item: Any) -> None:
        with self._lock:
            if self.closed:
                return
            if len(self._outbound) >= self.limits.outbound_queue:
                # The client reads slower than we produce: drop its oldest prediction.
                for i, old in enumerate(self._outbound):
                    if isinstance(old, ChunkReady):
                        del self._outbound[i]
                        self.drops["client_slow"] += 1
                        self.last_drop_detail = (
                            "client_slow: prediction dropped, client reads slower than the interval"
                        )
                        break
            self._outbound.append(item)
        self._outbound_tokens.put(None)

    def next_outbound(self, timeout_s: float) -> bytes | SessionEnded | None:
        """The next serialised ServerMessage to send (its ``sent`` / ``server_send`` stamp
        set now), the end of the stream, or None after ``timeout_s`` with nothing to send."""
        try:
            self._outbound_tokens.get(timeout=timeout_s)
        except queue.Empty:
            return None
        with self._lock:
            if not self._outbound:
                return None  # its item was dropped (client_slow)
            item = self._outbound.popleft()
            if item == "stats":
                self._stats_pending = False
                msg = pb.ServerMessage(protocol_version=PROTOCOL_VERSION, stats=self._counters())
                return msg.SerializeToString()
            if item == "promise":
                msg = pb.ServerMessage(protocol_version=PROTOCOL_VERSION)
                fill_promise(msg.promise, self.promise, self.limits)
                return msg.SerializeToString()
            if isinstance(item, ChunkReady):
                self.predictions_sent += 1
        if isinstance(item, SessionEnded):
            return item
        now_ns = time.time_ns()
        if isinstance(item, ChunkReady):
            return self._serialize_prediction(item, sent_ns=now_ns)
        item.pong.server_send_ns = now_ns
        return item.SerializeToString()

    def end(self, code: grpc.StatusCode, details: str) -> None:
        """Ends the stream: the writer sends what it has, then ends the call with ``code``."""
        with self._lock:
            if self.closed:
                return
            self._outbound.append(SessionEnded(code, details))
            self.closed = True
            self._frames.clear()
            self._newest = None
        self._outbound_tokens.put(None)
        if self.on_end is not None:
            self.on_end(details)

    def counters(self) -> pb.StreamCounters:
        with self._lock:
            return self._counters()

    def _counters(self) -> pb.StreamCounters:
        out = pb.StreamCounters()
        self._fill_counters(out)
        return out

    def _fill_counters(self, out: pb.StreamCounters) -> None:
        out.observations_received = self.observations_received
        out.observations_used = self.observations_used
        out.predictions_sent = self.predictions_sent
        out.last_drop_detail = self.last_drop_detail
        if self.drops:
            out.drops.update(self.drops)

    # ---- engine thread side ------------------------------------------------------------

    def take_newest(self) -> ContextInput | None:
        with self._lock:
            ctx, self._newest = self._newest, None
            return ctx

    def achieved_interval_ms(self) -> float:
        left = list(self.left_s)
        if len(left) < 2:
            return 0.0
        return statistics.median(b - a for a, b in itertools.pairwise(left)) * 1000.0

    def push_chunk(self, out: ChunkOutput) -> None:
        """A finished chunk (engine thread): queued for the writer with its conditioning."""
        cond = self.chunk_conditioning.pop(out.chunk, None)
        if cond is not None and cond[0].seq > self._responded_seq:
            self._responded_seq = cond[0].seq
            left_ns = time.time_ns() - time.monotonic_ns() + int(out.left_s * 1e9)
            self.response_ms.append((left_ns - cond[1]) / 1e6)
        self._push(ChunkReady(out, cond))

    def response_latency_ms(self) -> float:
        """Median over recent observations (0 before the first)."""
        values = list(self.response_ms)
        return statistics.median(values) if values else 0.0

    def revise(self, promise: StreamPromise) -> None:
        """A revised promise (engine thread): kept, and sent to the client."""
        with self._lock:
            self.promise = promise
        self._push("promise")

    def _serialize_prediction(self, item: ChunkReady, *, sent_ns: int) -> bytes:
        out, cond = item.out, item.conditioning
        msg = pb.ServerMessage(protocol_version=PROTOCOL_VERSION)
        p = msg.prediction
        p.stream_id = self.stream_id
        p.chunk_index = out.chunk
        frames = None
        if out.frames is not None:
            frames = tensor_header(out.frames, p.frames)
        if out.actions is not None:
            array_to_tensor(out.actions, p.actions)
        p.observation_seq = -1
        t = p.server_times
        if cond is not None:
            ctx, queued_ns = cond
            p.observation_seq = ctx.seq
            p.observation_stamp_ns = ctx.capture_stamp_ns
            p.observation_send_stamp_ns = ctx.send_stamp_ns
            t.received_ns = ctx.received_ns
            t.queued_ns = queued_ns
        # One wall-minus-monotonic offset for all three, so their order is kept exactly.
        wall_minus_mono_ns = time.time_ns() - time.monotonic_ns()
        t.entered_ns = wall_minus_mono_ns + int(out.entered_s * 1e9)
        t.left_ns = wall_minus_mono_ns + int(out.left_s * 1e9)
        t.decoded_ns = wall_minus_mono_ns + int(out.decoded_s * 1e9)
        t.sent_ns = sent_ns
        with self._lock:
            self._fill_counters(p.counters)
        if frames is None:
            return msg.SerializeToString()
        return serialize_with_payload(msg, FRAMES_DATA_PATH, frames)


class EngineLoop:
    """The one thread that talks to the engine (see the module docstring)."""

    def __init__(
        self,
        engine: StreamEngine,
        *,
        poll_timeout_s: float = 0.002,
        idle_wait_s: float = 0.02,
        generate_with_actions: bool = False,
    ) -> None:
        """``generate_with_actions``: pass the newest commanded actions [H, A] with each
        generate request (world models with action_mode "condition")."""
        if poll_timeout_s <= 0 or idle_wait_s <= 0:
            raise ValueError(
                f"poll_timeout_s {poll_timeout_s} and idle_wait_s {idle_wait_s} must be > 0"
            )
        self.engine = engine
        self._poll_timeout_s = poll_timeout_s
        self._idle_wait_s = idle_wait_s
        self._generate_with_actions = generate_with_actions
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._sessions: dict[int, Session] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="physis-engine", daemon=True)
        self.error = ""

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        self._thread.join(timeout_s)

    def call(self, fn: Callable[[StreamEngine], Any], timeout_s: float) -> Any:
        """Runs ``fn(engine)`` on the engine thread and returns its result (or raises)."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put((fn, future))
        return future.result(timeout=timeout_s)

    def wake(self) -> None:
        """Look at the streams now (e.g. one was just attached) instead of after a wait."""
        self._commands.put((lambda _e: None, None))

    def add(self, session: Session) -> None:
        def add(_engine) -> None:
            self._sessions[session.stream_id] = session
            self._send_revisions()  # others' promises, revised when this one was admitted

        self._commands.put((add, None))

    def remove(self, session: Session) -> None:
        """Forget the stream and free its KV slots (engine.close_stream), on the engine thread."""
        self._commands.put((lambda _e: self._close(session), None))

    def _close(self, session: Session) -> None:
        if self._sessions.pop(session.stream_id, None) is None:
            return
        try:
            self.engine.close_stream(session.stream_id)
        except (StreamFailed, KeyError, ValueError) as exc:
            log.warning("closing stream %d: %s", session.stream_id, exc)
        self._send_revisions()

    def _send_revisions(self) -> None:
        """Promises the engine revised (a stream joined or left) go to their streams."""
        take = getattr(self.engine, "take_revisions", None)
        if take is None:
            return
        for promise in take():
            session = self._sessions.get(promise.stream_id)
            if session is not None:
                log.info(
                    "stream %d promise revised (%d): interval %.1f ms, latency %.1f ms",
                    promise.stream_id,
                    promise.revision,
                    promise.expected_interval_ms,
                    promise.expected_response_latency_ms,
                )
                session.revise(promise)

    def _run(self) -> None:
        wait_s = 0.0
        while not self._stop.is_set():
            self._run_commands(timeout_s=wait_s)
            for session in list(self._sessions.values()):
                self._pump(session)
            if not any(s.inflight for s in self._sessions.values()):
                # Nothing to poll: sleep on the command queue until the next paced generate
                # is due (never spin: the gRPC threads need the GIL to move bytes).
                now_s = time.monotonic()
                due_s = [s.next_generate_s - now_s for s in self._sessions.values() if s.attached]
                wait_s = min([self._idle_wait_s, *due_s])
                continue
            wait_s = 0.0
            try:
                outputs = self.engine.poll(self._poll_timeout_s)
            except StreamFailed as exc:
                self._fail(exc)
                continue
            for out in outputs:
                session = self._sessions.get(out.stream_id)
                if session is None:
                    continue  # closed while its chunks were in flight
                session.inflight -= 1
                session.progress_s = time.monotonic()
                session.chunks_out += 1
                session.left_s.append(out.left_s)
                session.push_chunk(out)

    def _fail(self, exc: StreamFailed) -> None:
        """A failure the engine reported from poll: one that names its stream
        (``exc.stream_id``, e.g. a rank that held only that stream's stages died) ends that
        stream alone, and the others keep running; one that names none ends them all."""
        stream_id = getattr(exc, "stream_id", None)
        session = self._sessions.get(stream_id) if stream_id is not None else None
        if session is not None:
            log.error("stream %d failed in the engine: %s", stream_id, exc)
            session.end(grpc.StatusCode.UNAVAILABLE, f"stream failed in the engine: {exc}")
            self._close(session)
            return
        if stream_id is not None:
            log.warning(
                "engine reported a failure of stream %d, already closed: %s", stream_id, exc
            )
            return
        self.error = f"engine failed: {exc}"
        log.error("%s", self.error)
        for session in list(self._sessions.values()):
            session.end(grpc.StatusCode.UNAVAILABLE, self.error)
            self._close(session)

    def _run_commands(self, *, timeout_s: float) -> None:
        try:
            item = (
                self._commands.get(timeout=timeout_s)
                if timeout_s > 0
                else self._commands.get_nowait()
            )
        except queue.Empty:
            return
        while True:
            fn, future = item
            if future is None:
                fn(self.engine)
            elif future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(self.engine))
                except Exception as exc:  # noqa: BLE001 - handed to the caller, who re-raises it
                    future.set_exception(exc)
            try:
                item = self._commands.get_nowait()
            except queue.Empty:
                return

    def _pump(self, session: Session) -> None:
        """Keep the stream's pipeline full; newest observation goes in before a generate."""
        if not session.attached:
            if time.monotonic() - session.opened_s > session.limits.unattached_timeout_s:
                session.end(grpc.StatusCode.DEADLINE_EXCEEDED, "stream was never attached")
                self._close(session)
            return
        depth = max(session.promise.pipeline_depth, 1)
        now_s = time.monotonic()
        if session.inflight and now_s - session.progress_s > session.limits.stall_timeout_s:
            session.end(
                grpc.StatusCode.UNAVAILABLE,
                f"engine finished no chunk of this stream in {session.limits.stall_timeout_s} s",
            )
            self._close(session)
            return
        while session.inflight < depth and now_s >= session.next_generate_s:
            try:
                ctx = session.take_newest()
                if ctx is not None:
                    queued_ns = time.time_ns()
                    self.engine.submit_context(session.stream_id, ctx.frames, ctx.actions)
                    session.conditioning = (ctx, queued_ns)
                    with session._lock:
                        session.observations_used += 1
                # A world model conditioned on actions gets the newest commanded actions
                # (held until an observation brings new ones).
                actions = None
                if self._generate_with_actions and session.conditioning is not None:
                    actions = session.conditioning[0].actions
                chunk = self.engine.submit_generate(session.stream_id, actions)
            except (StreamFailed, KeyError, ValueError) as exc:
                session.end(grpc.StatusCode.UNAVAILABLE, f"stream failed in the engine: {exc}")
                self._close(session)
                return
            session.chunk_conditioning[chunk] = session.conditioning
            if not session.inflight:
                session.progress_s = now_s
            session.inflight += 1
            if session.interval_s > 0:
                session.next_generate_s = max(session.next_generate_s, now_s - session.interval_s)
                session.next_generate_s += session.interval_s

    def sessions(self) -> list[Session]:
        return list(self._sessions.values())
