"""``EngineLoop``: the one thread that calls the engine (the gRPC threads never block on it).

It runs the live timeline (DESIGN.md §3): every observed chunk a ``Session`` completed enters
as its slot's observation (replacing the prediction of that slot in the history of every
chunk released after it), then the stream's not yet generated slots up to newest observed +
horizon are generated (at stream start ``horizon`` chunks, then one per observed chunk), or
with rollouts every slot up to it again (``horizon`` chunks per observation),
conditioned on the newest commanded actions held. It polls the engine and maps each finished
chunk to a prediction that names its anchor (the observation it reads last) and how many
chunks ahead it is. Generation is paced at the interval the stream was admitted at (a burst
of up to ``horizon`` chunks allowed, the slots a new observation releases at once, and half
an interval of jitter). Promises the engine revises (another stream joined or left) replace
the stream's own and go to its client.
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
import numpy as np

from physis_ros.engine.api import StreamEngine, StreamFailed
from physis_ros.serve.session import Anchor, Session

log = logging.getLogger(__name__)

MAX_BACKLOG_FACTOR = 4
"""A stream generates no more while this many times (pipeline depth + horizon) of its chunks
are still in the engine (the engine cannot keep up with its frames)."""
ANCHORS_KEPT = 1024
"""Observed slots a stream remembers for the replies of chunks anchored on them."""


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
        """Promises the engine revised (a stream joined or left, or the measured latencies
        moved them) go to their streams."""
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
        try:
            self._serve()
        except Exception as exc:  # every stream and the health check are told
            log.exception("the engine thread failed")
            self._fail_all(f"engine thread failed: {exc!r}", grpc.StatusCode.INTERNAL)
            # Keep answering: an OpenStream gets an error at once instead of its timeout.
            while not self._stop.is_set():
                self._run_commands(timeout_s=self._idle_wait_s, refuse=self.error)

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

    def _pump_guarded(self, session: Session) -> None:
        """``_pump``; an unexpected fault there ends that stream alone (INTERNAL)."""
        try:
            self._pump(session)
        except Exception as exc:  # the stream's client gets the cause
            log.exception("stream %d failed in the engine loop", session.stream_id)
            session.end(grpc.StatusCode.INTERNAL, f"stream failed in the server: {exc!r}")
            self._close(session)

    def _serve(self) -> None:
        wait_s = 0.0
        while not self._stop.is_set():
            self._run_commands(timeout_s=wait_s)
            for session in list(self._sessions.values()):
                self._pump_guarded(session)
            if not any(s.inflight for s in self._sessions.values()):
                # Nothing to poll: sleep on the command queue until a session wakes it (an
                # observed chunk completed) or idle_wait_s passed (never spin: the gRPC
                # threads need the GIL to move bytes), or a paced generate is due.
                wait_s = min([self._idle_wait_s, *self._due_s()])
                continue
            wait_s = 0.0
            try:
                outputs = self.engine.poll(self._poll_timeout_s)
            except StreamFailed as exc:
                self._fail(exc)
                continue
            if outputs:
                self._send_revisions()  # promises the measured latencies moved (pool engine)
            for out in outputs:
                session = self._sessions.get(out.stream_id)
                if session is None:
                    continue  # closed while its chunks were in flight
                if out.preview_steps:  # a look at a chunk still in flight
                    if out.finite:  # a NaN preview is dropped; its chunk is counted as such
                        session.push_chunk(out)
                    continue
                session.inflight -= 1
                session.progress_s = time.monotonic()
                session.chunks_out += 1
                if not session.rollouts or out.horizon == 1:
                    session.left_s.append(out.left_s)  # rollouts: the interval between them
                if not out.finite:
                    if session.output_not_finite(out.chunk):
                        session.end(
                            grpc.StatusCode.INTERNAL,
                            f"{session.non_finite_in_a_row} chunks in a row held NaN or inf: "
                            "the model's weights or this stream's history are broken",
                        )
                        self._close(session)
                    continue
                session.non_finite_in_a_row = 0
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
        elif stream_id is not None:
            log.warning(
                "engine reported a failure of stream %d, already closed: %s", stream_id, exc
            )
        else:
            self._fail_all(f"engine failed: {exc}", grpc.StatusCode.UNAVAILABLE)
            return
        self._check_impaired()

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

    def _pump(self, session: Session) -> None:
        """Feed the stream's observed chunks, then generate up to newest observed + horizon."""
        if not session.attached:
            if time.monotonic() - session.opened_s > session.limits.unattached_timeout_s:
                session.end(grpc.StatusCode.DEADLINE_EXCEEDED, "stream was never attached")
                self._close(session)
            return
        now_s = time.monotonic()
        if session.inflight and now_s - session.progress_s > session.limits.stall_timeout_s:
            session.end(
                grpc.StatusCode.UNAVAILABLE,
                f"engine finished no chunk of this stream in {session.limits.stall_timeout_s} s",
            )
            self._close(session)
            return
        try:
            for observed in session.take_observed():
                owed = session.newest_observed is not None and observed.slot >= session.next_slot
                if owed:  # a slot the stream should have predicted: the engine is behind
                    session.drop(
                        "server_behind",
                        f"slot {observed.slot} was observed before it was generated (the "
                        "engine is slower than the stream's frames)",
                    )
                actions, extra = observed.actions, {}
                if session.wam is not None:  # its state, and the rows known at its newest frame
                    latency_ms = session.promise.expected_response_latency_ms
                    actions = session.wam.known_rows(observed, observed.slot, latency_ms)
                    extra = {"state": observed.state}
                self.engine.submit_context(
                    session.stream_id, observed.frames, actions, slot=observed.slot, **extra
                )
                session.anchors[observed.slot] = Anchor.of(observed, time.time_ns())
                session.anchors.pop(observed.slot - ANCHORS_KEPT, None)
                session.newest_observed = observed
                session.next_slot = max(session.next_slot, observed.slot + 1)
                with session._lock:
                    session.observations_used += 1
                # Each observed slot releases the slots up to it + horizon before the next
                # observation enters: anchors follow from the slots, not from their timing.
                self._generate(session, now_s)
            if session.newest_observed is not None:
                self._generate(session, now_s)  # what a busy engine held back
        except (StreamFailed, KeyError, ValueError) as exc:
            session.end(grpc.StatusCode.UNAVAILABLE, f"stream failed in the engine: {exc}")
            self._close(session)
            if isinstance(exc, StreamFailed):
                self._check_impaired()

    def _generate(self, session: Session, now_s: float) -> None:
        """Generate the stream's slots up to newest observed + horizon, conditioned (world
        models with actions) on the newest command held: the server knows no later one, and
        training holds it the same way. While the engine holds a backlog of the stream's
        chunks it waits (and slots observed meanwhile are never generated); so it does while
        the stream is ahead of its admitted pace (beyond a burst of ``horizon`` chunks)."""
        newest = session.newest_observed
        backlog = MAX_BACKLOG_FACTOR * (max(session.promise.pipeline_depth, 1) + session.horizon)
        actions = None
        if self._generate_with_actions and newest.actions is not None:
            actions = np.repeat(newest.actions[-1:], len(newest.actions), axis=0)
        if session.rollouts:
            if newest.slot > session.rolled_out and session.inflight < backlog:
                self._rollout(session, now_s, actions)
            return
        while session.next_slot <= newest.slot + session.horizon and session.inflight < backlog:
            # h chunks at once, and half an interval of slack: a camera whose slot comes a
            # little early (jitter) is not held back (long run: 1 per interval)
            if not self._paced(session, now_s, burst=session.horizon - 0.5):
                return  # the loop comes back when it is due (``_due_s``)
            self._submit(session, session.next_slot, actions, now_s)
            session.next_slot += 1

    def _rollout(self, session: Session, now_s: float, actions) -> None:
        """Generate slots newest observed + 1 .. + horizon again, anchored on it, one rollout
        per interval (half an interval of slack for a camera's jitter): the observations
        that come while a stream is ahead of its pace get no rollout of their own."""
        if not self._paced(session, now_s, burst=0.5):
            return  # the loop comes back when it is due (``_due_s``)
        newest = session.newest_observed
        for slot in range(newest.slot + 1, newest.slot + session.horizon + 1):
            self._submit(session, slot, actions, now_s, again=True)
        session.next_slot = max(session.next_slot, newest.slot + session.horizon + 1)
        session.rolled_out = newest.slot

    @staticmethod
    def _paced(session: Session, now_s: float, *, burst: float) -> bool:
        """Whether the stream's pace lets it release now (and if so, the pace moves on): one
        release per admitted interval, up to ``burst`` intervals' worth at once."""
        if session.interval_s <= 0:
            return True
        if now_s < session.next_generate_s:
            return False
        session.next_generate_s = (
            max(session.next_generate_s, now_s - burst * session.interval_s) + session.interval_s
        )
        return True

    def _submit(
        self, session: Session, slot: int, actions, now_s: float, *, again: bool = False
    ) -> None:
        """Queue ``slot`` to generate (``again``: a slot generated before, named explicitly;
        else the engine's next new slot), a world-action model's with the rows the robot has
        committed; counted in flight."""
        if session.wam is not None:
            actions = session.wam.generate_rows(
                session.newest_observed, slot, session.promise.expected_response_latency_ms
            )
        if again:
            self.engine.submit_generate(session.stream_id, actions, slot=slot)
        else:  # an engine without rollouts need not take ``slot``
            self.engine.submit_generate(session.stream_id, actions)
        if not session.inflight:
            session.progress_s = now_s
        session.inflight += 1

    def _due_s(self) -> list[float]:
        """Seconds until each stream held back by its pace may generate again."""
        now_s = time.monotonic()
        return [
            max(s.next_generate_s - now_s, 0.001)
            for s in self._sessions.values()
            if s.attached
            and s.newest_observed is not None
            and (
                s.newest_observed.slot > s.rolled_out
                if s.rollouts
                else s.next_slot <= s.newest_observed.slot + s.horizon
            )
            and s.next_generate_s > now_s
        ]

    def sessions(self) -> list[Session]:
        return list(self._sessions.values())
