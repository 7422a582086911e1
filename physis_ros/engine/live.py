"""A served stream's live timeline (DESIGN.md §3.1): frames in, the slots to observe and to
generate, each finished chunk out with what its reply says of its anchor.

``LiveTimeline`` is the part of a stream's state that only a served stream has; the engine
core owns one per served stream. The front end's reader thread adds checked frames
(``add``: ``slots.SlotAssembler`` puts frame n in slot n // F); the core's thread then feeds
every completed slot as its observation (replacing the prediction of that slot in the history
of every chunk released after it) and generates the stream's slots up to newest observed +
horizon (at stream start ``horizon`` chunks, then one per observed slot), or with rollouts
every slot up to it again (``horizon`` chunks per observation), conditioned on the newest
commanded actions held (world models with actions) or the robot's committed rows
(world-action models, ``wam_rows``). Generation is paced at the interval the stream was
admitted at (a burst of up to ``horizon`` chunks allowed, the slots a new observation releases
at once, and half an interval of jitter); a stream whose backlog in the engine passes
``MAX_BACKLOG_FACTOR`` x (pipeline depth + horizon) waits, and the slots observed meanwhile
are never generated (dropped as ``server_behind``).

What the core's thread hands back are plain values: ``Ran`` (a finished chunk and its
anchor's stamps, a world-action chunk's timing) and ``StreamEvent`` (a drop to count, or the
end of the stream: stalled, or its output broken).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import numpy as np

from physis_ros.engine.api import ChunkOutput, StreamPromise
from physis_ros.engine.slots import FrameIn, ObservedChunk, SlotAssembler
from physis_ros.engine.wam_rows import ActionTiming, WamRows

MAX_BACKLOG_FACTOR = 4
"""A stream generates no more while this many times (pipeline depth + horizon) of its chunks
are still in the engine (the engine cannot keep up with its frames)."""
ANCHORS_KEPT = 1024
"""Observed slots a stream remembers for the replies of chunks anchored on them."""


@dataclass(frozen=True, kw_only=True)
class LiveLimits:
    """When a served stream is ended by the core."""

    stall_timeout_s: float = 60.0
    """Chunks in flight but none finished for this long: ended (``stalled``) instead of
    waiting forever on a stuck engine."""
    max_non_finite_chunks: int = 3
    """Chunks in a row whose model output held NaN or inf (never published, each dropped as
    ``non_finite_output``) before the stream ends (``broken``): its history is poisoned."""


@dataclass(frozen=True)
class Anchor:
    """What a reply says of the observation its chunk is anchored on: the newest observation
    of an observed slot, and when that slot was queued for the engine.

    Only these stamps, never the slot's frames: a stream remembers ANCHORS_KEPT anchors, and
    holding each slot's pixels would grow the server by one observation per slot."""

    seq: int
    capture_stamp_ns: int
    send_stamp_ns: int
    received_ns: int
    queued_ns: int
    """Server wall clock."""

    @staticmethod
    def of(observed: ObservedChunk, queued_ns: int) -> Anchor:
        newest = observed.newest
        return Anchor(
            seq=newest.seq,
            capture_stamp_ns=newest.capture_stamp_ns,
            send_stamp_ns=newest.send_stamp_ns,
            received_ns=newest.received_ns,
            queued_ns=queued_ns,
        )


@dataclass(frozen=True)
class Ran:
    """A finished chunk (or a preview of one) of a served stream, and what its reply says."""

    out: ChunkOutput
    anchor: Anchor | None
    """The observation it is anchored on."""
    action_timing: ActionTiming | None
    """A world-action model's rows on the robot clock."""
    first_frame_seq: int
    """The observation seq its first predicted frame corresponds to (-1: unknown)."""


@dataclass(frozen=True)
class StreamEvent:
    """Something the front end must count (``drop``) or act on (``end``)."""

    stream_id: int
    kind: str
    """``drop``: count ``reason`` and go on; ``end``: the core closed the stream."""
    reason: str
    """drop: ``server_behind``, ``non_finite_output``; end: ``stalled``, ``broken``,
    ``failed`` (the engine lost it), ``internal`` (a fault in its requests)."""
    detail: str


@dataclass(frozen=True)
class SlotCounters:
    observed_chunks: int
    filled_frames: int
    incomplete_chunks: int
    observations_used: int


class LiveTimeline:
    """One served stream's live timeline (see the module docstring)."""

    def __init__(
        self,
        promise: StreamPromise,
        *,
        limits: LiveLimits,
        wam: WamRows | None,
        generate_with_actions: bool,
        target_interval_ms: float,
    ) -> None:
        """``wam``: a world-action model's rows (its frames carry state and command
        timelines; its replies are timed); ``generate_with_actions``: generate requests carry
        the newest commanded actions (world models conditioned on them);
        ``target_interval_ms``: what the client asked for (the pace when the promise names
        none: an engine without admission)."""
        self.stream_id = promise.stream_id
        self.limits = limits
        self.wam = wam
        self.generate_with_actions = generate_with_actions
        self._asked_ms = target_interval_ms
        self._lock = threading.Lock()
        self.slots = SlotAssembler(max(promise.chunk_frames, 1), promise.action_horizon)
        """Frames -> observed chunks (the reader thread adds, under the lock)."""
        self._observed: list[ObservedChunk] = []
        """Completed observed chunks the core has not fed yet."""
        self.promise = promise
        self.horizon = max(promise.horizon, 1)
        self.next_generate_s = 0.0
        """Monotonic: when the pace allows the next generated chunk."""
        self.outstanding = 0
        """Generated chunks submitted and not out yet."""
        self.progress_s = 0.0
        """Monotonic: the last chunk out, or the first submit after none was outstanding."""
        self.rolled_out = -1
        """With rollouts: the newest observed slot whose rollout was generated."""
        self.newest: ObservedChunk | None = None
        """The newest observed chunk fed: every chunk generated now is anchored on it."""
        self.anchors: dict[int, Anchor] = {}
        """Observed slot -> what the replies anchored on it say of it."""
        self.observations_used = 0
        self.non_finite_in_a_row = 0

    @property
    def interval_s(self) -> float:
        """The pace: what the pool admitted it at (its request, or the default target for a
        request of 0); an engine without admission paces at the request."""
        return max(self.promise.target_interval_ms or self._asked_ms, 0.0) / 1000.0

    @property
    def rollouts(self) -> bool:
        return self.promise.rollouts

    # ---- the front end's reader thread ---------------------------------------------------
    def add(self, frame: FrameIn) -> tuple[int, int]:
        """Take one checked frame (seq strictly increasing). Returns (slots it completed,
        frames of a gap too long to fill that the timeline skipped)."""
        with self._lock:
            skipped = self.slots.skipped_frames
            completed = self.slots.add(frame)
            self._observed.extend(completed)
            return len(completed), self.slots.skipped_frames - skipped

    def counters(self) -> SlotCounters:
        with self._lock:
            s = self.slots
            return SlotCounters(
                s.observed_chunks, s.filled_frames, s.incomplete_chunks, self.observations_used
            )

    def first_frame_seq(self, slot: int) -> int:
        with self._lock:
            first = self.slots.first_seq
            return -1 if first is None else first + slot * self.slots.frames

    # ---- the core's thread -------------------------------------------------------------
    def pump(self, engine, now_s: float) -> list[StreamEvent]:
        """Feed the observed chunks, then generate up to newest observed + horizon, through
        ``engine``'s slot-level calls (``submit_context``, ``submit_generate``,
        ``next_slot``). Returns the drops and the end to report."""
        if self.outstanding and now_s - self.progress_s > self.limits.stall_timeout_s:
            return [
                self._event(
                    "end",
                    "stalled",
                    f"engine finished no chunk of this stream in {self.limits.stall_timeout_s} s",
                )
            ]
        with self._lock:
            observed, self._observed = self._observed, []
        events = []
        for chunk in observed:
            if self.newest is not None and chunk.slot >= engine.next_slot(self.stream_id):
                # a slot the stream should have predicted: the engine is behind
                events.append(
                    self._event(
                        "drop",
                        "server_behind",
                        f"slot {chunk.slot} was observed before it was generated (the engine "
                        "is slower than the stream's frames)",
                    )
                )
            self._observe(engine, chunk)
            # Each observed slot releases the slots up to it + horizon before the next
            # observation enters: anchors follow from the slots, not from their timing.
            self._generate(engine, now_s)
        if self.newest is not None:
            self._generate(engine, now_s)  # what a busy engine held back
        return events

    def _observe(self, engine, chunk: ObservedChunk) -> None:
        actions, extra = chunk.actions, {}
        if self.wam is not None:  # its state, and the rows known at its newest frame
            latency_ms = self.promise.expected_response_latency_ms
            actions = self.wam.known_rows(chunk, chunk.slot, latency_ms)
            extra = {"state": chunk.state}
        engine.submit_context(self.stream_id, chunk.frames, actions, slot=chunk.slot, **extra)
        self.anchors[chunk.slot] = Anchor.of(chunk, time.time_ns())
        self.anchors.pop(chunk.slot - ANCHORS_KEPT, None)
        self.newest = chunk
        with self._lock:
            self.observations_used += 1

    def _generate(self, engine, now_s: float) -> None:
        """Generate the stream's slots up to newest observed + horizon, conditioned (world
        models with actions) on the newest command held: the server knows no later one, and
        training holds it the same way. While the engine holds a backlog of the stream's
        chunks it waits (and slots observed meanwhile are never generated); so it does while
        the stream is ahead of its admitted pace (beyond a burst of ``horizon`` chunks)."""
        newest = self.newest
        backlog = MAX_BACKLOG_FACTOR * (max(self.promise.pipeline_depth, 1) + self.horizon)
        actions = None
        if self.generate_with_actions and newest.actions is not None:
            actions = np.repeat(newest.actions[-1:], len(newest.actions), axis=0)
        if self.rollouts:
            if newest.slot > self.rolled_out and self.outstanding < backlog:
                self._rollout(engine, now_s, actions)
            return
        while engine.next_slot(self.stream_id) <= newest.slot + self.horizon and (
            self.outstanding < backlog
        ):
            # h chunks at once, and half an interval of slack: a camera whose slot comes a
            # little early (jitter) is not held back (long run: 1 per interval)
            if not self._paced(now_s, burst=self.horizon - 0.5):
                return  # the core comes back when it is due (``due_s``)
            self._submit(engine, engine.next_slot(self.stream_id), actions, now_s)

    def _rollout(self, engine, now_s: float, actions) -> None:
        """Generate slots newest observed + 1 .. + horizon again, anchored on it, one rollout
        per interval (half an interval of slack for a camera's jitter): the observations
        that come while a stream is ahead of its pace get no rollout of their own."""
        if not self._paced(now_s, burst=0.5):
            return  # the core comes back when it is due (``due_s``)
        newest = self.newest
        for slot in range(newest.slot + 1, newest.slot + self.horizon + 1):
            self._submit(engine, slot, actions, now_s, again=True)
        self.rolled_out = newest.slot

    def _paced(self, now_s: float, *, burst: float) -> bool:
        """Whether the pace lets the stream release now (and if so, the pace moves on): one
        release per admitted interval, up to ``burst`` intervals' worth at once."""
        interval_s = self.interval_s
        if interval_s <= 0:
            return True
        if now_s < self.next_generate_s:
            return False
        self.next_generate_s = max(self.next_generate_s, now_s - burst * interval_s) + interval_s
        return True

    def _submit(self, engine, slot: int, actions, now_s: float, *, again: bool = False) -> None:
        """Queue ``slot`` to generate (``again``: a slot generated before), a world-action
        model's with the rows the robot has committed; counted outstanding."""
        if self.wam is not None:
            latency_ms = self.promise.expected_response_latency_ms
            actions = self.wam.generate_rows(self.newest, slot, latency_ms)
        if again:
            engine.submit_generate(self.stream_id, actions, slot=slot)
        else:  # an engine without rollouts need not take ``slot``
            engine.submit_generate(self.stream_id, actions)
        if not self.outstanding:
            self.progress_s = now_s
        self.outstanding += 1

    def due_s(self, now_s: float, next_slot: int) -> float | None:
        """Seconds until the pace lets the stream generate what it waits to (None: nothing
        waits for its pace); ``next_slot``: the next slot no chunk was queued for."""
        newest = self.newest
        if newest is None or self.next_generate_s <= now_s:
            return None
        if self.rollouts:
            waits = newest.slot > self.rolled_out
        else:
            waits = next_slot <= newest.slot + self.horizon
        return max(self.next_generate_s - now_s, 0.001) if waits else None

    def finished(self, out: ChunkOutput, now_s: float) -> tuple[Ran | None, list[StreamEvent]]:
        """A chunk (or a preview) of this stream came out: what its reply says (a chunk whose
        output is not finite too, to be counted, never published; None: a broken preview,
        dropped), and the drops or the end to report."""
        if out.preview_steps:  # a look at a chunk still in flight
            if not out.finite:  # a NaN preview is dropped; its chunk is counted as such
                return None, []
            return self._ran(out), []
        self.outstanding -= 1
        self.progress_s = now_s
        ran = self._ran(out)
        if out.finite:
            self.non_finite_in_a_row = 0
            return ran, []
        self.non_finite_in_a_row += 1
        events = [
            self._event(
                "drop",
                "non_finite_output",
                f"chunk {out.chunk}: the model's output holds NaN or inf; not published",
            )
        ]
        if self.non_finite_in_a_row >= self.limits.max_non_finite_chunks:
            events.append(
                self._event(
                    "end",
                    "broken",
                    f"{self.non_finite_in_a_row} chunks in a row held NaN or inf: the model's "
                    "weights or this stream's history are broken",
                )
            )
        return ran, events

    def _ran(self, out: ChunkOutput) -> Ran:
        timing = None
        if self.wam is not None:
            timing = self.wam.reply_timing(out.chunk, final=not out.preview_steps)
        return Ran(out, self.anchors.get(out.anchor), timing, self.first_frame_seq(out.chunk))

    def _event(self, kind: str, reason: str, detail: str) -> StreamEvent:
        return StreamEvent(self.stream_id, kind, reason, detail)
