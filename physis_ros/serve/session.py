"""One admitted stream as the gRPC front end sees it: messages in, messages out, counters.

``Session`` is one stream's wire side: the gRPC reader thread offers it client messages
(checked here; bad ones dropped and counted by reason) and hands every checked camera frame
to the engine core (``EngineCore.add_frame``: the core puts it in its time slot and runs the
stream's live timeline); the serving loop (``engine_loop.EngineLoop``) hands it what the core
ran and the drops and ends it reports; the gRPC writer takes its outgoing messages.
"""

from __future__ import annotations

import collections
import dataclasses
import hmac
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
from google.protobuf.message import DecodeError

from physis_ros.contract.model import WamContract
from physis_ros.engine.api import StreamPromise
from physis_ros.engine.live import Ran, SlotCounters
from physis_ros.engine.slots import FrameIn
from physis_ros.link.proto_gen import physis_pb2 as pb
from physis_ros.link.wire import (
    PROTOCOL_VERSION,
    StreamCounts,
    WireError,
    observation_from_proto,
    parse_client_message,
    serialize_pong,
    serialize_prediction,
    serialize_stats,
)
from physis_ros.link.wire_promise import serialize_promise
from physis_ros.serve.frontend_config import SessionLimits
from physis_ros.serve.observations import (
    check_header,
    check_observation,
    context_input,
    wam_inputs,
)
from physis_ros.serve.ratelog import RateLimit, held_note

log = logging.getLogger(__name__)


class AttachRefused(Exception):
    """A Stream call may not take the stream: ends the call with ``code`` and ``details``."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code = code
        self.details = details


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
        limits: SessionLimits,
        add_frame: Callable[[FrameIn], tuple[int, int]],
        slot_counters: Callable[[], SlotCounters | None],
        client_name: str = "",
        contract: WamContract | None = None,
        task: dict[str, float] | None = None,
    ) -> None:
        """``add_frame``: hands a checked frame to the engine core (-> slots it completed,
        frames of a gap skipped); ``slot_counters``: the core's slot counts of the stream;
        ``contract``: a world-action model's (its observations carry state and command
        timelines), with the stream's ``task`` values."""
        self.promise = promise
        self.contract = contract
        self.task = dict(task or {})
        self.stream_id = promise.stream_id
        self.limits = limits
        self.client_name = client_name
        self._add_frame = add_frame
        self._slot_counters = slot_counters
        self.opened_s = time.monotonic()
        self._lock = threading.Lock()
        self._last_seq: int | None = None
        self._outbound: collections.deque[Any] = collections.deque()
        # One token per item pushed: the writer takes a token, then an item (if one is still
        # there). A C SimpleQueue wakes the writer in about half the time a Condition does.
        self._outbound_tokens: queue.SimpleQueue[None] = queue.SimpleQueue()
        self._stats_pending = False
        self.attached = False
        """A Stream call claimed the stream (and stays True while it is detached)."""
        self.attachment = 0
        """The number of the Stream call that holds it (1 the first, +1 per resume)."""
        self.detached_s: float | None = None
        """Monotonic: when its call ended and left it detached (None: a call holds it, or
        none has yet)."""
        self.resume_token = ""
        """Its opener's secret for re-attaching ("": not resumable, see serve/resume.py)."""
        self.resumes = 0
        self.closed = False
        self.on_end: Callable[[str], None] | None = None
        """Called once when the stream ends (the front end forgets it)."""
        self.on_observed: Callable[[], None] | None = None
        """Called when a frame completed a slot (wakes the serving loop)."""
        self.on_chunk: Callable[[float | None, float | None], None] | None = None
        """Called (serving loop) for every chunk out with the interval since the previous one
        (s) and its response latency (ms), each None when the chunk gives none (metrics)."""
        self.observations_received = 0
        self.predictions_sent = 0
        self.drops: collections.Counter[str] = collections.Counter()
        self.last_drop_detail = ""
        self._drop_log = RateLimit(limits.drop_log_interval_s)
        # what came out (serving loop)
        self.left_s: collections.deque[float] = collections.deque(maxlen=33)
        self.chunks_out = 0
        # Response latency as the promise means it: observation handed to the engine -> the
        # first chunk conditioned on it left the pipeline (server clock, ms).
        self.response_ms: collections.deque[float] = collections.deque(maxlen=64)
        self._responded_seq = -1

    # ---- gRPC reader side --------------------------------------------------------------

    def offer(self, raw: bytes, received_ns: int) -> None:
        """One raw ClientMessage from the wire: answered, kept, or dropped and counted.

        Never raises: a fault in the checks themselves (a bug a crafted message found) drops
        that message as ``internal_error``, logged with its traceback, and the stream goes
        on; the reader thread that calls this must outlive every message."""
        try:
            self._offer(raw, received_ns)
        except Exception as exc:  # noqa: BLE001 - counted, logged with traceback, reported
            self.drop("internal_error", f"{type(exc).__name__}: {exc}", exc_info=exc)

    def _offer(self, raw: bytes, received_ns: int) -> None:
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
            self._push(_Pong(msg.ping.client_send_ns, received_ns))
        elif kind == "observation":
            self._offer_observation(msg.observation, image_data)
        else:
            self.drop("malformed", "client message with neither observation nor ping")

    def _offer_observation(self, o: pb.Observation, image_data: memoryview | None) -> None:
        with self._lock:
            self.observations_received += 1
        try:
            check_header(o)
        except WireError as exc:
            self.drop(exc.reason, exc.detail)
            return
        with self._lock:
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
            observation = observation_from_proto(o, image_data=image_data)
            check_observation(observation)
            frame = context_input(
                observation,
                send_stamp_ns=o.send_stamp_ns,
                height=p.image_height,
                width=p.image_width,
                action_horizon=p.action_horizon,
                action_dim=p.action_dim,
            )
            if self.contract is not None:  # its state and command timeline, or a counted drop
                state, commands = wam_inputs(observation, self.contract, self.task)
                frame = dataclasses.replace(frame, state=state, commands=commands)
        except WireError as exc:
            self.drop(exc.reason, f"observation {o.seq}: {exc.detail}")
            return
        if self.closed:
            return
        completed, skipped = self._add_frame(frame)
        if skipped:
            self.drop(
                "seq_gap",
                f"observation {frame.seq} came {skipped} frames after the previous one: too "
                "long a gap to fill, the stream's timeline goes on at the next slot",
            )
        if completed and self.on_observed is not None:
            self.on_observed()

    def drop(self, reason: str, detail: str, *, exc_info: BaseException | None = None) -> None:
        """Count a dropped message, tell the client (one stats message at a time) and log
        it, rate limited per reason (``limits.drop_log_interval_s``)."""
        with self._lock:
            self.drops[reason] += 1
            count = self.drops[reason]
            self.last_drop_detail = f"{reason}: {detail}"
            send_stats = not self._stats_pending
            self._stats_pending = True
        held = self._drop_log.due(reason)
        if held is not None:
            log.warning(
                "stream %d dropped %s: %s%s [%d in all]",
                self.stream_id,
                reason,
                detail,
                held_note(held),
                count,
                exc_info=exc_info,
            )
        if send_stats:
            self._push("stats")  # filled in when sent, with the counts of that moment

    # ---- Stream calls: attach, detach ---------------------------------------------------

    def attach(self, token: str | None) -> tuple[int, float | None]:
        """Claims the stream for a Stream call that presented resume token ``token`` (None:
        none). The first call needs none; a stream a call claimed before (that call running
        or broken) is taken over only with its token. Returns the call's attachment number
        and, for a resume, how long the stream was detached (s; 0 for a takeover of a call
        that has not ended yet). Raises AttachRefused."""
        sid = self.stream_id
        with self._lock:
            if self.closed:
                code = (
                    grpc.StatusCode.ALREADY_EXISTS if token is None else grpc.StatusCode.NOT_FOUND
                )
                raise AttachRefused(code, f"stream {sid} is already attached or closed")
            if token is not None and not (
                self.resume_token
                and hmac.compare_digest(token.encode(), self.resume_token.encode())
            ):
                raise AttachRefused(
                    grpc.StatusCode.PERMISSION_DENIED, f"wrong resume token for stream {sid}"
                )
            if self.attached and token is None:
                if self.detached_s is not None:
                    raise AttachRefused(
                        grpc.StatusCode.PERMISSION_DENIED,
                        f"stream {sid} lost its call: re-attaching takes its resume token",
                    )
                raise AttachRefused(
                    grpc.StatusCode.ALREADY_EXISTS, f"stream {sid} is already attached or closed"
                )
            resumed = self.attached
            detached_for_s = None
            if resumed:
                since_s = self.detached_s
                detached_for_s = 0.0 if since_s is None else time.monotonic() - since_s
                self.resumes += 1
                # What was queued for the broken call is stale (its chunks, clock answers);
                # the promise goes first: the client learns a revision it missed.
                stats = [i for i in self._outbound if i == "stats"]
                self._outbound = collections.deque(["promise", *stats])
            self.attached = True
            self.attachment += 1
            self.detached_s = None
            attachment = self.attachment
        if resumed:
            self._outbound_tokens.put(None)
        return attachment, detached_for_s

    def detach(self, attachment: int) -> bool:
        """Stream call ``attachment`` ended: True when that left the stream without a call
        (it was the stream's call and the stream is open); it then sends nothing until a call
        resumes it, and what it generates meanwhile is dropped (``detached``)."""
        with self._lock:
            if self.closed or attachment != self.attachment or self.detached_s is not None:
                return False
            self.detached_s = time.monotonic()
            return True

    def holds(self, attachment: int) -> bool:
        """Whether Stream call ``attachment`` is the stream's call (not resumed by a newer)."""
        return attachment == self.attachment

    # ---- outbound (gRPC writer side) ---------------------------------------------------

    def _push(self, item: Any) -> None:
        with self._lock:
            if self.closed:
                return
            if self.detached_s is not None and isinstance(item, Ran):
                self.drops["detached"] += 1
                self.last_drop_detail = "detached: a chunk made while the stream had no call"
                return
            if len(self._outbound) >= self.limits.outbound_queue:
                # The client reads slower than we produce: drop its oldest prediction.
                for i, old in enumerate(self._outbound):
                    if isinstance(old, Ran):
                        del self._outbound[i]
                        self.drops["client_slow"] += 1
                        self.last_drop_detail = (
                            "client_slow: prediction dropped, client reads slower than the interval"
                        )
                        break
            self._outbound.append(item)
        self._outbound_tokens.put(None)

    def next_outbound(
        self, timeout_s: float, attachment: int | None = None
    ) -> bytes | SessionEnded | None:
        """The next serialised ServerMessage to send (its ``sent`` / ``server_send`` stamp
        set now), the end of the stream, or None after ``timeout_s`` with nothing to send
        (or when Stream call ``attachment`` no longer holds the stream: a newer call resumed
        it and gets what is queued)."""
        try:
            self._outbound_tokens.get(timeout=timeout_s)
        except queue.Empty:
            return None
        with self._lock:
            if attachment is not None and attachment != self.attachment:
                self._outbound_tokens.put(None)  # the item stays for the newer call
                return None
            if not self._outbound:
                return None  # its item was dropped (client_slow)
            item = self._outbound.popleft()
            if item == "stats":
                self._stats_pending = False
                return serialize_stats(self._counts())
            if item == "promise":
                return serialize_promise(
                    self.promise, max_observation_bytes=self.limits.max_observation_bytes
                )
            if isinstance(item, Ran):
                self.predictions_sent += 1
                counts = self._counts()
        if isinstance(item, SessionEnded):
            return item
        if isinstance(item, Ran):
            return serialize_prediction(
                item.out,
                stream_id=self.stream_id,
                anchor=item.anchor,
                action_timing=item.action_timing,
                first_frame_seq=item.first_frame_seq,
                counts=counts,
                sent_ns=time.time_ns(),
            )
        return serialize_pong(item.client_send_ns, item.server_receive_ns, time.time_ns())

    def end(self, code: grpc.StatusCode, details: str, *, if_detached: int | None = None) -> bool:
        """Ends the stream: the writer sends what it has, then ends the call with ``code``.
        ``if_detached``: only if the stream is still detached since its call of that number
        ended (not resumed meanwhile). False when it did not end it."""
        with self._lock:
            if self.closed:
                return False
            if if_detached is not None and (
                if_detached != self.attachment or self.detached_s is None
            ):
                return False
            self._outbound.append(SessionEnded(code, details))
            self.closed = True
        self._outbound_tokens.put(None)
        if self.on_end is not None:
            self.on_end(details)
        return True

    def counters(self) -> StreamCounts:
        with self._lock:
            return self._counts()

    def _counts(self) -> StreamCounts:
        slots = self._slot_counters() or SlotCounters(0, 0, 0, 0)
        return StreamCounts(
            observations_received=self.observations_received,
            observations_used=slots.observations_used,
            predictions_sent=self.predictions_sent,
            observed_chunks=slots.observed_chunks,
            filled_frames=slots.filled_frames,
            incomplete_chunks=slots.incomplete_chunks,
            last_drop_detail=self.last_drop_detail,
            drops=collections.Counter(self.drops),
        )

    # ---- what the engine core ran (serving loop) -----------------------------------------

    def take(self, ran: Ran) -> None:
        """A chunk or a preview the core finished: counted, and queued for the writer unless
        its output is not finite (the core reported that drop)."""
        out = ran.out
        if not out.preview_steps:
            self.chunks_out += 1
            interval_s = response_ms = None
            if not self.promise.rollouts or out.horizon == 1:
                if self.left_s:
                    interval_s = out.left_s - self.left_s[-1]
                self.left_s.append(out.left_s)  # rollouts: the interval between them
            cond = ran.anchor
            # response latency is the chunk's: a preview of it comes sooner and is not counted
            if cond is not None and cond.seq > self._responded_seq:
                self._responded_seq = cond.seq
                left_ns = time.time_ns() - time.monotonic_ns() + int(out.left_s * 1e9)
                response_ms = (left_ns - cond.queued_ns) / 1e6
                self.response_ms.append(response_ms)
            if self.on_chunk is not None:
                self.on_chunk(interval_s, response_ms)
        if out.finite:
            self._push(ran)

    def achieved_interval_ms(self) -> float:
        left = list(self.left_s)
        if len(left) < 2:
            return 0.0
        return statistics.median(b - a for a, b in itertools.pairwise(left)) * 1000.0

    def response_latency_ms(self) -> float:
        """Median over recent observations (0 before the first)."""
        values = list(self.response_ms)
        return statistics.median(values) if values else 0.0

    def revise(self, promise: StreamPromise) -> None:
        """A revised promise (serving loop): kept, and sent to the client."""
        with self._lock:
            self.promise = promise
        self._push("promise")


@dataclass(frozen=True)
class _Pong:
    """A clock probe's answer, stamped when the writer sends it."""

    client_send_ns: int
    server_receive_ns: int
