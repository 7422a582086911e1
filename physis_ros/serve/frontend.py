"""The gRPC front end: the Physis service, bearer-token auth, health checking, the server.

Handlers take raw request bytes and parse them here, so a malformed message gets a clear
status (or, inside a stream, is dropped and counted) instead of grpc's generic INTERNAL.
Handlers never call the engine: they hand work to the ``EngineLoop`` thread (session.py).
"""

from __future__ import annotations

import hmac
import logging
import math
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from physis_ros.engine.api import DEFAULT_HORIZON, AdmissionRefused, StreamFailed, StreamSpec
from physis_ros.link.memtune import freeze_startup_objects, retain_freed_memory
from physis_ros.link.proto_gen import physis_pb2 as pb
from physis_ros.link.wire import (
    AUTH_METADATA_KEY,
    PROMISE_FIELDS,
    PROTOCOL_VERSION,
    STREAM_ID_METADATA_KEY,
    WireError,
    tensor_to_array,
)
from physis_ros.serve.session import EngineLoop, Session, SessionEnded, SessionLimits

log = logging.getLogger(__name__)

SERVICE_NAME = "physis.v1.Physis"
HTTP2_MAX_FRAME_BYTES = (1 << 24) - 1
"""The largest HTTP/2 frame the protocol allows."""


@dataclass(frozen=True, kw_only=True)
class FrontendConfig:
    """How the server front end listens and what it accepts."""

    host: str = "127.0.0.1"
    """Interface to bind; anything but loopback should come with TLS and a token."""
    port: int = 0
    """0: an ephemeral port (see ServerHandle.port)."""
    max_message_bytes: int = 16 * 1024 * 1024
    """gRPC limit per message; a larger one ends its call with RESOURCE_EXHAUSTED."""
    limits: SessionLimits = field(default_factory=SessionLimits)
    max_streams: int = 16
    """Streams open at once, whatever the engine could admit."""
    worker_threads: int = 64
    """gRPC handler threads; each attached stream holds one."""
    open_timeout_s: float = 30.0
    """How long OpenStream waits for the engine to admit."""
    token: str | None = None
    """Bearer token every call must carry (metadata ``authorization: Bearer <token>``)."""
    tls_cert_path: str | None = None
    tls_key_path: str | None = None
    tls_client_ca_path: str | None = None
    """When given, clients must present a certificate signed by this CA."""

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be 0..65535, got {self.port}")
        if self.limits.max_observation_bytes > self.max_message_bytes:
            raise ValueError(
                f"max_observation_bytes {self.limits.max_observation_bytes} exceeds "
                f"max_message_bytes {self.max_message_bytes}"
            )
        if self.max_streams < 1:
            raise ValueError(f"max_streams must be >= 1, got {self.max_streams}")
        if self.worker_threads < self.max_streams + 4:
            raise ValueError(
                f"worker_threads {self.worker_threads} must be >= max_streams + 4 "
                f"({self.max_streams + 4}): every attached stream holds a thread"
            )
        if (self.tls_cert_path is None) != (self.tls_key_path is None):
            raise ValueError("tls_cert_path and tls_key_path go together")
        if self.tls_client_ca_path is not None and self.tls_cert_path is None:
            raise ValueError("tls_client_ca_path needs tls_cert_path and tls_key_path")
        if self.token is not None and not self.token.strip():
            raise ValueError("token must not be empty")


@dataclass(frozen=True, kw_only=True)
class ServerDescription:
    """What GetServerInfo reports about the model and placement."""

    model: str
    steps: int
    blocks: int
    placement: str = ""
    action_mode: str = "none"
    """The model's action_mode; "condition": generate requests carry commanded actions."""
    horizon: int = 0
    """The model's default horizon (weights' metadata; 0: none, streams then get
    ``DEFAULT_HORIZON``)."""
    engine_info: Callable[[], dict[str, Any]] | None = None
    """What the engine reports about itself (workers, open streams / slots), on demand."""


class TokenAuthInterceptor(grpc.ServerInterceptor):
    """Every call must carry ``authorization: Bearer <token>``; otherwise UNAUTHENTICATED and
    the handler never runs."""

    def __init__(self, token: str) -> None:
        self._expected = f"Bearer {token}".encode()

    def intercept_service(self, continuation, handler_call_details):
        for key, value in handler_call_details.invocation_metadata or ():
            if key == AUTH_METADATA_KEY:
                got = value.encode() if isinstance(value, str) else value
                if hmac.compare_digest(got, self._expected):
                    return continuation(handler_call_details)
                break
        handler = continuation(handler_call_details)
        return _refusing_handler(handler)


def _refusing_handler(handler: grpc.RpcMethodHandler | None) -> grpc.RpcMethodHandler:
    def refuse(_request, context):
        context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or invalid bearer token")

    if handler is None or not (handler.request_streaming or handler.response_streaming):
        return grpc.unary_unary_rpc_method_handler(refuse)
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(refuse)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(refuse)
    return grpc.unary_stream_rpc_method_handler(refuse)


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
        self._started_s = time.monotonic()
        self.streams_opened = 0
        self.streams_closed = 0
        self.refusals: Counter[str] = Counter()

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

    def _refuse(self, context, code: grpc.StatusCode, details: str):
        with self._lock:
            self.refusals[code.name] += 1
        context.abort(code, details)

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
        with self._lock:
            open_now = len(self._sessions)
        if open_now >= self._config.max_streams:
            self._refuse(
                context,
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{open_now} streams open, front end max_streams is {self._config.max_streams}",
            )
        embedding = None
        if spec.HasField("prompt_embedding"):
            try:
                embedding = tensor_to_array(spec.prompt_embedding, name="prompt_embedding")
            except WireError as exc:
                self._refuse(context, grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        # A served stream always has a horizon: observations replace predicted slots.
        horizon = spec.horizon or self._description.horizon or DEFAULT_HORIZON
        engine_spec = StreamSpec(
            seed=spec.seed,
            target_interval_ms=spec.target_interval_ms,
            prompt=spec.prompt,
            prompt_embedding=embedding,
            horizon=horizon,
            previews=spec.previews,
        )
        try:
            promise = self._loop.call(
                lambda e: e.open_stream(engine_spec), timeout_s=self._config.open_timeout_s
            )
        except AdmissionRefused as exc:
            self._refuse(
                context,
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{exc.reason} (resource {exc.resource}, short by {exc.shortfall})",
            )
        except ValueError as exc:
            self._refuse(context, grpc.StatusCode.INVALID_ARGUMENT, f"bad stream spec: {exc}")
        except (StreamFailed, TimeoutError) as exc:
            self._refuse(context, grpc.StatusCode.UNAVAILABLE, f"engine cannot open: {exc!r}")
        session = Session(
            promise=promise,
            target_interval_ms=spec.target_interval_ms,
            limits=self._config.limits,
            client_name=spec.client_name,
        )
        session.on_end = lambda why: self._finish(session, why)
        with self._lock:
            self._sessions[promise.stream_id] = session
            self.streams_opened += 1
        self._loop.add(session)
        log.info("opened stream %d for %r", promise.stream_id, spec.client_name)
        return pb.OpenStreamReply(
            protocol_version=PROTOCOL_VERSION,
            promise=pb.StreamPromise(
                **{name: getattr(promise, name) for name in PROMISE_FIELDS},
                max_observation_bytes=self._config.limits.max_observation_bytes,
            ),
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
            if session is not None and not session.attached and not session.closed:
                session.attached = True
                claimed = True
            else:
                claimed = False
        if session is None:
            context.abort(grpc.StatusCode.NOT_FOUND, f"unknown stream id {stream_id}")
        if not claimed:
            context.abort(
                grpc.StatusCode.ALREADY_EXISTS, f"stream {stream_id} is already attached or closed"
            )
        # A client that goes away (cancel, crash, network) ends the call: free its slots.
        context.add_callback(lambda: self._finish(session, "call ended"))
        reader = threading.Thread(
            target=self._read,
            args=(session, request_iterator),
            name=f"physis-read-{stream_id}",
            daemon=True,
        )
        reader.start()
        self._loop.wake()
        try:
            while context.is_active():
                item = session.next_outbound(0.1)
                if item is None:
                    continue
                if isinstance(item, SessionEnded):
                    if item.code != grpc.StatusCode.OK:
                        context.abort(item.code, item.details)
                    return
                yield item
        finally:
            self._finish(session, "writer ended")

    def _read(self, session: Session, request_iterator) -> None:
        try:
            for raw in request_iterator:
                session.offer(raw, time.time_ns())
        except grpc.RpcError as exc:  # the call was cancelled or broke: the writer ends it
            log.debug("stream %d reader ended: %s", session.stream_id, exc)

    def _finish(self, session: Session, why: str) -> None:
        with self._lock:
            if self._sessions.pop(session.stream_id, None) is None:
                return
            self.streams_closed += 1
        session.end(grpc.StatusCode.OK, why)
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
            context.abort(grpc.StatusCode.NOT_FOUND, f"unknown stream id {request.stream_id}")
        self._finish(session, "CloseStream")
        return pb.CloseStreamReply(closed=True, counters=session.counters())

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
            )
        for s in sessions:
            info.streams.add(
                stream_id=s.stream_id,
                attached=s.attached,
                achieved_interval_ms=s.achieved_interval_ms(),
                chunks_out=s.chunks_out,
                counters=s.counters(),
                client_name=s.client_name,
            )
        describe = d.engine_info or getattr(self._loop.engine, "info", None)
        if callable(describe):
            info.engine.update({str(k): str(v) for k, v in describe().items()})
        if self._loop.error:
            info.engine["error"] = self._loop.error
        return info

    def close_all(self, why: str) -> None:
        with self._lock:
            sessions = list(self._sessions.values())
        for s in sessions:
            self._finish(s, why)


@dataclass
class ServerHandle:
    """A running server: its port, and how to stop it."""

    server: grpc.Server
    port: int
    frontend: Frontend
    health: health.HealthServicer

    def stop(self, grace_s: float = 1.0) -> None:
        self.health.enter_graceful_shutdown()
        self.frontend.close_all("server shutting down")
        self.server.stop(grace_s).wait(grace_s + 1.0)


def start_server(
    loop: EngineLoop, *, config: FrontendConfig, description: ServerDescription
) -> ServerHandle:
    """Builds and starts the gRPC server; returns once it listens.

    Also tunes the process for the hot path: freed message buffers are reused instead of
    page-faulted in afresh (memtune), and what exists now (the engine, its weights' Python
    objects, imported modules) is moved out of the garbage collector's way (gc.freeze), so
    a full collection does not walk it between two messages."""
    retain_freed_memory()
    freeze_startup_objects()
    frontend = Frontend(loop, config=config, description=description)
    interceptors = [TokenAuthInterceptor(config.token)] if config.token else []
    server = grpc.server(
        futures.ThreadPoolExecutor(
            max_workers=config.worker_threads, thread_name_prefix="physis-grpc"
        ),
        handlers=[frontend.handler()],
        interceptors=interceptors,
        options=[
            ("grpc.max_receive_message_length", config.max_message_bytes),
            ("grpc.max_send_message_length", config.max_message_bytes),
            ("grpc.so_reuseport", 0),
            # Large windows and frames: a camera image crosses in one go, without waiting
            # for window updates (measured ~0.1-0.2 ms less per 0.9 MB on loopback).
            ("grpc.http2.lookahead_bytes", config.max_message_bytes),
            ("grpc.http2.max_frame_size", HTTP2_MAX_FRAME_BYTES),
        ],
        maximum_concurrent_rpcs=config.worker_threads - 2,
    )
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    address = f"{config.host}:{config.port}"
    if config.tls_cert_path is not None:
        with open(config.tls_key_path, "rb") as f:
            key = f.read()
        with open(config.tls_cert_path, "rb") as f:
            cert = f.read()
        client_ca = None
        if config.tls_client_ca_path is not None:
            with open(config.tls_client_ca_path, "rb") as f:
                client_ca = f.read()
        credentials = grpc.ssl_server_credentials(
            [(key, cert)], root_certificates=client_ca, require_client_auth=client_ca is not None
        )
        port = server.add_secure_port(address, credentials)
    else:
        if config.token is not None and config.host not in ("127.0.0.1", "localhost", "::1"):
            log.warning(
                "bearer token over plaintext on %s: anyone on the path can read it; "
                "use --tls-cert/--tls-key",
                config.host,
            )
        port = server.add_insecure_port(address)
    if port == 0:
        raise OSError(f"cannot bind {address}")
    server.start()
    for name in ("", SERVICE_NAME):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return ServerHandle(server=server, port=port, frontend=frontend, health=health_servicer)
