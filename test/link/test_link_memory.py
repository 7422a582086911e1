"""What the server keeps of a stream's observations once the engine has them: not their
pixels. A stream remembers the anchors of up to ANCHORS_KEPT observed slots for its replies;
each must be stamps only: with the pixels, a 640x480 camera kept ~1.8 MB per observation
alive (up to ~1.8 GB a stream) and every new observation took ~0.6 ms longer to receive."""

from __future__ import annotations

import gc
import weakref

import grpc
from link_fake_engine import FakeEngine, served
from link_raw import RawStream, observation_bytes
from link_server import wait_for

from physis_ros.engine.live import ANCHORS_KEPT


class _WatchedFrames(FakeEngine):
    """Keeps a weak reference to every frames array the server submits, and no copy."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.submitted: list[weakref.ref] = []

    def submit_context(self, stream_id, frames, actions=None, *, slot=None) -> int:
        slot = super().submit_context(stream_id, frames, actions, slot=slot)
        self.context_frames.clear()  # the fake's own copies are not the server's
        self.submitted.append(weakref.ref(frames))
        return slot


def test_observed_frames_are_freed_once_their_replies_are_out():
    engine = _WatchedFrames(height=120, width=160)
    observations = 40
    assert observations < ANCHORS_KEPT  # every slot's anchor is still remembered
    with (
        served(engine) as (_loop, handle),
        grpc.insecure_channel(f"127.0.0.1:{handle.port}") as channel,
    ):
        stream = RawStream(channel, target_interval_ms=0.0)
        try:
            for seq in range(1, observations + 1):
                stream.send(observation_bytes(seq, stream.promise))
                wait_for(
                    lambda s=seq: any(p.observation_seq == s for p in list(stream.predictions)),
                    60,
                    what=f"a prediction anchored on observation {seq}",
                )
            gc.collect()
            alive = [i for i, ref in enumerate(engine.submitted) if ref() is not None]
            # The newest slot may stay (a frame missing from the next is filled from it).
            assert len(engine.submitted) == observations
            assert alive in ([], [observations - 1]), f"frames of slots {alive} still held"
        finally:
            stream.close()
