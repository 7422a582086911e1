"""The robot-side link client: connect, open a stream, send the newest observation, receive
predictions, keep the clock offset, resume the stream after its call broke or reconnect to a
new one after the server went away (link/reconnect.py).

One background thread owns the connection; the caller only touches bounded, newest-wins
slots and a bounded prediction queue, so nothing the caller does blocks on the network.
numpy + grpc only (no torch, no rclpy).
"""

from __future__ import annotations

import contextlib
import dataclasses
import queue
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc

from physis_ros.contract.model import ContractError, WamContract
from physis_ros.link.clock import ClockOffsetEstimator
from physis_ros.link.link_stats import LinkCounters, LinkStats
from physis_ros.link.options import LinkOptions
from physis_ros.link.proto_gen import physis_pb2 as pb
from physis_ros.link.proto_gen import physis_pb2_grpc as pb_grpc
from physis_ros.link.reconnect import (
    Connector,
    NotConnected,
    Resumer,
    close_after_polling,
    rpc_error_text,
)
from physis_ros.link.wire import (
    PROTOCOL_VERSION,
    STREAM_ID_METADATA_KEY,
    CameraImage,
    Observation,
    Prediction,
    WireError,
    parse_server_message,
    prediction_from_proto,
    serialize_observation,
    serialize_ping,
)
from physis_ros.link.wire_promise import LinkPromise, promise_from_proto, resume_from_reply
from physis_ros.memtune import freeze_startup_objects, retain_freed_memory

__all__ = [
    "CameraImage",
    "LinkClient",
    "LinkOptions",
    "LinkPromise",
    "LinkStats",
    "Observation",
    "Prediction",
]

STREAM_METHOD = "/physis.v1.Physis/Stream"


class LinkClient:
    """Robot-side client of ``physis-serve`` (see the module docstring)."""

    def __init__(
        self,
        target: str,
        options: LinkOptions | None = None,
        *,
        clock_ns: Callable[[], int] = time.time_ns,
        on_prediction: Callable[[Prediction], None] | None = None,
        **fields: Any,
    ) -> None:
        """A client of the server at ``target`` (``host:port``) with ``options`` (the stream
        it opens, the connection, the client; default ``LinkOptions()``), any of whose fields
        ``fields`` replaces, checked here.

        ``clock_ns`` is the robot clock: it must be the clock of the capture stamps
        (e.g. the ROS node's clock) so that capture-to-receive latencies mean something.

        ``on_prediction``: called with each prediction on the connection thread as soon as it
        is parsed, instead of queueing it for ``get_prediction`` (one thread hand-off less on
        every reply: a consumer that is quick, or hands on by itself, should use it). An
        exception it raises is counted (``client:callback_error``) and the stream goes on."""
        opts = dataclasses.replace(options, **fields) if options else LinkOptions(**fields)
        self._connector = Connector(
            target,
            token=opts.token,
            root_cert_path=opts.root_cert_path,
            client_cert_path=opts.client_cert_path,
            client_key_path=opts.client_key_path,
            connect_timeout_s=opts.connect_timeout_s,
            backoff_s=opts.reconnect_backoff_s,
            max_message_bytes=opts.max_message_bytes,
            tls_server_name=opts.tls_server_name,
        )
        self._metadata = self._connector.metadata
        self._resume = Resumer()
        self._reopening = False
        """set_prompt cancelled the stream (its RpcError is no error)."""
        self._spec = opts.stream_spec()
        self._contract: WamContract | None = None
        self._opened_spec: pb.StreamSpec | None = None
        """What the newest stream was opened with."""
        self._answered = False
        """The connection's stream call brought a message (connection thread)."""
        self._task_changed = False
        """set_task gave other values: the next stream opens at once, not after a backoff."""
        self._options = opts
        self._clock_ns = clock_ns
        self._clock = ClockOffsetEstimator()

        self._cv = threading.Condition()
        self._pending: tuple[int, bytes] | None = None  # (seq, serialised observation)
        self._closing = False
        self._session = 0  # bumped when a stream ends: stops its request generator
        # C SimpleQueues: a waiting thread wakes in about half the time a Condition takes.
        # _wake holds one token per event the request generator must look at (an observation
        # queued, the session ending); _predictions is bounded by hand (oldest dropped).
        self._wake: queue.SimpleQueue[None] = queue.SimpleQueue()
        self._predictions: queue.SimpleQueue[Prediction] = queue.SimpleQueue()
        self._on_prediction = on_prediction
        self._counters = LinkCounters(clock_ns)
        self._stub: pb_grpc.PhysisStub | None = None
        self._call = None
        self._thread: threading.Thread | None = None

    # ---- caller side -------------------------------------------------------------------

    def start(self) -> None:
        """Connects in the background (and keeps reconnecting); never raises."""
        if self._thread is not None:
            return
        if self._options.tune_process:
            retain_freed_memory()
            freeze_startup_objects()
        self._thread = threading.Thread(target=self._run, name="physis-link", daemon=True)
        self._thread.start()

    def set_prompt(self, prompt: str) -> None:
        """Streams from now on are opened with ``prompt`` (a task's new instruction). A
        different prompt ends the stream now on the server (its context goes: it belonged to
        the old task) and a new one opens at once."""
        with self._cv:
            if prompt == self._spec.prompt:
                return
            self._spec.prompt = prompt
        self._reopen()

    def set_task(self, task: dict[str, float]) -> None:
        """Streams from now on are opened with the task's values ``task`` (a new goal). Other
        values end the stream now on the server (its context belonged to the old task) and a
        new one opens at once."""
        with self._cv:
            if dict(self._spec.task) == task:
                return
            self._spec.task.clear()
            self._spec.task.update(task)
            self._task_changed = True
            self._cv.notify_all()
        self._reopen()

    @property
    def contract(self) -> WamContract | None:
        """The served model's contract, as the server said at the last connection (None: a
        world model, or not connected yet)."""
        return self._contract

    def _reopen(self) -> None:
        stub, promise, call = self._stub, self._counters.promise, self._call
        if stub is not None and promise is not None and self._counters.state == "streaming":
            # (an error: the stream ended meanwhile; the next one opens as asked)
            with contextlib.suppress(grpc.RpcError, ValueError):
                stub.CloseStream(
                    pb.CloseStreamRequest(stream_id=promise.stream_id),
                    metadata=self._metadata,
                    timeout=1.0,
                )
        if call is not None:
            with self._cv:
                self._reopening = True
            call.cancel()

    def send_observation(self, obs: Observation) -> None:
        """Serialises ``obs`` and queues it to be sent; an older one not yet sent is dropped
        (newest wins). One that cannot be serialised is counted (``client:bad_observation``).

        The copy of the pixels into the message is made here, on the caller's thread, while
        they are still in its processor's cache: on the link's own thread, woken later, the
        same 0.9 MB copy ran ~5x slower on this project's shared test host."""
        try:
            raw = serialize_observation(obs, send_stamp_ns=self._clock_ns())
        except (WireError, ValueError, TypeError) as exc:
            self._counters.count_client_drop("bad_observation")
            self._counters.set_error(f"observation {obs.seq} not sent: {exc}")
            return
        with self._cv:
            if self._pending is not None:
                self._counters.count_client_drop("superseded")
            self._pending = (obs.seq, raw)
        self._wake.put(None)

    def get_prediction(self, timeout_s: float) -> Prediction | None:
        """The oldest prediction not yet taken, waiting up to ``timeout_s``; None on timeout
        (and always when predictions go to ``on_prediction``)."""
        try:
            return self._predictions.get(timeout=max(timeout_s, 0.0))
        except queue.Empty:
            return None

    def stats(self) -> LinkStats:
        return self._counters.snapshot(self._clock.best(), resumes=self._resume.resumes)

    def close(self, timeout_s: float = 5.0) -> None:
        """Closes the stream on the server (CloseStream) and joins the thread."""
        with self._cv:
            self._closing = True
            self._session += 1
            self._cv.notify_all()
        self._wake.put(None)
        stub, promise, call = self._stub, self._counters.promise, self._call
        if stub is not None and promise is not None and self._counters.state == "streaming":
            try:
                stub.CloseStream(
                    pb.CloseStreamRequest(stream_id=promise.stream_id),
                    metadata=self._metadata,
                    timeout=min(timeout_s, 1.0),
                )
            except grpc.RpcError as exc:  # the server may already be gone: say so, go on
                self._counters.set_error(f"CloseStream: {rpc_error_text(exc)}")
            except ValueError:
                # "Cannot invoke RPC on closed channel": the stream ended meanwhile (the
                # server stopping too, as on a Ctrl-C of both) and its channel is closed
                pass
        if call is not None:
            call.cancel()
        if self._thread is not None:
            self._thread.join(timeout_s)
            self._thread = None

    # ---- connection thread -------------------------------------------------------------

    def _run(self) -> None:
        lo, hi = self._options.reconnect_backoff_s
        backoff_s = lo
        while not self._closing:
            streamed = False
            try:
                streamed = self._run_stream()
                self._resume.forget()  # the server ended the stream: nothing to resume
            except grpc.RpcError as exc:
                with self._cv:
                    reopening, self._reopening = self._reopening, False
                if reopening:  # set_prompt ended it: not an error, open the next one now
                    streamed = True
                    self._resume.forget()
                else:  # a call that streamed and broke is tried again soon: a link blip
                    streamed = self._answered
                    self._resume.broke()
                    self._counters.set_error(rpc_error_text(exc))
            except NotConnected as exc:
                self._counters.set_error(str(exc))
            except WireError as exc:
                self._resume.forget()
                self._counters.set_error(f"bad reply from server: {exc}")
            self._end_session()
            if self._closing:
                break
            backoff_s = lo if streamed else min(backoff_s * 2, hi)
            with self._cv:
                self._cv.wait_for(lambda: self._closing or self._task_changed, timeout=backoff_s)
        self._counters.set_state("disconnected")

    def _run_stream(self) -> bool:
        """One connection: connect, resume the stream whose call broke (while the server
        holds it) or open a new one, stream until it ends. True if it streamed."""
        self._counters.set_state("connecting")
        self._answered = False
        channel = self._connector.channel()
        try:
            self._connector.wait_ready(channel)
            stub = pb_grpc.PhysisStub(channel)
            promise = self._counters.promise
            if self._resume.due() is not None and promise is not None and self._spec_kept():
                try:
                    return self._attach(channel, stub, promise, resuming=True)
                except grpc.RpcError as exc:
                    if not self._resume.refused(exc):
                        raise
                self._end_session()  # its request generator stops; a new stream's starts
            promise = self._open(stub)
            return promise is not None and self._attach(channel, stub, promise, resuming=False)
        finally:
            self._call = None
            close_after_polling(channel)

    def _open(self, stub) -> LinkPromise | None:
        """Opens a new stream (None: the client closed meanwhile)."""
        self._contract = self._server_contract(stub)
        with self._cv:  # set_prompt / set_task may change it from another thread
            spec = pb.StreamSpec()
            spec.CopyFrom(self._spec)
            self._task_changed = False
            self._opened_spec = spec
        takes = self._contract.task_names if self._contract is not None else ()
        if takes and not spec.task:
            raise NotConnected(
                f"waiting for the task's values: the model takes {list(takes)} (set_task; "
                "the bridge's task_topic)"
            )
        timeout_s = self._connector.connect_timeout_s
        reply = stub.OpenStream(spec, metadata=self._metadata, timeout=timeout_s)
        if reply.protocol_version != PROTOCOL_VERSION:
            raise WireError(
                "protocol_version",
                f"server speaks {reply.protocol_version}, client {PROTOCOL_VERSION}",
            )
        promise = promise_from_proto(reply.promise)
        with self._cv:
            if self._closing:
                return None
        self._resume.opened(resume_from_reply(reply))
        self._clock.reset()  # a new server process may have another clock
        self._stub = stub
        self._counters.opened(promise)
        self._counters.set_state("connected")
        return promise

    def _spec_kept(self) -> bool:
        """Whether the stream to resume was opened with the spec asked for now (else a new
        prompt or task came while the link was down: a new stream opens with it)."""
        with self._cv:
            kept = self._spec == self._opened_spec
        if not kept:
            self._resume.forget()
        return kept

    def _attach(self, channel, stub, promise: LinkPromise, *, resuming: bool) -> bool:
        """Streams on the stream ``promise`` names until its call ends (True; False: the client
        closed). ``resuming``: re-attaching with the stream's resume ticket, which the server
        confirms with the stream's promise (an RpcError before it: refused, or the link)."""
        with self._cv:
            if self._closing:
                return False
            session = self._session
        ticket = self._resume.ticket
        addressed = (
            ticket.metadata()
            if ticket is not None
            else ((STREAM_ID_METADATA_KEY, str(promise.stream_id)),)
        )
        # Requests go out pre-serialised (see wire.serialize_observation).
        stream = channel.stream_stream(
            STREAM_METHOD,
            request_serializer=None,
            # (message, frames bytes as a view of the received bytes): no pixel copies
            response_deserializer=parse_server_message,
        )
        call = stream(self._requests(session, promise), metadata=(*self._metadata, *addressed))
        self._call = call
        if not resuming:
            self._counters.set_state("streaming")
        for msg, frames_data in call:
            self._answered = True
            if resuming:  # the server took the ticket: the stream goes on where it was
                resuming = False
                self._resume.resumed()
                self._stub = stub
                self._counters.resumed()
                self._counters.set_state("streaming")
            self._on_server_message(msg, frames_data)
        return True

    def _server_contract(self, stub) -> WamContract | None:
        """The served model's contract (GetServerInfo): what each observation must carry and
        which task values a stream opens with."""
        info = stub.GetServerInfo(
            pb.ServerInfoRequest(),
            metadata=self._metadata,
            timeout=self._connector.connect_timeout_s,
        )
        if not info.contract:
            return None
        try:
            return WamContract.from_json(info.contract)
        except ContractError as exc:
            raise WireError("contract", f"the server's model contract: {exc}") from exc

    def _end_session(self) -> None:
        with self._cv:
            self._session += 1
            self._cv.notify_all()
        self._wake.put(None)
        self._stub = None
        self._counters.set_state("disconnected")

    def _requests(self, session: int, promise: LinkPromise) -> Iterator[bytes]:
        """What the client sends on one stream: clock probes (a quick burst, then every
        ping_interval_s) and the newest observation."""
        burst = 8
        next_ping_s = time.monotonic()
        while True:
            item = None
            while True:
                with self._cv:
                    if self._closing or session != self._session:
                        return
                    if self._pending is not None:
                        item, self._pending = self._pending, None
                        break
                now_s = time.monotonic()
                if now_s >= next_ping_s:
                    break
                # A token left from an observation taken without waiting only costs a
                # second look.
                with contextlib.suppress(queue.Empty):
                    self._wake.get(timeout=next_ping_s - now_s)
            if item is None:
                next_ping_s = time.monotonic() + (
                    0.01 if burst > 0 else self._options.ping_interval_s
                )
                burst -= 1
                yield serialize_ping(self._clock_ns())
                continue
            seq, raw = item
            if len(raw) > promise.max_observation_bytes:
                self._counters.count_client_drop("oversized")
                self._counters.set_error(
                    f"observation {seq} not sent: {len(raw)} bytes > server maximum "
                    f"{promise.max_observation_bytes}"
                )
                continue
            self._counters.sent()
            yield raw

    def _on_server_message(
        self, msg: pb.ServerMessage, frames_data: memoryview | None = None
    ) -> None:
        received_ns = self._clock_ns()
        kind = msg.WhichOneof("body")
        if kind == "pong":
            p = msg.pong
            self._clock.add(p.client_send_ns, p.server_receive_ns, p.server_send_ns, received_ns)
        elif kind == "stats":
            self._counters.take_server_counts(msg.stats)
        elif kind == "promise":  # revised: keep what only OpenStream says (message limits)
            self._counters.revised(msg.promise)
        elif kind == "prediction":
            prediction = prediction_from_proto(
                msg.prediction,
                received_ns=received_ns,
                offset_ns=self._clock.offset_ns,
                drops=self._counters.take_server_counts(msg.prediction.counters),
                frames_data=frames_data,
            )
            self._counters.received()
            if self._on_prediction is not None:
                try:
                    self._on_prediction(prediction)
                except Exception as exc:  # noqa: BLE001 - the caller's bug must not end the link
                    self._counters.count_client_drop("callback_error")
                    self._counters.set_error(
                        f"on_prediction raised on chunk {prediction.chunk_index}: {exc!r}"
                    )
                return
            self._predictions.put(prediction)
            while self._predictions.qsize() > self._options.prediction_queue_size:
                with contextlib.suppress(queue.Empty):
                    self._predictions.get_nowait()  # the oldest
                    self._counters.count_client_drop("prediction_queue_full")
