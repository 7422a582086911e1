"""The baselines of ``physis-bench link``: bare gRPC bidirectional streams carrying the same
bytes as the link (a serialised observation up, a serialised 16x7 action prediction down).

``Echo``: the server's handler answers every request at once with the same pre-serialised
reply, parsing nothing: what gRPC itself costs for these bytes on the host, the floor for
the link's observation -> action round trip.

``Slotted``: the reply has the link's timing and threads but none of its code. A reader
thread takes each request and hands it to an "engine" thread, which waits for the next slot
boundary (the server's paced slots) and hands the reply to the handler thread that writes it,
as the link's reader, engine loop and writer do. Its first 16 bytes carry the engine's wait
(request in -> reply handed over, ns), which the client leaves out as the link's round trip
leaves out the wait for the slot.

``Read``: the least any protocol that reads its messages does, with upb and the link's wire
format: the client joins the observation's header and pixels into one message (the one copy
of the pixels a single message costs), the handler parses the header (the pixels left as a
view) and serialises a reply with fresh stamps, the client parses the reply before taking
it. No checks, no hand-offs beyond the echo's: the floor for the link's per-message code.

``SlottedRead``: both: the reader parses, the engine thread serialises the reply at the slot
boundary (its wait in the reply's ``received`` and ``decoded`` stamps), the client parses
it. The floor for a server whose model computes on a thread of its own, as the link's does.

The client hands each request to gRPC through a queue-fed request iterator (as the link
client does) and stamps each reply as the receiving thread gets it. No torch.
"""

from __future__ import annotations

import queue
import signal
import struct
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc

from physis_ros.link.proto_gen import physis_pb2 as pb
from physis_ros.link.wire import parse_client_message

SERVICE = "physis.bench.Bare"
WAIT = struct.Struct("<qq")
"""What a Slotted reply begins with: request taken, reply handed over (perf_counter ns)."""
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", 16 * 1024 * 1024),
    ("grpc.max_receive_message_length", 16 * 1024 * 1024),
    ("grpc.http2.lookahead_bytes", 16 * 1024 * 1024),
    ("grpc.http2.max_frame_size", (1 << 24) - 1),
]
"""The link's own channel and server options (client.py, frontend.py)."""


def serve(port_file: str, reply: bytes, slot_ms: float) -> int:
    """A child process: the bare streams (``METHODS``) on 127.0.0.1 until SIGTERM, answering
    with ``reply`` (a serialised ServerMessage), at once or after the next ``slot_ms``
    boundary."""
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())

    def echo(requests: Iterator[bytes], context) -> Iterator[bytes]:
        for _ in requests:
            yield reply

    def read(requests: Iterator[bytes], context) -> Iterator[bytes]:
        answer = pb.ServerMessage.FromString(reply)
        for raw in requests:
            parse_client_message(raw)
            answer.prediction.server_times.sent_ns = time.time_ns()
            yield answer.SerializeToString()

    def slotted(requests: Iterator[bytes], reads: bool) -> Iterator[bytes]:
        taken: queue.SimpleQueue[int | None] = queue.SimpleQueue()
        ready: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        answer = pb.ServerMessage.FromString(reply)
        failed: list[Exception] = []

        def take() -> None:
            try:
                for raw in requests:
                    if reads:
                        parse_client_message(raw)
                    taken.put(time.perf_counter_ns())
            except Exception as exc:  # noqa: BLE001 - ends the call, as in the Read stream
                failed.append(exc)
            finally:
                taken.put(None)

        def engine() -> None:
            slot_ns = int(slot_ms * 1e6)
            while (t0 := taken.get()) is not None:
                due_ns = (t0 // slot_ns + 1) * slot_ns
                time.sleep(max(due_ns - time.perf_counter_ns(), 0) / 1e9)
                if reads:
                    times = answer.prediction.server_times
                    times.received_ns, times.decoded_ns = t0, time.perf_counter_ns()
                    ready.put(answer.SerializeToString())
                else:
                    ready.put(WAIT.pack(t0, time.perf_counter_ns()) + reply[WAIT.size :])
            ready.put(None)

        threading.Thread(target=take, daemon=True).start()
        threading.Thread(target=engine, daemon=True).start()
        while (item := ready.get()) is not None:
            yield item
        if failed:
            raise failed[0]

    handlers = {
        "Echo": echo,
        "Read": read,
        "Slotted": lambda requests, context: slotted(requests, reads=False),
        "SlottedRead": lambda requests, context: slotted(requests, reads=True),
    }
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8), options=CHANNEL_OPTIONS)
    server.add_generic_rpc_handlers(
        [
            grpc.method_handlers_generic_handler(
                SERVICE,
                {m: grpc.stream_stream_rpc_method_handler(h) for m, h in handlers.items()},
            )
        ]
    )
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    tmp = Path(f"{port_file}.tmp")
    tmp.write_text(str(port))
    tmp.replace(port_file)
    while not stop.wait(0.2):  # a signal handed to a gRPC thread wakes no untimed wait
        pass
    server.stop(0.5).wait(1.5)
    return 0


METHODS = ("Echo", "Slotted", "Read", "SlottedRead")
SLOTTED = ("Slotted", "SlottedRead")
"""The streams answered at the next slot, their wait for it left out of the round trip."""
READING = ("Read", "SlottedRead")
"""The streams that read their messages: their client joins the parts of each request."""


class BareClient:
    """One bare stream (``method``: one of ``METHODS``): ``round_trip_ms(parts)`` sends the
    parts as one message and waits for the reply."""

    def __init__(self, target: str, method: str) -> None:
        if method not in METHODS:
            raise ValueError(f"method {method!r} is not one of {METHODS}")
        self._slotted = method in SLOTTED
        self._reads = method in READING
        self._channel = grpc.insecure_channel(target, CHANNEL_OPTIONS)
        grpc.channel_ready_future(self._channel).result(timeout=30)
        self._out: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        # (when, the reply; or, once the call ended, None or the error that ended it)
        self._replies: queue.SimpleQueue[tuple[int, object]] = queue.SimpleQueue()
        self._call = self._channel.stream_stream(
            f"/{SERVICE}/{method}", request_serializer=None, response_deserializer=None
        )(self._requests())
        self._reader = threading.Thread(target=self._read, name="bare-read", daemon=True)
        self._reader.start()

    def _requests(self) -> Iterator[bytes]:
        while (item := self._out.get()) is not None:
            yield item

    def _read(self) -> None:
        try:
            for raw in self._call:
                reply = pb.ServerMessage.FromString(raw) if self._reads else raw
                self._replies.put((time.perf_counter_ns(), reply))
        except grpc.RpcError as exc:  # cancelled at close, or the server failed the call
            self._replies.put((time.perf_counter_ns(), exc))
            return
        self._replies.put((time.perf_counter_ns(), None))  # the server ended the call

    def round_trip_ms(self, parts: tuple[bytes, ...], timeout_s: float = 10.0) -> float:
        """``parts`` joined (when more than one) and sent, to the reply in, less (the slotted
        streams) the server's wait for its slot."""
        t0 = time.perf_counter_ns()
        request = parts[0] if len(parts) == 1 else b"".join(parts)
        self._out.put(request)
        t1, reply = self._replies.get(timeout=timeout_s)
        if reply is None or isinstance(reply, grpc.RpcError):
            self._replies.put((t1, reply))  # every later call fails the same way
            why = "" if reply is None else f": {reply.code()} {reply.details()}"
            raise RuntimeError(f"the bare stream ended{why}")
        wait_ns = 0
        if self._slotted and self._reads:
            times = reply.prediction.server_times
            wait_ns = times.decoded_ns - times.received_ns
        elif self._slotted:
            taken, handed = WAIT.unpack_from(reply)
            wait_ns = handed - taken
        return (t1 - t0 - wait_ns) / 1e6

    def close(self) -> None:
        self._out.put(None)
        self._call.cancel()
        self._channel.close()
