"""The fused block forward replayed as CUDA graphs, one per (block, batch composition), for
every chunk in the steady state (block implementation ``graph``).

Why: a small block's ~18 kernels are short, and the CPU's launches (Triton's Python launcher
among them) are the gap: a 1.3B block-task at 4680 tokens takes 1.46 ms on an H200 as a graph
replay and 1.88-1.99 ms launched op by op (docs/gpu.md). Larger blocks run longer kernels and
the CPU keeps ahead of them; a replay costs a handful of launches whatever the size.

What changes from one chunk of a composition to the next, and how the graph sees it:
- h, the noise level's modulation e0 and the chunk's RoPE table: copied into static input
  buffers before the replay (one set per batch size, shared by every graph: replays run one
  after another, on the device too when threads run on different streams);
- the KV-ring slot the chunk writes: a device-side index (``FusedBlocks.forward(slots=...)``).
  Once a ring is full (``KVRing.full``: the chunk attends its own slot and W earlier chunks,
  i.e. every slot; attention does not depend on the order of its keys) nothing else depends
  on the chunk. The first W chunks of a (stream, stage) run the fused forward directly.
- the rings, the stream's cross-attention K/V and the block's weights: fixed tensors of the
  composition, so they are its key (by address; held weakly: a key whose tensors are gone is
  dropped, and its address never matches a live tensor of another composition).

A composition seen once runs the static path eagerly (it warms up Triton, cuBLAS and cuDNN);
seen again, it is captured (``torch.cuda.CUDAGraph``; one memory pool for all graphs of the
model) and replayed from then on. A capture that fails leaves that composition eager (logged
once, counted in ``stats``). The output is copied out of the graph's static buffer, so a
later replay never overwrites an activation still queued. On a CPU nothing is captured: the
same static path runs every time (how the tests check the semantics without a GPU).
"""

from __future__ import annotations

import collections
import logging
import threading
import weakref
from dataclasses import dataclass, field
from typing import Protocol

import torch

from physis_ros.engine.kvring import StageTask
from physis_ros.engine.model import WanDiT

log = logging.getLogger(__name__)

MAX_GRAPHS = 4096
"""Compositions kept (least recently used dropped first): a few per block and stream."""


@dataclass
class _Buffers:
    """The static inputs and output of every graph of one batch size."""

    h: torch.Tensor
    e0: torch.Tensor
    rope: torch.Tensor
    slots: torch.Tensor
    out: torch.Tensor


@dataclass
class _Entry:
    refs: tuple[weakref.ref, ...]
    """The composition's rings, cross K/V and fused weights (alive: the key is theirs)."""
    seen: int = 0
    graph: torch.cuda.CUDAGraph | None = None
    failed: bool = False

    def alive(self) -> bool:
        return all(r() is not None for r in self.refs)


@dataclass
class GraphStats:
    eager: int = 0
    """Forwards of a not yet captured (or uncapturable) composition, through the static path."""
    warmup: int = 0
    """Forwards of rings not yet full (the fused forward itself)."""
    captured: int = 0
    replays: int = 0
    capture_failed: int = 0
    failures: list[str] = field(default_factory=list)
    """The first few capture errors."""

    def to_json(self) -> dict:
        return {k: v for k, v in self.__dict__.items()}


class SlotForward(Protocol):
    """What the graphs replay (``fused.FusedBlocks``): a block forward that can write K/V at
    ring entries given on the device, and the fused weights a composition is keyed by."""

    model: WanDiT

    def weights(self, block: int) -> object: ...

    def forward(
        self,
        block: int,
        h: torch.Tensor,
        e0: torch.Tensor,
        rope: torch.Tensor,
        tasks: list[StageTask],
        *,
        slots: torch.Tensor | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor: ...


class BlockGraphs:
    """CUDA graphs of ``fused``'s forward per (block, batch composition)."""

    def __init__(self, fused: SlotForward, *, capture: bool | None = None) -> None:
        self.fused = fused
        self.device = fused.model.device
        self.capture = self.device.type == "cuda" if capture is None else capture
        """Capture graphs (CUDA); else run the static path each time."""
        self.stats = GraphStats()
        self._entries: collections.OrderedDict[tuple, _Entry] = collections.OrderedDict()
        self._buffers: dict[tuple, _Buffers] = {}
        self._lock = threading.Lock()
        """Workers of one process share the model: fill, replay and copy-out are one step."""
        self._pool = None
        self._stream: torch.cuda.Stream | None = None
        self._last: torch.cuda.Stream | None = None
        """The stream of the last forward through the static buffers (see ``_order``)."""

    def forward(
        self,
        block: int,
        h: torch.Tensor,
        e0: torch.Tensor,
        rope: torch.Tensor,
        tasks: list[StageTask],
    ) -> torch.Tensor:
        """``FusedBlocks.forward``'s result (its ring writes included), replayed where it can."""
        if not all(t.ring.full(t.chunk) for t in tasks):
            self.stats.warmup += 1
            return self.fused.forward(block, h, e0, rope, tasks)
        w = self.fused.weights(block)
        held = [w]
        for t in tasks:
            held += [t.ring.k, t.ring.v, t.cross_k, t.cross_v]
        key = (block, h.dtype, tuple(h.shape), *(x.data_ptr() for x in held[1:]), id(w))
        with self._lock:
            self._order()
            entry = self._entry(key, held)
            bufs = self._buffers_for(h, e0, rope)
            slots = [t.ring.take_entry(t.chunk, observed=t.observed) for t in tasks]
            bufs.h.copy_(h)
            bufs.e0.copy_(e0)
            bufs.rope.copy_(rope)
            self._fill_slots(bufs.slots, slots)

            def static() -> torch.Tensor:
                return self.fused.forward(
                    block, bufs.h, bufs.e0, bufs.rope, tasks, slots=bufs.slots, out=bufs.out
                )

            entry.seen += 1
            if entry.graph is None and self.capture and not entry.failed and entry.seen >= 2:
                entry.graph = self._capture(static, key)
                entry.failed = entry.graph is None
            if entry.graph is not None:
                entry.graph.replay()
                self.stats.replays += 1
            elif self.capture and not entry.failed:  # the 1st sighting: warm up where
                self._on_capture_stream(static)  # the capture runs (cuBLAS/cuDNN state)
                self.stats.eager += 1
            else:
                static()
                self.stats.eager += 1
            return bufs.out.clone()

    def _order(self) -> None:
        """Forwards of threads on different CUDA streams run one after another on the device
        too: the static buffers (and the graphs' shared memory pool) are used by one at a
        time, so the current stream waits for the last one when they differ."""
        if self.device.type != "cuda":
            return
        current = torch.cuda.current_stream(self.device)
        if self._last is not None and self._last != current:
            current.wait_stream(self._last)
        self._last = current

    def _entry(self, key: tuple, held: list) -> _Entry:
        entry = self._entries.get(key)
        if entry is not None and not entry.alive():  # an address reused by new tensors
            del self._entries[key]
            entry = None
        if entry is None:  # rare (a few per block and stream): a scan is cheap here
            self._prune()
            entry = self._entries[key] = _Entry(tuple(weakref.ref(x) for x in held))
        self._entries.move_to_end(key)
        return entry

    def _prune(self) -> None:
        """Drop compositions whose tensors are gone (closed streams, re-fused weights), then
        the least recently used beyond ``MAX_GRAPHS``."""
        for key in [k for k, e in self._entries.items() if not e.alive()]:
            del self._entries[key]
        while len(self._entries) >= MAX_GRAPHS:
            self._entries.popitem(last=False)

    def _buffers_for(self, h: torch.Tensor, e0: torch.Tensor, rope: torch.Tensor) -> _Buffers:
        key = (tuple(h.shape), h.dtype, tuple(e0.shape), e0.dtype, tuple(rope.shape))
        bufs = self._buffers.get(key)
        if bufs is None:
            bufs = self._buffers[key] = _Buffers(
                h=torch.empty_like(h, memory_format=torch.contiguous_format),
                e0=torch.empty_like(e0, memory_format=torch.contiguous_format),
                rope=torch.empty_like(rope, memory_format=torch.contiguous_format),
                slots=torch.zeros(h.shape[0], dtype=torch.int64, device=h.device),
                out=torch.empty_like(h, memory_format=torch.contiguous_format),
            )
        return bufs

    def _fill_slots(self, dst: torch.Tensor, slots: list[int]) -> None:
        src = torch.tensor(slots, dtype=torch.int64)
        if dst.device.type == "cuda":  # through pinned memory: no host synchronisation
            src = src.pin_memory()
        dst.copy_(src, non_blocking=True)

    def _on_capture_stream(self, fn) -> None:
        """fn() on the stream captures run on, ordered after and before the current one."""
        if self.device.type != "cuda":  # the CPU tests' stand-in captures
            fn()
            return
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        current = torch.cuda.current_stream(self.device)
        self._stream.wait_stream(current)
        with torch.cuda.stream(self._stream):
            fn()
        current.wait_stream(self._stream)

    def _capture(self, static, key: tuple) -> torch.cuda.CUDAGraph | None:
        """``static`` captured (not run), or None when capture fails (logged once)."""
        try:
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            graph = torch.cuda.CUDAGraph()

            def capture() -> None:
                # thread_local: the other threads (host copier, other workers) may go on
                # using CUDA while this one captures
                graph.capture_begin(pool=self._pool, capture_error_mode="thread_local")
                try:
                    static()
                finally:
                    graph.capture_end()

            self._on_capture_stream(capture)
        except Exception as err:  # noqa: BLE001 - that composition stays eager, said so
            self.stats.capture_failed += 1
            if len(self.stats.failures) < 4:
                self.stats.failures.append(f"block {key[0]}: {err!r}"[:500])
            if self.stats.capture_failed == 1:
                log.warning("CUDA graph capture failed (the composition runs eagerly): %r", err)
            return None
        self.stats.captured += 1
        return graph
