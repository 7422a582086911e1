"""What the link client counts (``LinkCounters``) and the snapshot it gives the robot
(``LinkStats``): its state, the promise of its stream, what it sent and received, drops by
side and reason, the newest error and when it came. One lock: the connection thread updates,
any thread reads. numpy-free: protobuf only.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from physis_ros.link.clock import ClockSample
from physis_ros.link.proto_gen import physis_pb2 as pb
from physis_ros.link.wire_promise import LinkPromise, promise_from_proto

STATES = ("connecting", "connected", "streaming", "disconnected")


@dataclass(frozen=True, kw_only=True)
class LinkStats:
    """A snapshot of the link, for diagnostics."""

    state: str
    """connecting | connected | streaming | disconnected."""
    promise: LinkPromise | None
    clock_offset_ms: float | None
    """Server wall clock minus robot clock (None before the first probe)."""
    clock_offset_uncertainty_ms: float | None
    robot_time_ns: int
    """Robot clock when this snapshot was taken."""
    server_time_ns: int | None
    """The server clock at that instant, estimated through the offset."""
    observations_sent: int
    drops: dict[str, int] = field(default_factory=dict)
    """"client:<reason>" and "server:<reason>" -> count, over every connection so far."""
    predictions_received: int = 0
    connections: int = 0
    """Connections that streamed so far (1 + reconnects, resumes among them)."""
    resumes: int = 0
    """Connections that resumed the stream whose call broke (same stream id, its history
    kept on the server) instead of opening a new one."""
    last_error: str = ""
    last_error_ns: int = 0
    """Robot clock when ``last_error`` happened: an error from before the stream came back
    is history, not the reason chunks are missing now."""


class LinkCounters:
    """The link's figures (module docstring), kept for ``LinkClient.stats``."""

    def __init__(self, clock_ns: Callable[[], int]) -> None:
        self._clock_ns = clock_ns
        self._lock = threading.Lock()
        self.state = "disconnected"
        self.promise: LinkPromise | None = None
        self._observations_sent = 0
        self._predictions_received = 0
        self._connections = 0
        self._last_error = ""
        self._last_error_ns = 0
        self._client_drops: collections.Counter[str] = collections.Counter()
        self._server_drops_past: collections.Counter[str] = collections.Counter()
        self._server_drops_now: dict[str, int] = {}

    def set_state(self, state: str) -> None:
        with self._lock:
            self.state = state

    def set_error(self, text: str) -> None:
        with self._lock:
            self._last_error = text
            self._last_error_ns = self._clock_ns()

    def count_client_drop(self, reason: str) -> None:
        with self._lock:
            self._client_drops[reason] += 1

    def opened(self, promise: LinkPromise) -> None:
        """A new stream: its promise; the last stream's server drops are history now."""
        with self._lock:
            self.promise = promise
            self._connections += 1
            self._server_drops_past.update(self._server_drops_now)
            self._server_drops_now = {}

    def resumed(self) -> None:
        with self._lock:
            self._connections += 1

    def revised(self, revised: pb.StreamPromise) -> None:
        """The server revised the stream's promise: kept, with what only OpenStream says
        (the message limit)."""
        with self._lock:
            if self.promise is not None and revised.stream_id == self.promise.stream_id:
                limit = self.promise.max_observation_bytes
                self.promise = promise_from_proto(revised, max_observation_bytes=limit)

    def sent(self) -> None:
        with self._lock:
            self._observations_sent += 1

    def received(self) -> None:
        with self._lock:
            self._predictions_received += 1

    def take_server_counts(self, counters: pb.StreamCounters) -> dict[str, int]:
        """The server's drop counts of this stream, kept; returned."""
        drops = dict(counters.drops) if counters.drops else {}
        detail = counters.last_drop_detail
        with self._lock:
            # every message repeats the stream's newest drop: it is news when the count grew
            dropped_more = sum(drops.values()) > sum(self._server_drops_now.values())
            self._server_drops_now = drops
            if detail and dropped_more:
                self._last_error = f"server dropped: {detail}"
                self._last_error_ns = self._clock_ns()
        return drops

    def snapshot(self, best: ClockSample | None, *, resumes: int) -> LinkStats:
        """The figures now, with the clock offset's best estimate (None before a probe)."""
        now_ns = self._clock_ns()
        with self._lock:
            drops = {f"client:{k}": v for k, v in self._client_drops.items()}
            server = collections.Counter(self._server_drops_past)
            server.update(self._server_drops_now)
            drops.update({f"server:{k}": v for k, v in server.items() if v})
            return LinkStats(
                state=self.state,
                promise=self.promise,
                clock_offset_ms=None if best is None else best.offset_ns / 1e6,
                clock_offset_uncertainty_ms=None if best is None else best.round_trip_ns / 2e6,
                robot_time_ns=now_ns,
                server_time_ns=None if best is None else now_ns + best.offset_ns,
                observations_sent=self._observations_sent,
                drops=drops,
                predictions_received=self._predictions_received,
                connections=self._connections,
                resumes=resumes,
                last_error=self._last_error,
                last_error_ns=self._last_error_ns,
            )
