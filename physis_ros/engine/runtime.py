"""Controller (what enters the pipeline, when) and the in-process runtime (workers + drivers).

The three executors differ only in the controller's release policy and the workers' history
mode, on the same workers:
  ``pipelined``         noisy history; up to ``max_in_flight`` chunks of a stream in flight;
  ``sequential-noisy``  noisy history; one chunk of a stream in flight at a time;
  ``sequential-clean``  clean history; one chunk at a time, and each generated chunk's clean
                        output is re-encoded at sigma 0 (a context chunk at step 0) before
                        the next chunk enters.
``InProcRuntime`` runs N workers in this process over ``InProcTransport``: ``run_inline``
drives them deterministically in one thread (tests); ``start_threads`` gives each its own
thread (torch releases the GIL inside ops). ``close`` (or ``with``) joins every thread it and
its workers started.
"""

from __future__ import annotations

import collections
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from physis_ros.engine.config import SamplerConfig
from physis_ros.engine.devcopy import to_device
from physis_ros.engine.model import WanDiT, make_cond
from physis_ros.engine.placement import Layout, Placement
from physis_ros.engine.sampler import initial_noise
from physis_ros.engine.transport import FLAG_CONTEXT, Activation, InProcTransport
from physis_ros.engine.worker import Worker

MODES = ("pipelined", "sequential-noisy", "sequential-clean")


@dataclass
class ChunkResult:
    stream_id: int
    chunk: int
    x: torch.Tensor
    """[X] float32 final state x^(K): on the host from a GPU worker (pinned, copied on a side
    stream), else on the sink worker's device."""
    created_s: float
    """time.monotonic() when the chunk entered the pipeline."""
    left_s: float
    """time.monotonic() when it left the last stage."""


@dataclass
class _Stream:
    seed: int
    mode: str
    entry_rank: int
    max_in_flight: int
    next_chunk: int = 0
    pending: collections.deque = field(default_factory=collections.deque)
    """(chunk, is_context, x) not yet released into the pipeline."""
    in_flight: int = 0
    context_entered_s: dict[int, float] = field(default_factory=dict)
    epoch: int = 0
    """Placement epoch stamped on every chunk released (``relayout`` bumps it)."""


class Controller:
    """Numbers chunks, draws their noise, releases them per the mode, collects finished ones.

    Not thread-safe: one thread (the driver) calls it."""

    def __init__(
        self, model: WanDiT, sampler: SamplerConfig, send: Callable[[int, Activation], None]
    ) -> None:
        self.cfg = model.cfg
        self.sampler = sampler
        self.device = model.device
        self._send = send
        self.streams: dict[int, _Stream] = {}

    def open_stream(
        self, stream_id: int, *, seed: int, mode: str, entry_rank: int, max_in_flight: int = 0
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"mode {mode!r} is not one of {MODES}")
        if stream_id in self.streams:
            raise ValueError(f"stream {stream_id} is already open")
        if max_in_flight < 0:
            raise ValueError(f"max_in_flight must be >= 0 (0: no limit), got {max_in_flight}")
        limit = 1 if mode != "pipelined" else max_in_flight
        self.streams[stream_id] = _Stream(seed, mode, entry_rank, limit)

    def close_stream(self, stream_id: int) -> None:
        self.streams.pop(stream_id, None)

    def relayout(self, stream_id: int, *, entry_rank: int) -> tuple[int, int]:
        """Start a new placement epoch: chunks released from now on go to ``entry_rank`` and
        carry the new epoch. Returns (epoch, first chunk of the epoch); the caller tells every
        worker (``Worker.relayout``) before or after, no barrier needed."""
        st = self._stream(stream_id)
        if st.mode == "sequential-clean":
            raise ValueError("placement changes need noisy history (not sequential-clean)")
        first = st.pending[0][0] if st.pending else st.next_chunk
        st.epoch += 1
        st.entry_rank = entry_rank
        return st.epoch, first

    def _stream(self, stream_id: int) -> _Stream:
        try:
            return self.streams[stream_id]
        except KeyError:
            raise ValueError(f"stream {stream_id} is not open") from None

    def submit_context(self, stream_id: int, x: torch.Tensor) -> int:
        """Queue an encoded observation (packed [X] state, clamped at sigma 0)."""
        st = self._stream(stream_id)
        x = torch.as_tensor(x, dtype=torch.float32)
        if not torch.isfinite(x).all():
            raise ValueError("context chunk contains NaN or inf")
        c = st.next_chunk
        st.next_chunk += 1
        st.pending.append((c, True, x))
        return c

    def submit_generate(self, stream_id: int, actions: torch.Tensor | None = None) -> int:
        """Queue a chunk to generate (``actions``: commanded actions of a condition model)."""
        st = self._stream(stream_id)
        c = st.next_chunk
        x = initial_noise(self.cfg, st.seed, c, actions)
        st.next_chunk += 1
        st.pending.append((c, False, x))
        return c

    def pump(self) -> int:
        """Release queued chunks the modes allow. Returns how many were released."""
        released = 0
        for sid, st in self.streams.items():
            while st.pending and (st.max_in_flight == 0 or st.in_flight < st.max_in_flight):
                c, is_ctx, x = st.pending.popleft()
                x = to_device(x, self.device)  # asynchronous: the GPU's queue is not drained
                act = Activation(sid, c, 0, 0, FLAG_CONTEXT if is_ctx else 0, x, None)
                act.epoch = st.epoch
                if is_ctx:
                    st.context_entered_s[c] = act.created_s
                st.in_flight += 1
                self._send(st.entry_rank, act)
                released += 1
        return released

    def finished(self, left_s: float, act: Activation) -> ChunkResult | None:
        """Account for a chunk that reached the sink; a ChunkResult for generated chunks."""
        st = self.streams.get(act.stream_id)
        if st is None:
            return None  # closed meanwhile
        st.in_flight -= 1
        if act.is_context:
            return None
        if st.mode == "sequential-clean":  # re-encode the clean output before anything else
            st.pending.appendleft((act.chunk, True, act.x))
        return ChunkResult(act.stream_id, act.chunk, act.x, act.created_s, left_s)

    def idle(self) -> bool:
        return all(not st.pending and st.in_flight == 0 for st in self.streams.values())


class InProcRuntime:
    """N workers in this process, a controller on the sink rank, and two ways to drive them."""

    def __init__(
        self,
        model: WanDiT,
        sampler: SamplerConfig,
        layout: Layout,
        *,
        num_workers: int | None = None,
        batching: bool = True,
        max_batch: int = 0,
        sink_rank: int = 0,
    ) -> None:
        self.model = model
        self.sampler = sampler
        self.layout = layout
        self.placement = Placement.uniform(layout, (), num_workers=num_workers, sink_rank=sink_rank)
        n = self.placement.num_workers
        self.transports = InProcTransport.group(n)
        self.workers = [
            Worker(model, sampler, t, self.placement, batching=batching, max_batch=max_batch)
            for t in self.transports
        ]
        self.controller = Controller(model, sampler, self.transports[sink_rank].send)
        self.sink = self.workers[sink_rank].sink
        self._threads: list[threading.Thread] = []
        self._stop = threading.Event()
        self.errors: list[BaseException] = []

    def open_stream(
        self,
        stream_id: int,
        *,
        seed: int = 0,
        cond: torch.Tensor | None = None,
        mode: str = "pipelined",
        max_in_flight: int = 0,
        layout: Layout | None = None,
    ) -> None:
        """``cond`` [n <= text_len, text_dim]: the stream's prompt embedding (None: none)."""
        layout = layout or self.layout
        history = "clean" if mode == "sequential-clean" else "noisy"
        for w in self.workers:
            w.open_stream(stream_id, layout=layout, cond=cond, history=history)
        self.placement = self.placement.with_stream(stream_id, layout)
        self.controller.open_stream(
            stream_id, seed=seed, mode=mode, entry_rank=layout[0][0], max_in_flight=max_in_flight
        )

    def close_stream(self, stream_id: int) -> None:
        self.controller.close_stream(stream_id)
        for w in self.workers:
            w.close_stream(stream_id)
        self.placement = self.placement.without_stream(stream_id)

    def relayout(self, stream_id: int, layout: Layout) -> int:
        """Move the stream to ``layout`` from its next released chunk on (KV rings of moved
        stages follow, see worker.py). Returns that chunk. The driver thread calls this."""
        epoch, first = self.controller.relayout(stream_id, entry_rank=layout[0][0])
        for w in self.workers:
            w.relayout(stream_id, epoch=epoch, first_chunk=first, layout=layout)
        self.placement = self.placement.without_stream(stream_id).with_stream(stream_id, layout)
        return first

    def drain(self, wait_s: float = 0.0) -> list[ChunkResult]:
        """Account for every finished chunk in the sink (waiting up to ``wait_s`` for the
        first), then release what the modes allow."""
        out = []
        items = []
        if wait_s > 0:
            try:
                items.append(self.sink.get(timeout=wait_s))
            except queue.Empty:
                return out
        while not self.sink.empty():
            items.append(self.sink.get())
        for left_s, act in items:
            res = self.controller.finished(left_s, act)
            if res is not None:
                out.append(res)
        self.controller.pump()
        return out

    def run_inline(
        self,
        max_rounds: int = 10_000_000,
        on_output: Callable[[ChunkResult], None] | None = None,
    ) -> list[ChunkResult]:
        """Drive every worker in turn in this thread until all released chunks are done.
        ``on_output`` runs in the loop after each finished chunk (e.g. interleaved timing)."""
        if self._threads:
            raise RuntimeError("workers are running in threads; use wait_idle")
        out = self.drain()
        for _ in range(max_rounds):
            for w in self.workers:
                w.run_once(0.0)
            new = self.drain()
            if new:
                out += new
                if on_output is not None:
                    for res in new:
                        on_output(res)
            if self.controller.idle():
                return out
        raise RuntimeError(f"pipeline not idle after {max_rounds} rounds")

    def start_threads(self) -> None:
        """One thread per worker, each looping ``run_once``."""
        if self._threads:
            return
        self._stop.clear()
        for w in self.workers:
            th = threading.Thread(
                target=self._loop, args=(w,), name=f"worker-{w.rank}", daemon=True
            )
            th.start()
            self._threads.append(th)

    def _loop(self, w: Worker) -> None:
        try:
            while not self._stop.is_set():
                w.run_once(0.005)
        except BaseException as err:  # noqa: BLE001 - surfaced by wait_idle / stop_threads, never swallowed
            self.errors.append(err)
            self._stop.set()

    def wait_idle(self, timeout_s: float, poll_s: float = 0.01) -> list[ChunkResult]:
        """Collect finished chunks until everything released is done (threads running)."""
        deadline = time.monotonic() + timeout_s
        out = self.drain()
        while not self.controller.idle():
            if self.errors:
                raise RuntimeError(f"a worker failed: {self.errors[0]!r}") from self.errors[0]
            if time.monotonic() > deadline:
                raise TimeoutError(f"pipeline not idle after {timeout_s} s")
            out += self.drain(wait_s=poll_s)  # blocks on the sink: no busy polling
        return out

    def stop_threads(self) -> None:
        self._stop.set()
        for th in self._threads:
            th.join(timeout=10.0)
        self._threads.clear()
        if self.errors:
            raise RuntimeError(f"a worker failed: {self.errors[0]!r}") from self.errors[0]

    def close(self) -> None:
        """Stop every thread the runtime and its workers started (worker loops, host copiers)
        and join them; raises a worker's failure like ``stop_threads``. Idempotent."""
        try:
            self.stop_threads()
        finally:
            for w in self.workers:
                w.close()

    def __enter__(self) -> InProcRuntime:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def run_plan(
    runtime: InProcRuntime,
    plans: dict[int, list[tuple[str, torch.Tensor | None]]],
    *,
    mode: str,
    seeds: dict[int, int] | None = None,
    conds: dict[int, torch.Tensor] | None = None,
    max_in_flight: int = 0,
    threads: bool = False,
    timeout_s: float = 600.0,
    on_output: Callable[[ChunkResult], None] | None = None,
) -> dict[int, dict[int, ChunkResult]]:
    """Open one stream per plan, submit every item (``("context", x)`` or
    ``("generate", actions_or_None)``), run to completion; results per stream per chunk.
    ``conds``: prompt embeddings per stream (default: ``make_cond`` seeded 100 + stream)."""
    for sid in plans:
        runtime.open_stream(
            sid,
            seed=(seeds or {}).get(sid, sid),
            cond=(conds or {}).get(sid, make_cond(runtime.model.cfg, 100 + sid)),
            mode=mode,
            max_in_flight=max_in_flight,
        )
    for sid, plan in plans.items():
        for kind, val in plan:
            if kind == "context":
                runtime.controller.submit_context(sid, val)
            elif kind == "generate":
                runtime.controller.submit_generate(sid, val)
            else:
                raise ValueError(f"plan item kind {kind!r} is not 'context' or 'generate'")
    runtime.controller.pump()
    if threads:
        runtime.start_threads()
        try:
            results = runtime.wait_idle(timeout_s)
        finally:
            runtime.stop_threads()
    else:
        results = runtime.run_inline(on_output=on_output)
    out: dict[int, dict[int, ChunkResult]] = {sid: {} for sid in plans}
    for r in results:
        out[r.stream_id][r.chunk] = r
    return out
