"""Test helper: a hand-driven Stream call that can send any bytes, to test bad input."""

from __future__ import annotations

import queue
import threading
import time

import grpc
import numpy as np

from physis_ros.link.encoding import array_to_tensor
from physis_ros.link.proto_gen import physis_pb2 as pb
from physis_ros.link.proto_gen import physis_pb2_grpc as pb_grpc
from physis_ros.link.wire import PROTOCOL_VERSION, STREAM_ID_METADATA_KEY

STREAM_METHOD = "/physis.v1.Physis/Stream"


def open_stream(channel: grpc.Channel, metadata=(), **spec) -> pb.StreamPromise:
    spec.setdefault("protocol_version", PROTOCOL_VERSION)
    reply = pb_grpc.PhysisStub(channel).OpenStream(
        pb.StreamSpec(**spec), metadata=metadata, timeout=30
    )
    return reply.promise


def observation_bytes(
    seq: int,
    promise: pb.StreamPromise,
    *,
    value: int = 128,
    version: int = PROTOCOL_VERSION,
    **override,
) -> bytes:
    """A valid observation for ``promise`` (rgb8 image), with fields replaced by ``override``."""
    h, w = promise.image_height, promise.image_width
    msg = pb.ClientMessage(protocol_version=version)
    o = msg.observation
    o.protocol_version = version
    o.seq = seq
    o.capture_stamp_ns = time.time_ns()
    o.send_stamp_ns = time.time_ns()
    o.image.encoding = "rgb8"
    o.image.height, o.image.width, o.image.step = h, w, w * 3
    o.image.data = bytes([value]) * (h * w * 3)
    array_to_tensor(np.zeros(6, np.float32), o.wrench)
    for key, val in override.items():
        if key == "image":
            o.image.CopyFrom(val)
        elif key in ("wrench", "action", "joint_positions"):
            getattr(o, key).CopyFrom(val)
        elif key == "clear":
            for name in val:
                o.ClearField(name)
        else:
            setattr(o, key, val)
    return msg.SerializeToString()


class RawStream:
    """OpenStream + a Stream call fed from a queue of raw bytes; records what comes back."""

    def __init__(
        self, channel: grpc.Channel, *, metadata=(), stream_id: int | None = None, **spec
    ) -> None:
        self.promise = open_stream(channel, metadata, **spec) if stream_id is None else None
        self.stream_id = stream_id if stream_id is not None else self.promise.stream_id
        self._q: queue.Queue = queue.Queue()
        method = channel.stream_stream(
            STREAM_METHOD,
            request_serializer=lambda b: b,
            response_deserializer=pb.ServerMessage.FromString,
        )
        self.call = method(
            iter(self._q.get, None),
            metadata=(*metadata, (STREAM_ID_METADATA_KEY, str(self.stream_id))),
        )
        self.counters = pb.StreamCounters()
        self.predictions: list[pb.Prediction] = []
        self.pongs: list[pb.ClockPong] = []
        self.error: grpc.RpcError | None = None
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        try:
            for msg in self.call:
                with self._lock:
                    kind = msg.WhichOneof("body")
                    if kind == "prediction":
                        self.predictions.append(msg.prediction)
                        self.counters = msg.prediction.counters
                    elif kind == "stats":
                        self.counters = msg.stats
                    elif kind == "pong":
                        self.pongs.append(msg.pong)
        except grpc.RpcError as exc:
            self.error = exc
        finally:
            self._done.set()

    def send(self, raw: bytes) -> None:
        self._q.put(raw)

    def start_camera(self, promise: pb.StreamPromise, period_s: float = 0.05) -> None:
        """Send a good observation every ``period_s`` (seq 1, 2, ...) until the stream ends
        or is closed, as a robot's camera does: on the live timeline chunks follow observed
        slots, so a stream that should keep generating must keep observing."""

        def run() -> None:
            seq = 0
            while not self._done.wait(period_s):
                seq += 1
                self.send(observation_bytes(seq, promise))

        threading.Thread(target=run, daemon=True).start()

    def drops(self) -> dict[str, int]:
        with self._lock:
            return dict(self.counters.drops)

    def n_predictions(self) -> int:
        with self._lock:
            return len(self.predictions)

    def wait_ended(self, timeout_s: float) -> bool:
        return self._done.wait(timeout_s)

    def close(self) -> None:
        self._q.put(None)
        self.call.cancel()
        self._thread.join(5)
