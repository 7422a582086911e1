"""Resumable streams: a stream whose Stream call broke (a link blip, a client's crash) is held
for a grace period, detached, instead of being closed with its history.

A stream is resumable when its client says it can resume (``StreamSpec.resumable``) and the
server's ``resume_grace_s`` is above 0: its opener gets a resume token (``new_resume_token``),
which a later Stream call presents beside the stream id to re-attach (``Session.attach``).
While detached the stream keeps its engine stream, so admission goes on counting it and the
other streams' promises do not move; its live timeline fills the slots it misses the way it
fills any gap once frames come again. It is closed when the grace ends without a resume
(expired), or earlier when a new stream is refused for the room it holds (reclaimed: the oldest
detached stream goes first), or by CloseStream.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Callable
from typing import TypeVar

import grpc

from physis_ros.engine.api import AdmissionRefused
from physis_ros.serve.session import Session

T = TypeVar("T")

log = logging.getLogger(__name__)

RESUME_TOKEN_BYTES = 24
"""Random bytes of a resume token (192 bits; URL-safe base64 on the wire)."""

NOT_RECLAIMABLE = ("ranks", "weights")
"""Admission refusals that closing a stream cannot cure (failed ranks, blocks a rank does not
hold); the others are for what streams hold: memory, compute, KV slots, streams, latency."""


def new_resume_token() -> str:
    return secrets.token_urlsafe(RESUME_TOKEN_BYTES)


class DetachedStreams:
    """The front end's detached streams: each one's grace timer, and the counts ServerInfo
    reports."""

    def __init__(self, grace_s: float) -> None:
        self.grace_s = grace_s
        self._lock = threading.Lock()
        self._held: dict[int, tuple[Session, threading.Timer]] = {}
        self.streams_expired = 0
        self.streams_reclaimed = 0
        self.streams_resumed = 0

    def token_for(self, resumable: bool) -> str:
        """A new stream's resume token ("": the stream is closed when its call ends)."""
        return new_resume_token() if resumable and self.grace_s > 0 else ""

    def detach(self, session: Session, attachment: int, why: str) -> bool:
        """The Stream call ``attachment`` of a resumable stream ended (``why``): the stream is
        held for the grace. False when that call no longer held it (closed, resumed by a newer
        call, or detached already)."""
        if not session.detach(attachment):
            return False
        timer = threading.Timer(self.grace_s, self._expire, (session, attachment))
        timer.daemon = True
        with self._lock:
            previous = self._held.get(session.stream_id)
            self._held[session.stream_id] = (session, timer)
        if previous is not None:
            previous[1].cancel()
        timer.start()
        log.info(
            "stream %d detached (%s): held %.1f s for its client to resume it",
            session.stream_id,
            why,
            self.grace_s,
        )
        return True

    def resumed(self, session: Session, detached_for_s: float) -> None:
        """A Stream call re-attached to ``session`` with its token."""
        with self._lock:
            held = self._held.pop(session.stream_id, None)
            self.streams_resumed += 1
        if held is not None:
            held[1].cancel()
        log.info("stream %d resumed after %.1f s detached", session.stream_id, detached_for_s)

    def forget(self, session: Session) -> None:
        """``session`` is closed: its timer goes."""
        with self._lock:
            held = self._held.pop(session.stream_id, None)
        if held is not None:
            held[1].cancel()

    def reclaim(self, need: str) -> bool:
        """Closes the stream detached longest ago, its room given to a new stream that was
        refused it (``need`` says why); False when none is detached."""
        with self._lock:
            detached = [(s.detached_s, s) for s, _ in self._held.values()]
        for detached_s, session in sorted(
            ((t, s) for t, s in detached if t is not None), key=lambda item: item[0]
        ):
            ago_s = time.monotonic() - detached_s
            if session.end(
                grpc.StatusCode.UNAVAILABLE,
                f"detached {ago_s:.1f} s, given back for a new stream",
                if_detached=session.attachment,
            ):
                with self._lock:
                    self.streams_reclaimed += 1
                log.warning(
                    "stream %d given back after %.1f s detached: a new stream needs its room "
                    "(%s); its open is tried again",
                    session.stream_id,
                    ago_s,
                    need,
                )
                return True
        return False

    def reclaiming(self, open_stream: Callable[[], T]) -> T:
        """``open_stream()``; refused for room a detached stream holds (any resource but
        NOT_RECLAIMABLE), that stream is given back and the open tried once more (the engine
        runs its close first: it runs commands in order)."""
        try:
            return open_stream()
        except AdmissionRefused as exc:
            if exc.resource.startswith(NOT_RECLAIMABLE) or not self.reclaim(
                f"admission refused it: {exc.resource}"
            ):
                raise
        return open_stream()

    def _expire(self, session: Session, attachment: int) -> None:
        if session.end(
            grpc.StatusCode.UNAVAILABLE,
            f"not resumed within the resume grace of {self.grace_s:g} s",
            if_detached=attachment,
        ):
            with self._lock:
                self.streams_expired += 1
            log.info(
                "stream %d expired: not resumed within %.1f s", session.stream_id, self.grace_s
            )
