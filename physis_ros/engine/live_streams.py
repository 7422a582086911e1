"""``LiveStreams``: the served streams of an engine, each on its live timeline (engine/live.py).

It drives any engine with the slot-level stream calls (``open_stream``, ``submit_context``,
``submit_generate``, ``next_slot``, ``poll``, ``close_stream``; the engine core, or a stand-in
in tests): the front end's reader threads add frames (``add_frame``, thread-safe), and one
thread turns it (``step``): feed the observed slots, generate what each timeline releases,
collect what came out. What it hands back are plain values (``Step``: ``Ran``, ``StreamEvent``,
revised promises).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from physis_ros.engine.api import StreamEngine, StreamFailed, StreamPromise, StreamSpec
from physis_ros.engine.live import LiveLimits, LiveTimeline, Ran, SlotCounters, StreamEvent
from physis_ros.engine.slots import FrameIn
from physis_ros.engine.wam_rows import WamRows

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Step:
    """What one ``LiveStreams.step`` did to the served streams."""

    ran: list[Ran]
    """Finished chunks and previews, with what their replies say (a chunk whose output held
    NaN or inf is among them with ``out.finite`` False: count it, never publish it)."""
    events: list[StreamEvent]
    revised: list[StreamPromise]


class LiveStreams:
    """The served streams of ``engine`` (see the module docstring)."""

    def __init__(self, engine: StreamEngine) -> None:
        self.engine = engine
        self._live: dict[int, LiveTimeline] = {}

    def open(self, spec: StreamSpec, limits: LiveLimits) -> StreamPromise:
        """Open a served stream on the engine (its ``open_stream``); AdmissionRefused and
        ValueError pass through."""
        promise = self.engine.open_stream(spec)
        contract = getattr(self.engine, "contract", None)
        predicts = promise.action_mode == "predict"
        self._live[promise.stream_id] = LiveTimeline(
            promise,
            limits=limits,
            wam=WamRows(contract) if predicts and contract is not None else None,
            generate_with_actions=promise.action_mode == "condition",
            target_interval_ms=spec.target_interval_ms,
        )
        return promise

    def close(self, stream_id: int) -> None:
        """Forget the stream and close it in the engine (unless the engine ended it)."""
        if self._live.pop(stream_id, None) is None:
            return
        try:
            self.engine.close_stream(stream_id)
        except (StreamFailed, KeyError, ValueError) as exc:
            log.warning("closing stream %d: %s", stream_id, exc)

    # ---- the front end's reader threads ----------------------------------------------------
    def add_frame(self, stream_id: int, frame: FrameIn) -> tuple[int, int]:
        """A served stream's checked frame: (slots it completed, frames of a gap too long to
        fill); (0, 0) for a stream no longer served."""
        timeline = self._live.get(stream_id)
        return (0, 0) if timeline is None else timeline.add(frame)

    def timeline(self, stream_id: int) -> LiveTimeline | None:
        """The stream's timeline (None: not served, or closed)."""
        return self._live.get(stream_id)

    def counters(self, stream_id: int) -> SlotCounters | None:
        timeline = self._live.get(stream_id)
        return None if timeline is None else timeline.counters()

    # ---- the serving thread --------------------------------------------------------------
    def outstanding(self) -> bool:
        """Whether a served stream waits for a chunk (``step`` then waits on the engine)."""
        return any(t.outstanding for t in self._live.values())

    def step(self, timeout_s: float) -> Step:
        """One turn of the served streams: feed their observed slots, generate what their
        timelines release, then collect what came out (waiting up to ``timeout_s`` when
        something is outstanding). A stream that stalls, breaks or fails is closed here and
        reported (``StreamEvent`` end); a failure that names no stream raises
        ``StreamFailed``."""
        now_s = time.monotonic()
        events: list[StreamEvent] = []
        for sid, timeline in list(self._live.items()):
            events += self._pump(sid, timeline, now_s)
        ran: list[Ran] = []
        if self.outstanding():
            try:
                outputs = self.engine.poll(timeout_s)
            except StreamFailed as exc:
                sid = getattr(exc, "stream_id", None)
                if sid is None:
                    raise  # every stream is gone: the caller fails them all
                outputs = []
                events.append(_failed(sid, exc))
            now_s = time.monotonic()
            for out in outputs:
                timeline = self._live.get(out.stream_id)
                if timeline is None:
                    continue  # closed while its chunks were in flight
                done, evs = timeline.finished(out, now_s)
                events += evs
                if done is not None:
                    ran.append(done)
        for event in events:
            if event.kind == "end":
                self.close(event.stream_id)
        return Step(ran=ran, events=events, revised=self._revisions())

    def _pump(self, stream_id: int, timeline: LiveTimeline, now_s: float) -> list[StreamEvent]:
        """``timeline.pump``; a fault in its requests ends that stream alone."""
        try:
            return timeline.pump(self.engine, now_s)
        except (StreamFailed, KeyError, ValueError) as exc:
            return [_failed(stream_id, exc)]
        except Exception as exc:  # the stream's client gets the cause
            log.exception("stream %d failed in its live timeline", stream_id)
            detail = f"stream failed in the server: {exc!r}"
            return [StreamEvent(stream_id, "end", "internal", detail)]

    def _revisions(self) -> list[StreamPromise]:
        """Promises the engine revised (a stream joined or left, or the measured latencies
        moved them); each served stream's pace and rows follow its newest."""
        take = getattr(self.engine, "take_revisions", None)
        revised = take() if take is not None else []
        for promise in revised:
            timeline = self._live.get(promise.stream_id)
            if timeline is not None:
                timeline.promise = promise
        return revised

    def due_s(self) -> float | None:
        """Seconds until a served stream held back by its pace may generate again."""
        now_s = time.monotonic()
        waits = []
        for sid, timeline in list(self._live.items()):
            if timeline.newest is None or timeline.next_generate_s <= now_s:
                continue
            due = timeline.due_s(now_s, self.engine.next_slot(sid))
            if due is not None:
                waits.append(due)
        return min(waits, default=None)


def _failed(stream_id: int, exc: Exception) -> StreamEvent:
    return StreamEvent(stream_id, "end", "failed", f"stream failed in the engine: {exc}")
