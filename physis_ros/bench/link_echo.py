"""The server side of ``physis-bench link``: the real front end over an engine with no model
(``EchoEngine``: each generate request is finished at once with a [16, 7] float32 action
chunk), run in a child process (``serve_echo``), and the bytes of one such reply as the link
sends it (``prediction_reply_bytes``, what the bare gRPC baselines answer with)."""

from __future__ import annotations

import queue
import signal
import threading
import time
from types import SimpleNamespace

import numpy as np

from physis_ros.engine.api import ChunkOutput, StreamPromise
from physis_ros.link.wire import StreamCounts, serialize_prediction

IMAGE_HW = (480, 640)
ACTION_HA = (16, 7)


class EchoEngine:
    """A StreamEngine with no model: each generate request is finished at once."""

    def __init__(
        self, *, image_hw: tuple[int, int] = IMAGE_HW, action_ha: tuple[int, int] = ACTION_HA
    ) -> None:
        self.image_hw, self.action_ha = image_hw, action_ha
        self._next_id = 0
        self._chunks: dict[int, int] = {}
        """stream -> the next slot no chunk was submitted for."""
        self._anchors: dict[int, int] = {}
        self._done: queue.SimpleQueue = queue.SimpleQueue()

    def open_stream(self, spec):
        sid, self._next_id = self._next_id, self._next_id + 1
        self._chunks[sid] = 0
        return StreamPromise(
            stream_id=sid,
            model="echo",
            steps=1,
            blocks=1,
            expected_interval_ms=0.0,
            pipeline_depth=1,
            expected_response_latency_ms=0.0,
            chunk_frames=1,
            image_height=self.image_hw[0],
            image_width=self.image_hw[1],
            action_horizon=self.action_ha[0],
            action_dim=self.action_ha[1],
        )

    def close_stream(self, stream_id: int) -> None:
        self._chunks.pop(stream_id, None)

    def next_slot(self, stream_id: int) -> int:
        return self._chunks[stream_id]

    def submit_context(self, stream_id: int, frames, actions=None, *, slot=None) -> int:
        slot = self._chunks[stream_id] if slot is None else slot
        self._anchors[stream_id] = slot
        self._chunks[stream_id] = max(self._chunks[stream_id], slot + 1)
        return slot

    def submit_generate(self, stream_id: int, actions=None, *, slot=None) -> int:
        chunk = self._chunks[stream_id] if slot is None else slot
        self._chunks[stream_id] = max(self._chunks[stream_id], chunk + 1)
        now_s = time.monotonic()
        self._done.put(
            ChunkOutput(
                stream_id=stream_id,
                chunk=chunk,
                frames=None,
                actions=np.full(self.action_ha, chunk, np.float32),
                entered_s=now_s,
                left_s=now_s,
                decoded_s=now_s,
                anchor=self._anchors.get(stream_id, -1),
            )
        )
        return chunk

    def poll(self, timeout_s: float):
        out = []
        try:
            out.append(self._done.get(timeout=timeout_s))
            while True:
                out.append(self._done.get_nowait())
        except queue.Empty:
            pass  # nothing more finished: return what there is
        return out

    def shutdown(self) -> None:
        self._chunks.clear()


def serve_echo(port_file: str) -> int:
    """The child process: the real front end over EchoEngine on 127.0.0.1, until SIGTERM."""
    # The front end imports torch: only this child pays for it, the client stays torch-free.
    from physis_ros.serve.frontend_config import FrontendConfig, ServerDescription
    from physis_ros.serve.main import run_frontend

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    return run_frontend(
        EchoEngine(),
        ServerDescription(model="echo", steps=1, blocks=1),
        FrontendConfig(port=0),
        port_file=port_file,
        stop=stop,
        loop_options={"poll_timeout_s": 0.001},
    )


def prediction_reply_bytes() -> bytes:
    """A ServerMessage as the link sends a 16x7 action chunk (stamps and counters set)."""
    now_ns, now_s = time.time_ns(), time.monotonic()
    out = ChunkOutput(
        stream_id=1,
        chunk=1000,
        frames=None,
        actions=np.ones(ACTION_HA, np.float32),
        entered_s=now_s,
        left_s=now_s,
        decoded_s=now_s,
        anchor=999,
    )
    anchor = SimpleNamespace(
        seq=999, capture_stamp_ns=now_ns, send_stamp_ns=now_ns, received_ns=now_ns, queued_ns=now_ns
    )
    counts = StreamCounts(observations_received=999, observations_used=999, predictions_sent=999)
    return serialize_prediction(
        out,
        stream_id=1,
        anchor=anchor,
        action_timing=None,
        first_frame_seq=-1,
        counts=counts,
        sent_ns=now_ns,
    )
