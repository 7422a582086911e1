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
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from physis_ros.engine.config import SamplerConfig
from physis_ros.engine.devcopy import to_device
from physis_ros.engine.forward import make_cond
from physis_ros.engine.model import WanDiT
from physis_ros.engine.placement import Layout, Placement
from physis_ros.engine.sampler import initial_noise
from physis_ros.engine.transport import (
    FLAG_CONTEXT,
    FLAG_PREVIEWS,
    Activation,
    InProcTransport,
    preview_steps,
)
from physis_ros.engine.worker import Worker

MODES = ("pipelined", "sequential-noisy", "sequential-clean")

log = logging.getLogger(__name__)


@dataclass
class ChunkResult:
    stream_id: int
    chunk: int
    """Its time slot."""
    x: torch.Tensor
    """[X] float32 final state x^(K): on the host from a GPU worker (pinned, copied on a side
    stream), else on the sink worker's device."""
    created_s: float
    """time.monotonic() when the chunk entered the pipeline."""
    left_s: float
    """time.monotonic() when it left the last stage."""
    anchor: int = -1
    """The newest observed slot when it was released (-1: none): it is chunk - anchor ahead."""
    preview_steps: int = 0
    """0: the chunk, fully denoised; k < K: a preview, its x0 estimate after k steps."""


@dataclass(frozen=True)
class _Pending:
    """A chunk queued for release."""

    slot: int
    flags: int
    x: torch.Tensor
    anchor: int


@dataclass
class _Stream:
    seed: int
    mode: str
    entry_rank: int
    max_in_flight: int
    horizon: int
    """Slots a generated chunk may lie ahead of the newest observation (0: no limit, and
    observations never replace generated slots)."""
    previews: bool = False
    """Its generated chunks send an x0 estimate to the sink after every step but the last."""
    next_slot: int = 0
    """The next slot no chunk was queued for."""
    newest_observed: int = -1
    """The anchor of a chunk queued now."""
    newest_observed_x: torch.Tensor | None = None
    """That observation's packed state (``anchor_residual`` models start from it)."""
    next_ticket: int = 0
    pending: collections.deque = field(default_factory=collections.deque)
    """_Pending chunks not yet released into the pipeline, in queue order."""
    in_flight: int = 0
    context_entered_s: dict[int, float] = field(default_factory=dict)
    """slot -> when its observation entered the pipeline."""
    epoch: int = 0
    """Placement epoch stamped on every chunk released (``relayout`` bumps it)."""


class Controller:
    """Assigns chunks their slots and anchors, draws their noise, releases them per the mode,
    collects finished ones (the live timeline of DESIGN.md §3).

    A stream's chunks are released in the order they were queued, each with the next ticket.
    An observation takes slot ``slot`` (default: the next new one), after the newest observed
    slot and at most the next new one; with a horizon it may replace a slot already generated
    (or queued). A generated chunk takes the next new slot, anchored at the newest observed
    slot queued before it; with a horizon it lies at most ``horizon`` slots ahead of it, and
    may take a slot after that observation generated already (a rollout from each observation:
    the new version replaces the old one for every chunk released after it).

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
        self,
        stream_id: int,
        *,
        seed: int,
        mode: str,
        entry_rank: int,
        max_in_flight: int = 0,
        horizon: int = 0,
        previews: bool = False,
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"mode {mode!r} is not one of {MODES}")
        if stream_id in self.streams:
            raise ValueError(f"stream {stream_id} is already open")
        if max_in_flight < 0:
            raise ValueError(f"max_in_flight must be >= 0 (0: no limit), got {max_in_flight}")
        if horizon < 0:
            raise ValueError(f"horizon must be >= 0 (0: no limit), got {horizon}")
        limit = 1 if mode != "pipelined" else max_in_flight
        self.streams[stream_id] = _Stream(seed, mode, entry_rank, limit, horizon, previews)

    def close_stream(self, stream_id: int) -> None:
        self.streams.pop(stream_id, None)

    def relayout(self, stream_id: int, *, entry_rank: int) -> tuple[int, int]:
        """Start a new placement epoch: chunks released from now on go to ``entry_rank`` and
        carry the new epoch. Returns (epoch, first ticket of the epoch); the caller tells every
        worker (``Worker.relayout``) before or after, no barrier needed."""
        st = self._stream(stream_id)
        if st.mode == "sequential-clean":
            raise ValueError("placement changes need noisy history (not sequential-clean)")
        st.epoch += 1
        st.entry_rank = entry_rank
        return st.epoch, st.next_ticket

    def _stream(self, stream_id: int) -> _Stream:
        try:
            return self.streams[stream_id]
        except KeyError:
            raise ValueError(f"stream {stream_id} is not open") from None

    def anchor(self, stream_id: int) -> int:
        """The newest observed slot queued (-1: none): the anchor of a chunk queued now."""
        return self._stream(stream_id).newest_observed

    def next_slot(self, stream_id: int) -> int:
        """The slot the next generated chunk (or new observation) takes."""
        return self._stream(stream_id).next_slot

    def submit_context(self, stream_id: int, x: torch.Tensor, *, slot: int | None = None) -> int:
        """Queue an encoded observation (packed [X] state) of ``slot`` (None: the next new
        slot). Returns its slot."""
        st = self._stream(stream_id)
        x = torch.as_tensor(x, dtype=torch.float32)
        if not torch.isfinite(x).all():
            raise ValueError("context chunk contains NaN or inf")
        slot = st.next_slot if slot is None else int(slot)
        if slot <= st.newest_observed or slot > st.next_slot:
            raise ValueError(
                f"observation of slot {slot}: slots after {st.newest_observed} up to "
                f"{st.next_slot} can be observed"
            )
        if slot < st.next_slot and not st.horizon:
            raise ValueError(
                f"observation of slot {slot}, already generated: only a stream with a "
                "horizon replaces generated slots"
            )
        st.pending.append(_Pending(slot, FLAG_CONTEXT, x, slot))
        st.newest_observed = slot
        if self.cfg.anchor_residual:  # kept only where a generated chunk starts from it
            st.newest_observed_x = x
        st.next_slot = max(st.next_slot, slot + 1)
        return slot

    def submit_generate(
        self, stream_id: int, actions: torch.Tensor | None = None, *, slot: int | None = None
    ) -> int:
        """Queue a chunk to generate for ``slot`` (None: the next new slot; with a horizon,
        a slot after the newest observed one that was generated already: generated again,
        anchored at that observation) (``actions``: commanded actions of a condition model).
        Returns its slot; ValueError beyond the stream's horizon."""
        st = self._stream(stream_id)
        c = st.next_slot if slot is None else int(slot)
        if slot is not None and not st.newest_observed < c <= st.next_slot:
            raise ValueError(
                f"generate slot {c}: slots after {st.newest_observed} up to {st.next_slot} "
                "can be generated"
            )
        if c < st.next_slot and not st.horizon:
            raise ValueError(
                f"generate slot {c}, already generated: only a stream with a horizon "
                "generates a slot again"
            )
        if st.horizon and c - st.newest_observed > st.horizon:
            raise ValueError(
                f"slot {c} is {c - st.newest_observed} ahead of the newest observed slot "
                f"{st.newest_observed}; the stream's horizon is {st.horizon}"
            )
        x = initial_noise(self.cfg, st.seed, c, actions, st.newest_observed_x)
        st.pending.append(_Pending(c, FLAG_PREVIEWS if st.previews else 0, x, st.newest_observed))
        st.next_slot = max(st.next_slot, c + 1)
        return c

    def pump(self) -> int:
        """Release queued chunks the modes allow. Returns how many were released."""
        released = 0
        for sid, st in self.streams.items():
            while st.pending and (st.max_in_flight == 0 or st.in_flight < st.max_in_flight):
                p = st.pending.popleft()
                act = Activation(
                    sid,
                    p.slot,
                    0,
                    0,
                    p.flags,
                    to_device(p.x, self.device),  # asynchronous: the GPU's queue is not drained
                    None,
                    epoch=st.epoch,
                    ticket=st.next_ticket,
                    anchor=p.anchor,
                )
                st.next_ticket += 1
                if act.observed:
                    st.context_entered_s[p.slot] = act.created_s
                st.in_flight += 1
                self._send(st.entry_rank, act)
                released += 1
        return released

    def finished(self, left_s: float, act: Activation) -> ChunkResult | None:
        """Account for a chunk that reached the sink; a ChunkResult for generated chunks."""
        st = self.streams.get(act.stream_id)
        if st is None:
            return None  # closed meanwhile
        steps = preview_steps(act.flags)
        if steps:  # a preview: the chunk itself is still in flight
            return ChunkResult(
                act.stream_id, act.chunk, act.x, act.created_s, left_s, act.anchor, steps
            )
        st.in_flight -= 1
        if act.is_context:
            return None
        if st.mode == "sequential-clean":  # re-encode the clean output before anything else
            st.pending.appendleft(_Pending(act.chunk, FLAG_CONTEXT, act.x, act.anchor))
        return ChunkResult(act.stream_id, act.chunk, act.x, act.created_s, left_s, act.anchor)

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
        horizon: int = 0,
        previews: bool = False,
    ) -> None:
        """``cond`` [n <= text_len, text_dim]: the stream's prompt embedding (None: none);
        ``previews``: its chunks' x0 estimates reach the sink after each step but the last."""
        layout = layout or self.layout
        history = "clean" if mode == "sequential-clean" else "noisy"
        for w in self.workers:
            w.open_stream(
                stream_id, layout=layout, cond=cond, history=history, seed=seed, horizon=horizon
            )
        self.placement = self.placement.with_stream(stream_id, layout)
        self.controller.open_stream(
            stream_id,
            seed=seed,
            mode=mode,
            entry_rank=layout[0][0],
            max_in_flight=max_in_flight,
            horizon=horizon,
            previews=previews,
        )

    def close_stream(self, stream_id: int) -> None:
        self.controller.close_stream(stream_id)
        for w in self.workers:
            w.close_stream(stream_id)
        self.placement = self.placement.without_stream(stream_id)

    def relayout(self, stream_id: int, layout: Layout) -> int:
        """Move the stream to ``layout`` from its next released chunk on (KV rings of moved
        stages follow, see worker.py). Returns that chunk's ticket. The driver thread calls
        this."""
        epoch, first = self.controller.relayout(stream_id, entry_rank=layout[0][0])
        for w in self.workers:
            w.relayout(stream_id, epoch=epoch, first_ticket=first, layout=layout)
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
        except BaseException as err:
            log.exception("worker %d failed", w.rank)  # the traceback, once, where it happened
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


def submit_item(controller: Controller, stream_id: int, item: tuple) -> int:
    """Queue one plan item (``oracle.Plan``: ("context", x), ("observe", slot, x) or
    ("generate", actions or None[, slot])) on the stream; returns its slot."""
    kind = item[0]
    if kind == "context":
        return controller.submit_context(stream_id, item[1])
    if kind == "observe":
        return controller.submit_context(stream_id, item[2], slot=item[1])
    if kind == "generate":
        slot = item[2] if len(item) > 2 else None
        return controller.submit_generate(stream_id, item[1], slot=slot)
    raise ValueError(f"plan item kind {kind!r} is not context, observe or generate")


def run_plan(
    runtime: InProcRuntime,
    plans: dict[int, list[tuple]],
    *,
    mode: str,
    seeds: dict[int, int] | None = None,
    conds: dict[int, torch.Tensor] | None = None,
    max_in_flight: int = 0,
    horizon: int = 0,
    threads: bool = False,
    timeout_s: float = 600.0,
    on_output: Callable[[ChunkResult], None] | None = None,
) -> dict[int, dict[int, ChunkResult]]:
    """Open one stream per plan, submit every item (``oracle.Plan``), run to completion;
    results per stream per slot. ``conds``: prompt embeddings per stream (default:
    ``make_cond`` seeded 100 + stream)."""
    for sid in plans:
        runtime.open_stream(
            sid,
            seed=(seeds or {}).get(sid, sid),
            cond=(conds or {}).get(sid, make_cond(runtime.model.cfg, 100 + sid)),
            mode=mode,
            max_in_flight=max_in_flight,
            horizon=horizon,
        )
    for sid, plan in plans.items():
        for item in plan:
            submit_item(runtime.controller, sid, item)
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
