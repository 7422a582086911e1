"""How the link client reaches the server again: its channels (TLS or not, waited on until
ready, with the reason when they are not), and the stream it resumes after a broken call.

A stream opened as resumable comes with a ticket (``wire_promise.ResumeTicket``: its id,
resume token and the server's grace). When its Stream call breaks (a link blip, a proxy that
dropped the connection), the client's next connection first re-attaches to that stream with
the ticket, while the server still holds it; a server that no longer does (the grace ended,
it restarted) says NOT_FOUND and the client opens a new stream. numpy-free: grpc only.
"""

from __future__ import annotations

import logging
import queue
import time

import grpc

from physis_ros.link.proto_gen import physis_pb2 as pb
from physis_ros.link.proto_gen import physis_pb2_grpc as pb_grpc
from physis_ros.link.wire import AUTH_METADATA_KEY
from physis_ros.link.wire_promise import ResumeTicket

log = logging.getLogger(__name__)

CONNECTIVITY_POLL_S = 0.2
"""grpc's connectivity thread (behind ``subscribe``) watches the state in steps this long."""

RESUME_REFUSED = (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.PERMISSION_DENIED)
"""A resume answered so is given up: the server holds no such stream (or not for us)."""


class NotConnected(Exception):
    """No connection to the server within the connect timeout; says why where gRPC knows."""


def rpc_error_text(exc: grpc.RpcError) -> str:
    code = exc.code() if hasattr(exc, "code") else None
    details = exc.details() if hasattr(exc, "details") else str(exc)
    return f"{code.name if code is not None else 'RPC'}: {details}"


def close_after_polling(channel: grpc.Channel) -> None:
    """Close ``channel`` once grpc's connectivity thread has seen it unsubscribed: closed under
    that thread's next watch, the thread dies with 'Cannot monitor channel state: Channel
    closed!' and a traceback on stderr (grpc 1.x; the attribute is read defensively)."""
    state = getattr(channel, "_connectivity_state", None)
    deadline = time.monotonic() + 10 * CONNECTIVITY_POLL_S  # it ends after one step
    while getattr(state, "polling", False) and time.monotonic() < deadline:
        time.sleep(0.01)
    channel.close()


class Connector:
    """Channels to one server: its address, credentials, channel options and call metadata."""

    def __init__(
        self,
        target: str,
        *,
        token: str | None,
        root_cert_path: str | None,
        client_cert_path: str | None,
        client_key_path: str | None,
        connect_timeout_s: float,
        backoff_s: tuple[float, float],
        max_message_bytes: int,
        tls_server_name: str | None,
    ) -> None:
        if (client_cert_path is None) != (client_key_path is None):
            raise ValueError("client_cert_path and client_key_path go together")
        if client_cert_path is not None and root_cert_path is None:
            raise ValueError("client certificates need TLS: give root_cert_path too")
        self.target = target
        self.connect_timeout_s = connect_timeout_s
        self.metadata: tuple[tuple[str, str], ...] = (
            ((AUTH_METADATA_KEY, f"Bearer {token}"),) if token else ()
        )
        """Every call's: the bearer token."""
        self._credentials = None
        if root_cert_path is not None:
            key = chain = None
            if client_cert_path is not None:
                with open(client_key_path, "rb") as f:
                    key = f.read()
                with open(client_cert_path, "rb") as f:
                    chain = f.read()
            with open(root_cert_path, "rb") as f:
                self._credentials = grpc.ssl_channel_credentials(f.read(), key, chain)
        lo, hi = backoff_s
        self._options = [
            ("grpc.max_send_message_length", max_message_bytes),
            ("grpc.max_receive_message_length", max_message_bytes),
            # Large windows and frames: a camera image goes out without waiting for window
            # updates.
            ("grpc.http2.lookahead_bytes", max_message_bytes),
            ("grpc.http2.max_frame_size", (1 << 24) - 1),
            ("grpc.initial_reconnect_backoff_ms", int(lo * 1000)),
            ("grpc.min_reconnect_backoff_ms", int(lo * 1000)),
            ("grpc.max_reconnect_backoff_ms", int(hi * 1000)),
            ("grpc.keepalive_time_ms", 10_000),
            ("grpc.enable_retries", 0),
        ]
        if tls_server_name:
            self._options.append(("grpc.ssl_target_name_override", tls_server_name))

    def channel(self) -> grpc.Channel:
        if self._credentials is not None:
            return grpc.secure_channel(self.target, self._credentials, self._options)
        return grpc.insecure_channel(self.target, self._options)

    def wait_ready(self, channel: grpc.Channel) -> None:
        """Until ``channel`` is ready. A failed attempt (TLS handshake, connection refused)
        raises NotConnected with its reason at once, not after the connect timeout: a
        handshake that failed fails again, and a wait would look like a slow network."""
        states: queue.SimpleQueue[grpc.ChannelConnectivity] = queue.SimpleQueue()
        callback = states.put
        channel.subscribe(callback, try_to_connect=True)
        try:
            deadline = time.monotonic() + self.connect_timeout_s
            failed = False
            while (left_s := deadline - time.monotonic()) > 0:
                try:
                    state = states.get(timeout=left_s)
                except queue.Empty:
                    break
                if state == grpc.ChannelConnectivity.READY:
                    return
                if state in (
                    grpc.ChannelConnectivity.TRANSIENT_FAILURE,
                    grpc.ChannelConnectivity.SHUTDOWN,
                ):
                    failed = True
                    break
            raise NotConnected(self._why_not_connected(channel, failed=failed))
        finally:
            channel.unsubscribe(callback)

    def _why_not_connected(self, channel: grpc.Channel, *, failed: bool) -> str:
        """Why ``channel`` did not become ready (``failed``: an attempt failed, else the
        connect timeout passed): one quick call fetches gRPC's last error (a TLS handshake
        failure otherwise looks like a timeout)."""
        head = f"connect to {self.target}"
        waited = (
            "the connection attempt failed"
            if failed
            else f"no connection within {self.connect_timeout_s} s"
        )
        try:
            pb_grpc.PhysisStub(channel).GetServerInfo(
                pb.ServerInfoRequest(),
                metadata=self.metadata,
                timeout=min(self.connect_timeout_s, 2.0),
            )
        except grpc.RpcError as exc:
            details = (exc.details() or "").split("last error: ")[-1]
        else:
            return f"{head}: {waited}"
        lowered = details.lower()
        if "handshake" in lowered or "ssl" in lowered or "tls" in lowered:
            return (
                f"{head}: TLS handshake failed ({details}); the server's certificate must "
                "chain to the CA given (root_cert_path, --tls-ca) and name the host dialled "
                "(or tls_server_name)"
            )
        if "socket closed" in lowered and self._credentials is None:
            return (
                f"{head}: the server closed the connection during setup ({details}); it "
                "probably requires TLS: give the CA of its certificate (root_cert_path, "
                "--tls-ca)"
            )
        if "refused" in lowered:
            return f"{head}: nothing listens there (connection refused)"
        if "resolv" in lowered or "dns" in lowered:
            return f"{head}: the host name does not resolve ({details})"
        return f"{head}: {waited} ({details})"


class Resumer:
    """The stream the client resumes after its Stream call broke: its ticket, and since when
    the call is broken (the server holds the stream for the ticket's grace from about then).
    One thread (the client's connection thread) calls it."""

    def __init__(self) -> None:
        self.ticket: ResumeTicket | None = None
        self._broke_s: float | None = None
        self.resumes = 0

    def opened(self, ticket: ResumeTicket | None) -> None:
        """A new stream opened (None: not resumable)."""
        self.ticket, self._broke_s = ticket, None

    def broke(self) -> None:
        """The stream's call broke (the first of a run of failed attempts starts the clock)."""
        if self.ticket is not None and self._broke_s is None:
            self._broke_s = time.monotonic()

    def forget(self) -> None:
        """The stream is not to be resumed (it ended on purpose, or the server refused it)."""
        self.ticket, self._broke_s = None, None

    def due(self) -> ResumeTicket | None:
        """The ticket to resume with now: the call broke and the server still holds the
        stream (None: open a new stream)."""
        ticket, broke_s = self.ticket, self._broke_s
        if ticket is None or broke_s is None:
            return None
        if time.monotonic() - broke_s >= ticket.grace_s:
            self.forget()  # the server has closed it by now
            return None
        return ticket

    def refused(self, exc: grpc.RpcError) -> bool:
        """A resume ended with ``exc`` before any message: True when the server refused it
        (the stream is forgotten: open a new one), False for a link fault (try again)."""
        if exc.code() not in RESUME_REFUSED:
            return False
        log.info(
            "stream %d cannot be resumed (%s): opening a new stream",
            self.ticket.stream_id if self.ticket is not None else -1,
            rpc_error_text(exc),
        )
        self.forget()
        return True

    def resumed(self) -> float:
        """The resumed call brought its first message: says so once; returns the outage (s,
        from the call breaking to now)."""
        outage_s = time.monotonic() - (self._broke_s or time.monotonic())
        self._broke_s = None
        self.resumes += 1
        sid = self.ticket.stream_id if self.ticket is not None else -1
        log.info("resumed stream %d after %.1f s", sid, outage_s)
        return outage_s
