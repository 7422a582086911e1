"""``EngineLoop``: the serving loop, the one thread that calls the engine core (the gRPC
threads never block on it).

It runs what the gRPC threads ask of the engine (opening and closing streams) on this thread,
then turns the served streams (``LiveStreams.step``: their live timelines, DESIGN.md §3.1)
and routes what came back to the sessions: finished chunks to their writers, drops to their
counters, ends to their calls, revised promises (another stream joined or left) to their
clients. When nothing is outstanding it sleeps until a session wakes it (a frame completed a
slot), a paced stream is due, or ``idle_wait_s`` passed: never spinning, so the gRPC threads
get the GIL to move bytes.
"""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import grpc

from physis_ros.engine.api import StreamEngine, StreamFailed
from physis_ros.engine.live_streams import LiveStreams, Step
from physis_ros.serve.session import Session

log = logging.getLogger(__name__)

END_CODES = {
    "stalled": grpc.StatusCode.UNAVAILABLE,
    "failed": grpc.StatusCode.UNAVAILABLE,
    "broken": grpc.StatusCode.INTERNAL,
    "internal": grpc.StatusCode.INTERNAL,
}
"""How a stream the core ended ends its call (UNAVAILABLE: the client reconnects)."""


class EngineLoop:
    """The serving loop (see the module docstring)."""

    def __init__(
        self, engine: StreamEngine, *, poll_timeout_s: float = 0.002, idle_wait_s: float = 0.02
    ) -> None:
        if poll_timeout_s <= 0 or idle_wait_s <= 0:
            raise ValueError(
                f"poll_timeout_s {poll_timeout_s} and idle_wait_s {idle_wait_s} must be > 0"
            )
        self.engine = engine
        self.live = LiveStreams(engine)
        """The served streams (their timelines); this thread turns them."""
        self._poll_timeout_s = poll_timeout_s
        self._idle_wait_s = idle_wait_s
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._sessions: dict[int, Session] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="physis-engine", daemon=True)
        self.error = ""
        """Why the engine (or this thread) failed for every stream; "" while it serves."""
        self.on_impaired: Callable[[str], None] | None = None
        """Called (engine thread) when the server can no longer serve as configured: the
        engine failed, or reports itself impaired (``engine.impairment()``, e.g. a dead rank)."""

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
        session.on_observed = self.wake
        self._commands.put(
            (lambda _e: self._sessions.__setitem__(session.stream_id, session), None)
        )

    def remove(self, session: Session) -> None:
        """Forget the stream and close it in the core (its KV slots), on the engine thread."""
        self._commands.put((lambda _e: self._close(session), None))

    def _close(self, session: Session) -> None:
        if self._sessions.pop(session.stream_id, None) is not None:
            self.live.close(session.stream_id)

    def _run(self) -> None:
        try:
            self._serve()
        except Exception as exc:  # every stream and the health check are told
            log.exception("the engine thread failed")
            self._fail_all(f"engine thread failed: {exc!r}", grpc.StatusCode.INTERNAL)
            # Keep answering: an OpenStream gets an error at once instead of its timeout.
            while not self._stop.is_set():
                self._run_commands(timeout_s=self._idle_wait_s, refuse=self.error)

    def _serve(self) -> None:
        wait_s = 0.0
        while not self._stop.is_set():
            self._run_commands(timeout_s=wait_s)
            self._end_unattached()
            outstanding = self.live.outstanding()
            try:
                step = self.live.step(self._poll_timeout_s if outstanding else 0.0)
            except StreamFailed as exc:  # one that names no stream: the engine is gone
                self._fail_all(f"engine failed: {exc}", grpc.StatusCode.UNAVAILABLE)
                continue
            self._route(step)
            if self.live.outstanding():
                wait_s = 0.0
            else:
                due = self.live.due_s()
                wait_s = self._idle_wait_s if due is None else min(self._idle_wait_s, due)

    def _route(self, step: Step) -> None:
        for ran in step.ran:
            session = self._sessions.get(ran.out.stream_id)
            if session is not None:
                session.take(ran)
        failed = False
        for event in step.events:
            session = self._sessions.get(event.stream_id)
            if session is None:
                continue
            if event.kind == "drop":
                session.drop(event.reason, event.detail)
                continue
            log.error(
                "stream %d ended in the engine (%s): %s",
                event.stream_id,
                event.reason,
                event.detail,
            )
            self._sessions.pop(event.stream_id, None)
            session.end(END_CODES[event.reason], event.detail)
            failed |= event.reason == "failed"
        if failed:
            self._check_impaired()
        for promise in step.revised:
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

    def _end_unattached(self) -> None:
        now_s = time.monotonic()
        for session in list(self._sessions.values()):
            timeout_s = session.limits.unattached_timeout_s
            if not session.attached and now_s - session.opened_s > timeout_s:
                session.end(grpc.StatusCode.DEADLINE_EXCEEDED, "stream was never attached")
                self._close(session)

    def _fail_all(self, error: str, code: grpc.StatusCode) -> None:
        self.error = error
        log.error("%s", error)
        for session in list(self._sessions.values()):
            session.end(code, error)
            self._close(session)
        self._report_impaired(error)

    def _report_impaired(self, why: str) -> None:
        if self.on_impaired is not None:
            self.on_impaired(why)

    def _check_impaired(self) -> None:
        """After a stream failed in the engine: the engine may say it is impaired (a rank is
        gone), which turns health NOT_SERVING while the other streams go on."""
        impairment = getattr(self.engine, "impairment", None)
        why = impairment() if callable(impairment) else ""
        if why:
            self._report_impaired(why)

    def _run_commands(self, *, timeout_s: float, refuse: str = "") -> None:
        """Runs queued commands; with ``refuse``, calls fail with StreamFailed(refuse)."""
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
            if refuse:
                if future is not None and future.set_running_or_notify_cancel():
                    future.set_exception(StreamFailed(refuse))
            elif future is None:
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

    def sessions(self) -> list[Session]:
        return list(self._sessions.values())
