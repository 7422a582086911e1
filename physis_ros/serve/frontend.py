"""The gRPC front end: the Physis service's handlers (the server around them: server.py).

Handlers take raw request bytes and parse them here, so a malformed message gets a clear
status (or, inside a stream, is dropped and counted) instead of grpc's generic INTERNAL.
Handlers never call the engine: they hand work to the ``EngineLoop`` thread (engine_loop.py).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator

import grpc
from google.protobuf.message import DecodeError

from physis_ros.contract.model import ContractError
from physis_ros.engine.api import DEFAULT_HORIZON, AdmissionRefused, StreamFailed, StreamSpec
from physis_ros.link.encoding import tensor_to_array
from physis_ros.link.proto_gen import physis_pb2 as pb
from physis_ros.link.wire import (
    PROTOCOL_VERSION,
    RESUME_TOKEN_METADATA_KEY,
    STREAM_ID_METADATA_KEY,
    WireError,
    counts_to_proto,
)
from physis_ros.link.wire_promise import promise_to_proto, resume_to_reply
from physis_ros.memtune import IdleTrim
from physis_ros.serve.engine_loop import EngineLoop
from physis_ros.serve.frontend_config import FrontendConfig, ServerDescription
from physis_ros.serve.resume import DetachedStreams
from physis_ros.serve.session import AttachRefused, Session, SessionEnded

log = logging.getLogger(__name__)

SERVICE_NAME = "physis.v1.Physis"


class Frontend:
    """The Physis service over an EngineLoop."""

    def __init__(
        self, loop: EngineLoop, *, config: FrontendConfig, description: ServerDescription
    ) -> None:
        self._loop = loop
        self._config = config
        self._description = description
        self._lock = threading.Lock()
        self._sessions: dict[int, Session] = {}
        self._opening = 0  # OpenStream calls between the max_streams check and their session
        self._started_s = time.monotonic()
        self.streams_opened = 0
        self.streams_closed = 0
        self.refusals: Counter[str] = Counter()
        self.admission_refusals: Counter[str] = Counter()
        """OpenStream refused for want of a resource (compute, memory, latency, streams)."""
        self.on_opened: Callable[[Session], None] = lambda _session: None
        self.on_closed: Callable[[Session], None] = lambda _session: None
        """Told of every stream opened and closed (metrics)."""
        self.detached = DetachedStreams(config.resume_grace_s)
        self.idle_trim = IdleTrim()
        """Told of every client message; frees what a burst of large ones left (start_server)."""

    def handler(self) -> grpc.GenericRpcHandler:
        return grpc.method_handlers_generic_handler(
            SERVICE_NAME,
            {
                "OpenStream": grpc.unary_unary_rpc_method_handler(
                    self.open_stream, response_serializer=pb.OpenStreamReply.SerializeToString
                ),
                "Stream": grpc.stream_stream_rpc_method_handler(
                    self.stream  # yields bytes, serialised by the writer
                ),
                "CloseStream": grpc.unary_unary_rpc_method_handler(
                    self.close_stream, response_serializer=pb.CloseStreamReply.SerializeToString
                ),
                "GetServerInfo": grpc.unary_unary_rpc_method_handler(
                    self.server_info, response_serializer=pb.ServerInfo.SerializeToString
                ),
            },
        )

    # ---- OpenStream --------------------------------------------------------------------

    def _refuse(self, context, code: grpc.StatusCode, details: str, resource: str = ""):
        self.count_refusal(code.name, resource)
        context.abort(code, details)

    def count_refusal(self, status: str, resource: str = "") -> None:
        """A call refused with ``status`` (ServerInfo.refusals), for want of ``resource``."""
        with self._lock:
            self.refusals[status] += 1
            if resource:
                self.admission_refusals[resource] += 1

    def open_stream(self, raw: bytes, context) -> pb.OpenStreamReply:
        try:
            spec = pb.StreamSpec.FromString(raw)
        except DecodeError as exc:
            self._refuse(context, grpc.StatusCode.INVALID_ARGUMENT, f"malformed StreamSpec: {exc}")
        if spec.protocol_version != PROTOCOL_VERSION:
            self._refuse(
                context,
                grpc.StatusCode.INVALID_ARGUMENT,
                f"protocol_version {spec.protocol_version}: server speaks {PROTOCOL_VERSION}",
            )
        if not math.isfinite(spec.target_interval_ms) or spec.target_interval_ms < 0:
            self._refuse(
                context,
                grpc.StatusCode.INVALID_ARGUMENT,
                f"target_interval_ms must be finite and >= 0, got {spec.target_interval_ms}",
            )
        budget_ms = spec.response_latency_budget_ms
        if not math.isfinite(budget_ms) or budget_ms < 0:
            self._refuse(
                context,
                grpc.StatusCode.INVALID_ARGUMENT,
                f"response_latency_budget_ms must be finite and >= 0 (0: none), got {budget_ms}",
            )
        embedding = None
        if spec.HasField("prompt_embedding"):
            try:
                embedding = tensor_to_array(spec.prompt_embedding, name="prompt_embedding")
            except WireError as exc:
                self._refuse(context, grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        open_now = self._reserve_place()
        if open_now >= self._config.max_streams:
            self._refuse(
                context,
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{open_now} streams open, front end max_streams is {self._config.max_streams}",
                "streams",
            )
        try:
            return self._admit(spec, embedding, context)
        finally:
            with self._lock:
                self._opening -= 1

    def _reserve_place(self) -> int:
        """Reserves a place below max_streams for an opening stream (a detached stream given
        back for it when all are taken); returns the streams open before it."""
        for retry in (False, True):
            with self._lock:
                # Counted and reserved under one lock: concurrent opens cannot all pass.
                open_now = len(self._sessions) + self._opening
                if open_now < self._config.max_streams:
                    self._opening += 1
                    break
            if retry or not self.detached.reclaim(f"max_streams {self._config.max_streams}"):
                break
        return open_now

    def _task(self, spec: pb.StreamSpec, context) -> dict[str, float]:
        """The task values the stream is opened with: a world-action model's contract names
        the ones it takes (its task state inputs and a task_features prompt); refused by name
        when they do not match."""
        contract = getattr(self._loop.engine, "contract", None)
        task = dict(spec.task)
        takes = contract.task_names if contract is not None else ()
        if not takes and task:
            self._refuse(
                context,
                grpc.StatusCode.INVALID_ARGUMENT,
                f"bad stream spec: task values {sorted(task)}: the model takes none",
            )
        if takes:
            try:
                contract.check_task(task)
            except ContractError as exc:
                self._refuse(context, grpc.StatusCode.INVALID_ARGUMENT, f"bad stream spec: {exc}")
        return task

    def _admit(self, spec: pb.StreamSpec, embedding, context) -> pb.OpenStreamReply:
        # A served stream always has a horizon: observations replace predicted slots.
        horizon = spec.horizon or self._description.horizon or DEFAULT_HORIZON
        # A world model's user wants the freshest future at every horizon; a world-action
        # model's chunks are joined to the robot's committed trajectory one slot at a time.
        rollouts = {
            pb.StreamSpec.ROLLOUTS_ON: True,
            pb.StreamSpec.ROLLOUTS_OFF: False,
        }.get(
            spec.rollouts,
            self._description.rollouts
            and self._description.action_mode != "predict"
            and horizon > 1,
        )
        task = self._task(spec, context)
        engine_spec = StreamSpec(
            seed=spec.seed,
            target_interval_ms=spec.target_interval_ms,
            prompt=spec.prompt,
            prompt_embedding=embedding,
            task=task,
            response_latency_budget_ms=spec.response_latency_budget_ms,
            horizon=horizon,
            previews=spec.previews,
            rollouts=rollouts,
        )
        try:
            promise = self._open_in_engine(engine_spec)
        except AdmissionRefused as exc:
            self._refuse(
                context,
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{exc.reason} (resource {exc.resource}, short by {exc.shortfall})",
                exc.resource,
            )
        except ValueError as exc:
            self._refuse(context, grpc.StatusCode.INVALID_ARGUMENT, f"bad stream spec: {exc}")
        except (StreamFailed, TimeoutError) as exc:
            self._refuse(context, grpc.StatusCode.UNAVAILABLE, f"engine cannot open: {exc!r}")
        budget_ms = spec.response_latency_budget_ms
        # (the promise carries its latency rounded to the microsecond)
        if budget_ms and promise.expected_response_latency_ms > budget_ms + 1e-3:
            # An engine without a planner for the budget (it promised what its placement
            # gives): the client asked for less, so the stream is not opened.
            self._loop.call(lambda _e: self._loop.live.close(promise.stream_id), timeout_s=5.0)
            self._refuse(
                context,
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"latency: response latency {promise.expected_response_latency_ms:.1f} ms > "
                f"budget {budget_ms:.1f} ms (resource latency, short by "
                f"{promise.expected_response_latency_ms - budget_ms:.1f} ms)",
                "latency",
            )
        live, sid = self._loop.live, promise.stream_id
        predicts = promise.action_mode == "predict"
        session = Session(
            promise=promise,
            limits=self._config.limits,
            add_frame=lambda frame: live.add_frame(sid, frame),
            slot_counters=lambda: live.counters(sid),
            client_name=spec.client_name,
            contract=getattr(self._loop.engine, "contract", None) if predicts else None,
            task=task,
        )
        session.on_end = lambda why: self._finish(session, why)
        self.on_opened(session)
        session.resume_token = self.detached.token_for(spec.resumable)
        with self._lock:
            self._sessions[promise.stream_id] = session
            self.streams_opened += 1
        self._loop.add(session)
        log.info("opened stream %d for %r", promise.stream_id, spec.client_name)
        reply = pb.OpenStreamReply(protocol_version=PROTOCOL_VERSION)
        promise_to_proto(
            promise, reply.promise, max_observation_bytes=self._config.limits.max_observation_bytes
        )
        if session.resume_token:
            resume_to_reply(reply, token=session.resume_token, grace_s=self.detached.grace_s)
        return reply

    def _open_in_engine(self, engine_spec: StreamSpec):
        """The stream opened in the engine: its promise (a detached stream is given back
        when the engine refuses it the room)."""
        live = self._config.limits.live()
        return self.detached.reclaiming(
            lambda: self._loop.call(
                lambda _e: self._loop.live.open(engine_spec, live),
                timeout_s=self._config.open_timeout_s,
            )
        )

    # ---- Stream ------------------------------------------------------------------------

    def stream(self, request_iterator, context) -> Iterator[bytes]:
        metadata = dict(context.invocation_metadata())
        raw_id = metadata.get(STREAM_ID_METADATA_KEY)
        try:
            stream_id = int(raw_id)
        except (TypeError, ValueError):
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"metadata {STREAM_ID_METADATA_KEY} must name a stream id, got {raw_id!r}",
            )
        with self._lock:
            session = self._sessions.get(stream_id)
        if session is None:
            context.abort(grpc.StatusCode.NOT_FOUND, f"unknown stream id {stream_id}")
        try:
            attachment, detached_for_s = session.attach(metadata.get(RESUME_TOKEN_METADATA_KEY))
        except AttachRefused as exc:
            if exc.code == grpc.StatusCode.PERMISSION_DENIED:
                self._refuse(context, exc.code, exc.details)
            context.abort(exc.code, exc.details)
        if detached_for_s is not None:
            self.detached.resumed(session, detached_for_s)
        # A client that goes away (cancel, crash, network) ends the call: its stream is
        # detached for its client to resume, or closed (its slots freed).
        context.add_callback(lambda: self._call_ended(session, attachment, "call ended"))
        reader = threading.Thread(
            target=self._read,
            args=(session, request_iterator),
            name=f"physis-read-{stream_id}",
            daemon=True,
        )
        reader.start()
        self._loop.wake()
        try:
            while context.is_active() and session.holds(attachment):
                item = session.next_outbound(0.1, attachment)
                if item is None:
                    continue
                if isinstance(item, SessionEnded):
                    if item.code != grpc.StatusCode.OK:
                        context.abort(item.code, item.details)
                    return
                yield item
            if context.is_active():
                context.abort(grpc.StatusCode.ABORTED, "a newer Stream call resumed this stream")
        finally:
            self._call_ended(session, attachment, "writer ended")

    def _read(self, session: Session, request_iterator) -> None:
        try:
            for raw in request_iterator:
                self.idle_trim.note(len(raw))
                session.offer(raw, time.time_ns())  # never raises: faults are counted drops
                del raw  # not held while the stream waits for its next message (MBs each)
        except grpc.RpcError as exc:  # the call was cancelled or broke: the writer ends it
            log.debug("stream %d reader ended: %s", session.stream_id, exc)
        except Exception as exc:  # the stream is told, with the cause
            # Nothing reads this stream's observations any more: end it rather than let it
            # predict on from the last good one.
            log.exception("stream %d: reading observations failed", session.stream_id)
            session.end(grpc.StatusCode.INTERNAL, f"server stopped reading observations: {exc!r}")

    def _call_ended(self, session: Session, attachment: int, why: str) -> None:
        """Stream call ``attachment`` ended: a resumable stream it held is detached for its
        grace; any other stream is closed (a resumed one is left to its newer call)."""
        if not session.resume_token or (
            not self.detached.detach(session, attachment, why) and session.closed
        ):
            self._finish(session, why)

    def _finish(
        self, session: Session, why: str, code: grpc.StatusCode = grpc.StatusCode.OK
    ) -> None:
        with self._lock:
            if self._sessions.pop(session.stream_id, None) is None:
                return
            self.streams_closed += 1
        self.on_closed(session)
        self.detached.forget(session)
        session.end(code, why)
        self._loop.remove(session)
        log.info("closed stream %d: %s", session.stream_id, why)

    # ---- CloseStream, GetServerInfo ----------------------------------------------------

    def close_stream(self, raw: bytes, context) -> pb.CloseStreamReply:
        try:
            request = pb.CloseStreamRequest.FromString(raw)
        except DecodeError as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"malformed CloseStreamRequest: {exc}")
        with self._lock:
            session = self._sessions.get(request.stream_id)
        if session is None:
            # As the proto promises: not open (already closed or never opened) is an answer.
            return pb.CloseStreamReply(closed=False)
        self._finish(session, "CloseStream")
        reply = pb.CloseStreamReply(closed=True)
        counts_to_proto(session.counters(), reply.counters)
        return reply

    def server_info(self, raw: bytes, context) -> pb.ServerInfo:
        try:
            pb.ServerInfoRequest.FromString(raw)
        except DecodeError as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"malformed ServerInfoRequest: {exc}")
        d = self._description
        with self._lock:
            sessions = list(self._sessions.values())
            info = pb.ServerInfo(
                protocol_version=PROTOCOL_VERSION,
                model=d.model,
                steps=d.steps,
                blocks=d.blocks,
                placement=d.placement,
                open_streams=len(sessions),
                server_time_ns=time.time_ns(),
                uptime_s=time.monotonic() - self._started_s,
                streams_opened=self.streams_opened,
                streams_closed=self.streams_closed,
                refusals=dict(self.refusals),
                streams_expired=self.detached.streams_expired,
                streams_reclaimed=self.detached.streams_reclaimed,
                streams_resumed=self.detached.streams_resumed,
            )
        contract = getattr(self._loop.engine, "contract", None)
        if contract is not None:
            info.contract = contract.to_json()
        now_s = time.monotonic()
        for s in sessions:
            promise, detached_s = s.promise, s.detached_s
            info.streams.add(
                stream_id=s.stream_id,
                attached=s.attached and detached_s is None,
                detached_s=0.0 if detached_s is None else now_s - detached_s,
                resumes=s.resumes,
                achieved_interval_ms=s.achieved_interval_ms(),
                chunks_out=s.chunks_out,
                counters=counts_to_proto(s.counters(), pb.StreamCounters()),
                client_name=s.client_name,
                promised_interval_ms=promise.expected_interval_ms,
                promised_response_latency_ms=promise.expected_response_latency_ms,
                promise_revision=promise.revision,
                response_latency_ms=s.response_latency_ms(),
            )
        describe = d.engine_info or getattr(self._loop.engine, "info", None)
        if callable(describe):
            info.engine.update({str(k): str(v) for k, v in describe().items()})
        if self._loop.error:
            info.engine["error"] = self._loop.error
        return info

    def open_sessions(self) -> list[Session]:
        with self._lock:
            return list(self._sessions.values())

    def close_all(self, why: str, code: grpc.StatusCode = grpc.StatusCode.OK) -> None:
        for s in self.open_sessions():
            self._finish(s, why, code)
