"""Every torch.distributed point-to-point call of the runtime lives here.

``TorchDistTransport`` implements the engine's ``Transport`` (``physis_ros.engine.transport``)
between ranks, and carries the runtime's control messages and heartbeats on the same channel.

Framing (the header layout and the start-up check that every rank runs the same wire code)
lives in ``framing``. With gloo header and payload travel as ONE uint8 message (tag
``TAG_HEADER``), received into a buffer of the largest size (gloo accepts a shorter message),
so a hop costs one rendezvous, not three; with NCCL they are separate messages (header on
``TAG_HEADER``, the rest on ``TAG_PAYLOAD``).

Receiving, and why it looks like this:
  - gloo (CPU): gloo fills ``is_completed()`` only inside ``wait()``, and a ``wait(timeout)``
    that expires closes the pair, so comm threads block in ``wait()`` on a whole message, copy
    it out and hand it to queues; compute never waits on them. Rank 0 has one thread per
    peer: an any-source receive is matched to the first sender that announces a message, and
    a rank hung mid-message would hold it, silencing every other rank to the controller. Each
    worker heartbeats rank 0, so these never idle into the process-group timeout. A worker
    has one any-source receive (its peers are whichever ranks the layouts put before it),
    kept alive by rank 0's heartbeats; a peer hung mid-message holds it, the worker stops
    hearing rank 0 and leaves, and rank 0 fails its streams.
  - NCCL (CUDA): no any-source receives, and p2p ops of one pair share one CUDA stream, so a
    posted receive would block sends to the same peer. Hence two extra groups, one per
    direction (lower -> higher rank, higher -> lower), a header receive posted ahead per peer,
    polled with ``is_completed()`` from the comm thread (NCCL runs on its own streams, so
    communication overlaps compute).
  - gloo with CUDA tensors (several ranks sharing one GPU, where NCCL refuses): payloads are
    staged through CPU.
Sending: one thread per destination does isend + wait in order, so ``send`` never waits for
the receiver and a hung receiver delays only traffic to itself. With NCCL, ``send`` records a
CUDA event on the caller's (compute) stream; the send thread makes its own comm stream wait on
that event and issues the p2p ops there, so the ops' completion is waited for on the comm
stream: the compute stream never waits for communication (overlap), and the data is complete
before NCCL reads it.
"""

from __future__ import annotations

import functools
import json
import logging
import queue
import threading
import time
from collections import defaultdict

import torch
import torch.distributed as dist

from physis_ros.engine.devcopy import copy_to_device_sync
from physis_ros.engine.ranks.framing import (
    HEADER_LEN,
    KIND_CONTROL,
    KIND_DATA,
    KIND_HEARTBEAT,
    TAG_HEADER,
    TAG_PAYLOAD,
    ActivationShapes,
    BufferReader,
    ControlMessage,
    activation_of,
    carries_h,
    check_data_header,
    encode_header,
    header_kind,
    payload_size,
)
from physis_ros.engine.transport import Activation

log = logging.getLogger(__name__)


class TorchDistTransport:
    """``Transport`` over torch.distributed point-to-point; one per rank.

    ``recv`` returns activations for this rank's stages; on rank 0, activations with
    ``step == K`` (finished chunks) go to ``recv_sink`` instead, and control messages from
    any rank to ``recv_control``. Sends to this rank itself bypass torch.distributed.
    """

    def __init__(self, *, shapes: ActivationShapes, device: torch.device) -> None:
        if not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialised (init_process_group first)")
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.backend = str(dist.get_backend())
        self.shapes = shapes
        self.device = torch.device(device)
        # Tensors cross the wire on the compute device with NCCL, on the CPU with gloo.
        self.wire_device = self.device if self.backend == "nccl" else torch.device("cpu")
        self._inbox: queue.SimpleQueue[Activation] = queue.SimpleQueue()
        self._sink: queue.SimpleQueue[tuple[float, Activation]] = queue.SimpleQueue()
        self._control: queue.SimpleQueue[ControlMessage] = queue.SimpleQueue()
        self._send_queues: dict[int, queue.SimpleQueue] = {}
        self._send_threads: dict[int, threading.Thread] = {}
        self._send_lock = threading.Lock()
        self._seq = 0
        self._last_heard_s: dict[int, float] = {}
        """Peers heard from: when their newest message arrived."""
        self._failed: dict[int, str] = {}
        self._closed = threading.Event()
        self.counters: dict[str, int] = defaultdict(int)
        """Messages and drops by reason (``sent``, ``received``, ``dropped_<reason>``)."""
        self._count_lock = threading.Lock()  # the send and receive threads all count
        self.recv_error: str | None = None
        """Why the receive thread stopped, if it stopped on an error."""
        self._byes_from: set[int] = set()
        self._final_byes: set[int] | None = None
        self._got_shutdown = False
        self._groups_by_direction: tuple | None = None
        if self.backend == "nccl":
            # Collective at construction: every rank builds its transport at start-up.
            up, down = dist.new_group(backend="nccl"), dist.new_group(backend="nccl")
            self._groups_by_direction = (up, down)
        staging = self.wire_device.type == "cpu" and self.device.type == "cuda"
        self._h2d_stream = torch.cuda.Stream(self.device) if staging else None
        """gloo with a CUDA device: host -> device copies of receives."""
        self.capacity_bytes = shapes.largest_message_bytes
        """Largest message: header, x and h (control messages must fit too)."""
        self._started_s = time.monotonic()
        """A peer not heard from yet is silent since then (its grace to join)."""
        if self.world_size == 1:
            loops = {}
        elif self.backend == "nccl":
            loops = {None: self._recv_loop_nccl}
        elif self.rank == 0:
            peers = range(1, self.world_size)
            loops = {p: functools.partial(self._recv_loop_gloo, p) for p in peers}
        else:
            loops = {None: self._recv_loop_gloo}
        self._recv_threads: dict[int | None, threading.Thread] = {}
        """Receive threads by the peer they take messages from (None: any peer)."""
        for peer, loop in loops.items():
            name = f"dist-recv-{'any' if peer is None else peer}"
            self._recv_threads[peer] = threading.Thread(target=loop, name=name, daemon=True)
            self._recv_threads[peer].start()

    # ---------------------------------------------------------------- public API
    def send(self, dst: int, msg: Activation) -> None:
        """Queue ``msg`` for rank ``dst``; returns at once (a thread per peer sends)."""
        if dst == self.rank:
            self._deliver(msg)
            return
        if msg.x.numel() != self.shapes.x_numel:
            raise ValueError(f"x has {msg.x.numel()} values, agreed {self.shapes.x_numel}")
        if msg.h is not None and tuple(msg.h.shape) != (self.shapes.h_tokens, self.shapes.h_dim):
            raise ValueError(
                f"h shape {tuple(msg.h.shape)} != agreed ({self.shapes.h_tokens}, "
                f"{self.shapes.h_dim})"
            )
        header = self._header(KIND_DATA, msg=msg)
        x = msg.x.detach().reshape(-1).to(self.wire_device, torch.float32)
        payload = [x]
        if msg.h is not None:
            payload.append(msg.h.detach().to(self.wire_device, self.shapes.h_dtype).contiguous())
        self._enqueue(dst, header, payload)

    def wake(self) -> None:
        """End a wait in ``recv``/``recv_sink``/``recv_control`` now (safe in a signal handler).

        Needed, not only faster: CPython 3.11's SimpleQueue.get(timeout) interrupted by a
        signal just before its deadline retries with a negative timeout, which means "wait
        forever" -- a worker rank given SIGTERM sat in a 2 ms get until it was killed."""
        for q in (self._inbox, self._sink, self._control):
            q.put(_WAKE)

    def recv(self, timeout_s: float) -> list[Activation]:
        """Every activation that arrived for this rank's stages; waits up to ``timeout_s``."""
        return _drain(self._inbox, timeout_s)

    def recv_sink(self, timeout_s: float) -> list[tuple[float, Activation]]:
        """Finished chunks (``step == K``) that reached this rank (the controller), each with
        time.monotonic() of its arrival here."""
        return _drain(self._sink, timeout_s)

    def put_sink(self, left_s: float, msg: Activation) -> None:
        """Hand a chunk that finished on this rank itself to ``recv_sink``."""
        self._sink.put((left_s, msg))

    def send_control(self, dst: int, kind: str, body: dict | None = None) -> None:
        """Send a JSON control message; to ``dst == rank`` it is delivered locally."""
        message = ControlMessage(self.rank, kind, dict(body or {}))
        if dst == self.rank:
            self._control.put(message)
            return
        data = json.dumps({"kind": kind, "body": message.body}).encode()
        if HEADER_LEN * 8 + len(data) > self.capacity_bytes:
            raise ValueError(
                f"control message {kind!r} has {len(data)} bytes, more than a message holds "
                f"({self.capacity_bytes - HEADER_LEN * 8})"
            )
        payload = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(self.wire_device)
        self._enqueue(dst, self._header(KIND_CONTROL, payload_bytes=len(data)), [payload])

    def recv_control(self, timeout_s: float = 0.0) -> list[ControlMessage]:
        return _drain(self._control, timeout_s)

    def send_heartbeat(self, dst: int) -> None:
        if dst != self.rank:
            self._enqueue(dst, self._header(KIND_HEARTBEAT), [])

    def seconds_since_heard(self, peer: int) -> float:
        """Seconds since any message from ``peer`` arrived (since start-up if none yet)."""
        return time.monotonic() - self._last_heard_s.get(peer, self._started_s)

    def heard_from(self, peer: int) -> bool:
        """Whether any message from ``peer`` arrived yet (a peer still joining has sent none;
        ``seconds_since_heard`` counts it from start-up)."""
        return peer in self._last_heard_s

    def failed_peers(self) -> dict[int, str]:
        """Peers a send to failed, with the reason."""
        return dict(self._failed)

    def pending_sends(self) -> int:
        return sum(q.qsize() for q in self._send_queues.values())

    def expect_final_byes(self, ranks) -> None:
        """Rank 0 at shutdown: the receive thread ends once each of ``ranks`` said ``bye``
        (a worker's receive thread ends on ``shutdown``). Call before sending ``shutdown``."""
        self._final_byes = set(ranks)

    def byes_from(self) -> set[int]:
        """Ranks whose ``bye`` arrived."""
        return set(self._byes_from)

    def recv_thread_ids(self) -> set[int]:
        """Native ids of the receive threads (for per-thread processor time)."""
        return {t.native_id for t in self._recv_threads.values() if t.native_id is not None}

    def join_recv(self, timeout_s: float) -> bool:
        """Wait for the receive threads to end; True if they did (or never ran). On rank 0
        only those of the ranks whose final ``bye`` is expected count: a failed rank's
        receive has no one left to answer it."""
        deadline = time.monotonic() + timeout_s
        threads = [
            t
            for peer, t in self._recv_threads.items()
            if peer is None or self._final_byes is None or peer in self._final_byes
        ]
        for thread in threads:
            thread.join(timeout=max(0.0, deadline - time.monotonic()))
        return not any(t.is_alive() for t in threads)

    def _recv_done(self, peer: int | None) -> bool:
        """Whether the receive of ``peer`` (None: of any peer) takes nothing more."""
        if self._got_shutdown or self._closed.is_set():
            return True
        if peer is not None:  # a worker's ``bye`` is the last message it sends
            return peer in self._byes_from
        return self._final_byes is not None and self._final_byes <= self._byes_from

    def _count(self, name: str, n: int = 1) -> None:
        with self._count_lock:
            self.counters[name] += n

    def close(self, flush_timeout_s: float = 2.0) -> None:
        """Flush queued sends (up to ``flush_timeout_s``) and stop the send threads.

        The receive threads cannot be cancelled (gloo has no abort for a posted receive):
        they end after the last message of the shutdown protocol (``shutdown`` on a worker, a
        peer's ``bye`` on rank 0); see ``join_recv``.
        """
        deadline = time.monotonic() + flush_timeout_s
        while self.pending_sends() and time.monotonic() < deadline:
            time.sleep(0.005)
        self._closed.set()
        for q in self._send_queues.values():
            q.put(None)
        for thread in self._send_threads.values():
            thread.join(timeout=max(0.0, deadline - time.monotonic()) + 0.5)

    # ---------------------------------------------------------------- sending
    def _header(self, kind: int, *, msg: Activation | None = None, payload_bytes: int = 0):
        with self._send_lock:
            self._seq += 1
            seq = self._seq
        values = encode_header(kind, seq, self.shapes, msg, payload_bytes)
        return torch.tensor(values, dtype=torch.int64, device=self.wire_device)

    def _enqueue(self, dst: int, header: torch.Tensor, payload: list[torch.Tensor]) -> None:
        ready = None
        if self.wire_device.type == "cuda":  # where the caller produced header and payload
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(self.wire_device))
        if not 0 <= dst < self.world_size:
            raise ValueError(f"destination rank {dst} is outside 0..{self.world_size - 1}")
        if dst in self._failed:
            self._count("dropped_peer_failed")
            return
        q = self._send_queues.get(dst)
        if q is None:
            with self._send_lock:
                q = self._send_queues.get(dst)
                if q is None:
                    q = queue.SimpleQueue()
                    thread = threading.Thread(
                        target=self._send_loop, args=(dst, q), name=f"dist-send-{dst}", daemon=True
                    )
                    self._send_queues[dst] = q
                    self._send_threads[dst] = thread
                    thread.start()
        q.put((header, payload, ready))

    def _send_loop(self, dst: int, q: queue.SimpleQueue) -> None:
        group = None
        if self._groups_by_direction is not None:
            group = self._groups_by_direction[0 if self.rank < dst else 1]
        comm_stream = None
        if self.wire_device.type == "cuda":
            comm_stream = torch.cuda.Stream(self.wire_device)
            torch.cuda.set_stream(comm_stream)  # this thread's current stream from now on
        while True:
            item = q.get()
            if item is None:
                return
            header, payload, ready = item
            try:
                if group is None:  # gloo: one message, header ++ payload bytes (see docstring)
                    parts = [header, *payload]
                    packed = torch.cat([t.reshape(-1).view(torch.uint8) for t in parts])
                    works = [dist.isend(packed, dst=dst, tag=TAG_HEADER)]
                else:
                    if ready is not None:
                        comm_stream.wait_event(ready)  # the compute stream is not touched
                    works = [dist.isend(header, dst=dst, group=group, tag=TAG_HEADER)]
                    works += [dist.isend(t, dst=dst, group=group, tag=TAG_PAYLOAD) for t in payload]
                for work in works:
                    work.wait()  # NCCL: the comm stream waits; gloo: the transfer is done
                if comm_stream is not None:
                    # Keep this pair's sends in order and bound what is queued on the GPU.
                    comm_stream.synchronize()
                self._count("sent")
            except RuntimeError as exc:  # gloo: peer closed / timed out; NCCL: comm error
                self._failed[dst] = f"send failed: {exc}"
                self._count("dropped_peer_failed", 1 + q.qsize())
                log.warning("rank %d: send to rank %d failed: %s", self.rank, dst, exc)
                return

    # ---------------------------------------------------------------- receiving
    def _alloc_payload(self) -> tuple[torch.Tensor, torch.Tensor]:
        s = self.shapes
        pin = self.wire_device.type == "cpu" and self.device.type == "cuda"
        x = torch.empty(s.x_numel, dtype=torch.float32, device=self.wire_device, pin_memory=pin)
        h = torch.empty(
            s.h_tokens, s.h_dim, dtype=s.h_dtype, device=self.wire_device, pin_memory=pin
        )
        return x, h

    def _deliver(self, msg: Activation) -> None:
        if msg.step >= self.shapes.steps:
            self._sink.put((time.monotonic(), msg))
        else:
            self._inbox.put(msg)

    def _recv_loop_gloo(self, peer: int | None = None) -> None:
        # One receive per message (from ``peer``, or from any peer when None) into a buffer of
        # the largest message; gloo accepts a shorter message into a longer buffer, and the
        # header says what follows.
        buffer = torch.empty(self.capacity_bytes, dtype=torch.uint8)
        header_bytes = HEADER_LEN * 8
        payload = list(self._alloc_payload())
        while not self._closed.is_set():
            try:
                work = dist.irecv(buffer, src=peer, tag=TAG_HEADER)
                work.wait()
                src = work._source_rank()
                values = buffer[:header_bytes].view(torch.int64).tolist()
                self._handle(src, values, BufferReader(buffer, header_bytes), payload)
                if self._recv_done(peer):
                    return
            except RuntimeError as exc:
                # The process-group timeout expired with no message (the heartbeats stopped),
                # the peer's connection broke, or the group was destroyed: nothing more will
                # arrive from there.
                if self._closed.is_set():
                    return
                if peer is not None:  # that peer only: the controller fails its streams
                    self._failed.setdefault(peer, f"receive failed: {exc}")
                    log.warning("rank %d: receive from rank %d failed: %s", self.rank, peer, exc)
                    return
                self.recv_error = str(exc)
                log.warning("rank %d: receive loop stopped: %s", self.rank, exc)
                self._control.put(ControlMessage(self.rank, "recv_stopped", {"error": str(exc)}))
                return

    def _recv_loop_nccl(self) -> None:
        # Receives are posted on this thread's own stream: posting one must not wait for the
        # compute queued on the default stream (NCCL orders an op after the caller's stream).
        torch.cuda.set_stream(torch.cuda.Stream(self.wire_device))
        up, down = self._groups_by_direction
        peers = [p for p in range(self.world_size) if p != self.rank]
        # Messages from a lower rank travel on the "up" group, from a higher one on "down".
        group_of = {p: (up if p < self.rank else down) for p in peers}
        headers = {
            p: torch.zeros(HEADER_LEN, dtype=torch.int64, device=self.wire_device) for p in peers
        }
        posted = {
            p: dist.irecv(headers[p], src=p, group=group_of[p], tag=TAG_HEADER) for p in peers
        }

        def recv_from(tensor: torch.Tensor, src: int) -> None:
            work = dist.irecv(tensor, src=src, group=group_of[src], tag=TAG_PAYLOAD)
            while not work.is_completed():
                time.sleep(20e-6)

        payload = list(self._alloc_payload())

        while not self._closed.is_set():
            idle = True
            for p in peers:
                if posted[p].is_completed():
                    idle = False
                    values = headers[p].tolist()
                    posted[p] = None
                    self._handle(p, values, recv_from, payload)
                    if self._recv_done(None):
                        return
                    posted[p] = dist.irecv(headers[p], src=p, group=group_of[p], tag=TAG_HEADER)
            if idle:
                time.sleep(20e-6)

    def _handle(self, src: int, h: list[int], recv_into, payload: list[torch.Tensor]) -> None:
        """One message from ``src`` with header ``h``; ``payload``: this receive thread's
        [x, h] buffers, replaced once a message's are handed on."""
        self._last_heard_s[src] = time.monotonic()
        kind = header_kind(src, h)
        if kind == KIND_HEARTBEAT:
            self._count("heartbeats_received")
        elif kind == KIND_CONTROL:
            data = torch.empty(payload_size(h), dtype=torch.uint8, device=self.wire_device)
            recv_into(data, src)
            self._take_control(src, data)
        else:
            check_data_header(src, h, self.shapes)
            self._take_data(h, recv_into, src, payload)

    def _take_control(self, src: int, data: torch.Tensor) -> None:
        try:
            decoded = json.loads(bytes(data.cpu().numpy()).decode())
            kind_name = decoded["kind"]
            self._control.put(ControlMessage(src, kind_name, decoded.get("body", {})))
            if kind_name == "shutdown":
                self._got_shutdown = True
            elif kind_name == "bye":
                self._byes_from.add(src)
        except (ValueError, KeyError, TypeError) as exc:
            self._count("dropped_bad_control")
            log.warning("rank %d: bad control message from rank %d: %s", self.rank, src, exc)

    def _take_data(self, h: list[int], recv_into, src: int, payload: list) -> None:
        x, hidden = payload
        has_h = carries_h(h)
        recv_into(x, src)
        if has_h:
            recv_into(hidden, src)
        if self.backend == "nccl":
            # Allocated on the receive stream, read by compute on the default stream: keep
            # the allocator from reusing them before that compute is done.
            compute = torch.cuda.default_stream(self.wire_device)
            x.record_stream(compute)
            if has_h:
                hidden.record_stream(compute)
        self._count("received")
        staged = self._h2d_stream is not None  # gloo with a CUDA device: pinned buffers
        if staged:
            parts = copy_to_device_sync(
                [x, hidden] if has_h else [x], self.device, self._h2d_stream
            )
            x_dev, h_dev = parts[0], (parts[1] if has_h else None)
        else:
            x_dev, h_dev = x, (hidden if has_h else None)
        self._deliver(activation_of(h, x_dev, h_dev))
        if staged:  # copied to the device: the pinned buffers take the next message
            return
        # Buffers for the next message, allocated while we wait for its header.
        payload[0] = torch.empty_like(x)
        if has_h:
            payload[1] = torch.empty_like(hidden)


_WAKE = object()
"""Put by ``wake``: ends a wait, never returned."""


def _drain(q: queue.SimpleQueue, timeout_s: float) -> list:
    out = []
    try:
        out.append(q.get(timeout=timeout_s) if timeout_s > 0 else q.get_nowait())
    except queue.Empty:
        return out
    while True:
        try:
            out.append(q.get_nowait())
        except queue.Empty:
            return [item for item in out if item is not _WAKE]
