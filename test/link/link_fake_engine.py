"""A StreamEngine that needs no model, for in-process tests of the front end's pacing.

It keeps the engine contract (admission, slots and anchors of the live timeline, close frees
the stream) and computes each generated chunk from the newest context chunk before it
(actions = that chunk's mean pixel value / 255), so a test can tell which observation a
prediction is conditioned on.
"""

from __future__ import annotations

import contextlib
import threading
import time

import numpy as np

from physis_ros.engine.api import (
    AdmissionRefused,
    ChunkOutput,
    StreamFailed,
    StreamPromise,
    StreamSpec,
)
from physis_ros.serve.engine_loop import EngineLoop
from physis_ros.serve.frontend_config import FrontendConfig, ServerDescription
from physis_ros.serve.server import start_server


class FakeEngine:
    def __init__(
        self,
        *,
        slots: int = 2,
        chunk_ms: float = 5.0,
        height: int = 16,
        width: int = 16,
        action_horizon: int = 4,
        action_dim: int = 4,
        chunk_frames: int = 1,
        action_mode: str = "none",
    ) -> None:
        self.slots = slots
        self.action_mode = action_mode
        self.chunk_frames = chunk_frames
        self.chunk_s = chunk_ms / 1000.0
        self.height, self.width = height, width
        self.horizon, self.action_dim = action_horizon, action_dim
        self._lock = threading.Lock()
        self._streams: dict[int, dict] = {}
        self._next_id = 1
        self._ready: list[tuple[float, ChunkOutput]] = []
        self.contexts: list[tuple[int, int, float]] = []  # (stream, chunk, mean pixel)
        self.context_frames: list[tuple[int, np.ndarray]] = []  # (stream, frames) as received
        self.hold = threading.Event()  # while set, poll finishes no chunk
        self.generate_actions: list[np.ndarray | None] = []  # as submit_generate got them
        self._failures: list[StreamFailed] = []  # raised by the next polls, one each
        self.non_finite_streams: set[int] = set()  # their chunks come out with NaN (finite=False)
        self.raise_in_generate: dict[int, Exception] = {}  # stream -> raised by submit_generate
        self.raise_in_poll: Exception | None = None  # raised by every poll (a broken engine)
        self.open_delay_s = 0.0  # open_stream takes this long (concurrent-open races)
        self.impaired = ""  # what impairment() reports

    def open_stream(self, spec: StreamSpec) -> StreamPromise:
        time.sleep(self.open_delay_s)
        with self._lock:
            if len(self._streams) >= self.slots:
                raise AdmissionRefused("no free KV slot", resource="kv_slots", shortfall="1 slot")
            sid = self._next_id
            self._next_id += 1
            self._streams[sid] = {"chunk": 0, "anchor": -1, "context": 0.0, "busy_until": 0.0}
        return StreamPromise(
            stream_id=sid,
            model="fake",
            steps=2,
            blocks=2,
            expected_interval_ms=self.chunk_s * 1e3,
            pipeline_depth=2,
            expected_response_latency_ms=3 * self.chunk_s * 1e3,
            chunk_frames=self.chunk_frames,
            image_height=self.height,
            image_width=self.width,
            action_horizon=self.horizon,
            action_dim=self.action_dim,
            horizon=spec.horizon or 0,
            target_interval_ms=spec.target_interval_ms,  # as a pool admits it
            rollouts=spec.rollouts,
            action_mode=self.action_mode,
        )

    def close_stream(self, stream_id: int) -> None:
        with self._lock:
            self._streams.pop(stream_id, None)
            self._ready = [r for r in self._ready if r[1].stream_id != stream_id]

    def next_slot(self, stream_id: int) -> int:
        with self._lock:
            return self._streams[stream_id]["chunk"]

    def submit_context(self, stream_id, frames, actions=None, *, slot=None) -> int:
        assert frames.dtype == np.uint8 and frames.shape[1:] == (self.height, self.width, 3)
        assert 1 <= frames.shape[0] <= self.chunk_frames
        with self._lock:
            self.context_frames.append((stream_id, frames.copy()))
            s = self._streams[stream_id]
            slot = s["chunk"] if slot is None else slot
            assert s["anchor"] < slot <= s["chunk"], (s, slot)
            s["chunk"] = max(s["chunk"], slot + 1)
            s["anchor"] = slot
            s["context"] = float(frames.mean()) / 255.0
            self.contexts.append((stream_id, slot, s["context"]))
        return slot

    def submit_generate(self, stream_id, actions=None, *, slot=None) -> int:
        now = time.monotonic()
        with self._lock:
            s = self._streams[stream_id]
            if s.get("failed"):
                raise StreamFailed(f"stream {stream_id} failed earlier")
            if stream_id in self.raise_in_generate:
                raise self.raise_in_generate[stream_id]
            chunk = s["chunk"] if slot is None else slot
            assert s["anchor"] < chunk <= s["chunk"], (s, chunk)
            s["chunk"] = max(s["chunk"], chunk + 1)
            self.generate_actions.append(None if actions is None else np.array(actions))
            done = max(now, s["busy_until"]) + self.chunk_s
            s["busy_until"] = done
            out = ChunkOutput(
                stream_id=stream_id,
                chunk=chunk,
                frames=np.full(
                    (self.chunk_frames, self.height, self.width, 3), chunk % 256, np.uint8
                ),
                actions=np.full((self.horizon, self.action_dim), s["context"], np.float32),
                entered_s=now,
                left_s=done,
                decoded_s=done,
                finite=stream_id not in self.non_finite_streams,
                anchor=s["anchor"],
            )
            self._ready.append((done, out))
        return chunk

    def fail(self, stream_id: int | None) -> None:
        """The next poll raises StreamFailed: naming ``stream_id`` (as the rank executor does when a
        rank holding that stream dies; the stream's chunks stop), or, with None, naming no
        stream (the whole engine is gone)."""
        err = StreamFailed(f"stream {stream_id} failed: injected by the test")
        if stream_id is not None:
            err.stream_id = stream_id
        with self._lock:
            if stream_id is not None:
                self._ready = [r for r in self._ready if r[1].stream_id != stream_id]
                self._streams[stream_id]["failed"] = True
            self._failures.append(err)

    def poll(self, timeout_s: float) -> list[ChunkOutput]:
        deadline = time.monotonic() + timeout_s
        while True:
            now = time.monotonic()
            with self._lock:
                if self.raise_in_poll is not None:
                    raise self.raise_in_poll
                if self._failures:
                    raise self._failures.pop(0)
                until = -1.0 if self.hold.is_set() else now
                done = [o for t, o in self._ready if t <= until]
                self._ready = [(t, o) for t, o in self._ready if t > until]
            if done or now >= deadline:
                return done
            time.sleep(min(0.001, deadline - now))

    def impairment(self) -> str:
        return self.impaired

    def info(self) -> dict[str, str]:
        with self._lock:
            return {"free_slots": str(self.slots - len(self._streams)), "slots": str(self.slots)}

    def shutdown(self) -> None:
        with self._lock:
            self._streams.clear()


def make(engine_section: dict) -> tuple[FakeEngine, ServerDescription]:
    """physis-serve --engine-factory link_fake_engine:make (test/link on PYTHONPATH)"""
    engine = FakeEngine(slots=int(engine_section.get("slots", 2)))
    return engine, ServerDescription(model="fake", steps=2, blocks=2, placement="fake")


@contextlib.contextmanager
def served(engine, *, config=None, description=None, **loop_options):
    """The real front end over ``engine`` on an ephemeral 127.0.0.1 port; stopped on exit
    (after the body's own clean-up, so clients close first)."""
    loop = EngineLoop(engine, **loop_options)
    loop.start()
    handle = start_server(
        loop,
        config=config or FrontendConfig(port=0),
        description=description or ServerDescription(model="fake", steps=2, blocks=2),
    )
    try:
        yield loop, handle
    finally:
        handle.stop()
        loop.stop()
