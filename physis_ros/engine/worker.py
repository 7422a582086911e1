"""The worker: one device, the blocks of its stages, the KV rings of its virtual ranks.

``run_once(timeout_s)`` is the whole event loop body: receive activations -> find ready tasks
(the head of each (stream, stage) FIFO) -> pick the tasks that share one block's weights ->
one batched forward -> send each result to the owner of its next stage (or to the sink).
A worker talks to other workers only through its ``Transport``; the same class runs one per
thread over ``InProcTransport`` here and one per torch.distributed rank in ``physis_ros.serve``.

Controllers feed a chunk by sending ``Activation(step=0, block=0, h=None)`` to
``placement.entry_rank(stream)``; finished chunks (``step == K``) arrive in ``worker.sink`` on
``placement.sink_rank`` as ``(left_s, activation)`` (left_s: time.monotonic() when it left
the last stage). Context chunks reach the sink too (flag set, x unchanged) so that a
controller can count what is in flight.

Order. Every chunk a stream releases carries a ticket (0, 1, 2, ... in release order) and
runs at each stage strictly in ticket order: that order, not the slot, decides which version
of a slot (observed or predicted) a chunk reads (kvring.KVRing; DESIGN.md §3, live streams),
and every chunk checks before its forward that the ring holds the history its anchor implies.

A stream's state on this worker, and how it changes placement while running (``relayout``):
``relayout.py``. Here: the event loop, the per-stage FIFOs, batching and the Euler step.
"""

from __future__ import annotations

import collections
import dataclasses
import queue
import time
import weakref
from dataclasses import dataclass, field

import torch

from physis_ros.engine.config import SamplerConfig
from physis_ros.engine.devcopy import HostCopier
from physis_ros.engine.forward import cross_kv, embed_cond, pad_text
from physis_ros.engine.kvring import KVRing, StageTask
from physis_ros.engine.model import WanDiT
from physis_ros.engine.placement import Layout, Placement, blocks_share_worker, validate_layout
from physis_ros.engine.relayout import StreamState
from physis_ros.engine.sampler import context_noise, noise_context
from physis_ros.engine.sampler import sigmas as make_sigmas
from physis_ros.engine.stage import StageCaches, run_block
from physis_ros.engine.transport import (
    FLAG_KV,
    FLAG_PREVIEW,
    FLAG_PREVIEWS,
    PREVIEW_STEPS_SHIFT,
    Activation,
    Transport,
)

HISTORIES = ("noisy", "clean")


@dataclass
class WorkerStats:
    tasks: int = 0
    batches: int = 0
    mixed_batches: int = 0
    """Batched forwards whose tasks came from more than one stream (cross-stream batching)."""
    busy_s: float = 0.0
    rings_sent: int = 0
    """KV rings sent to a stage's new owner after placement changes."""
    rings_installed: int = 0
    held: int = 0
    """Activations held because their placement epoch had not reached this worker yet."""
    drops: collections.Counter = field(default_factory=collections.Counter)
    """reason -> activations dropped."""
    block_times: list[tuple[int, int, int, float]] | None = None
    """(block, batch size, smallest chunk index, ms) of every forward, when recording
    (``Worker.record_block_times``; synchronises the device, so off by default)."""
    block_cpu_ms: list[float] | None = None
    """Thread CPU time (ms) of the same forwards, index for index with ``block_times``."""


class Worker:
    """Runs the stages that ``placement`` puts on ``transport.rank``."""

    def __init__(
        self,
        model: WanDiT,
        sampler: SamplerConfig,
        transport: Transport,
        placement: Placement,
        *,
        batching: bool = True,
        max_batch: int = 0,
    ) -> None:
        if placement.steps != sampler.steps or placement.blocks != model.cfg.num_blocks:
            raise ValueError(
                f"placement is K={placement.steps} L={placement.blocks} but sampler K="
                f"{sampler.steps}, model L={model.cfg.num_blocks}"
            )
        if max_batch < 0:
            raise ValueError(f"max_batch must be >= 0 (0: no limit), got {max_batch}")
        self.model = model
        self.cfg = model.cfg
        self.sampler = sampler
        self.transport = transport
        self.rank = transport.rank
        self.placement = placement
        self.batching = batching
        self.max_batch = max_batch
        self.sigmas = make_sigmas(sampler)
        self.steps, self.blocks = sampler.steps, model.cfg.num_blocks
        self.device, self.dtype = model.device, model.dtype
        self.caches = StageCaches(model, self.sigmas)
        self.sink: queue.SimpleQueue[tuple[float, Activation]] = queue.SimpleQueue()
        self.stats = WorkerStats()
        self._streams: dict[int, StreamState] = {}
        self._queues: dict[tuple[int, int, int], collections.deque[Activation]] = {}
        self._nonempty: set[tuple[int, int, int]] = set()
        self._stalled = False
        """Queued tasks exist but none can run (waiting for a KV ring or an earlier chunk)."""
        self._control: queue.SimpleQueue = queue.SimpleQueue()
        self._host_copier: HostCopier | None = None

    def close(self) -> None:
        """Stop the threads this worker started (its host copier: copies asked for so far are
        delivered first). Idempotent; call it once the worker's loop has stopped."""
        if self._host_copier is not None:
            self._host_copier.close()

    # ---- streams (thread-safe: applied by the worker's own loop) ---------------------------
    def open_stream(
        self,
        stream_id: int,
        *,
        layout: Layout | None = None,
        cond: torch.Tensor | None = None,
        history: str = "noisy",
        seed: int = 0,
        horizon: int = 0,
    ) -> None:
        """Allocate the stream's KV rings and cross-attention K/V for the stages on this rank;
        ``cond`` [n <= text_len, text_dim]: its prompt embedding (None: no tokens, all
        padding); ``horizon``: the stream's (0: none, its observations never replace a
        generated slot). Must be called (on every rank) before the stream's first chunk is
        sent."""
        if cond is None:
            cond = torch.zeros(0, self.cfg.text_dim)
        layout = layout if layout is not None else self.placement.layouts[stream_id]
        validate_layout(layout, self.steps, self.blocks, self.placement.num_workers)
        if history not in HISTORIES:
            raise ValueError(f"history {history!r} is not one of {HISTORIES}")
        if history == "clean" and not blocks_share_worker(layout):
            raise ValueError(
                "clean history shares each block's cache over all steps: every "
                "block's stages must be on one worker (use layout_by_block)"
            )
        if history == "clean" and self.sampler.context_noise != "clean":
            raise ValueError("clean history takes observations clean (context_noise 'clean')")
        if horizon < 0:
            raise ValueError(f"horizon must be >= 0 (0: none), got {horizon}")
        pad_text(self.cfg, cond)  # a bad conditioning fails here, not in the worker loop
        self._control.put(("open", stream_id, layout, cond, history, seed, horizon))

    def close_stream(self, stream_id: int) -> None:
        """Free the stream's rings; its activations still in flight are dropped and counted."""
        self._control.put(("close", stream_id))

    def relayout(self, stream_id: int, *, epoch: int, first_ticket: int, layout: Layout) -> None:
        """From ticket ``first_ticket`` on, the stream's stages run where ``layout`` says (see
        the module docstring). Every worker gets the same call; the model must already hold
        the blocks of the stages it gains. Noisy history only."""
        validate_layout(layout, self.steps, self.blocks, self.placement.num_workers)
        if first_ticket < 0 or epoch < 1:
            raise ValueError(f"need first_ticket >= 0 and epoch >= 1, got {first_ticket}, {epoch}")
        gained = {blk for row in layout for blk, r in enumerate(row) if r == self.rank}
        missing = gained - self.model.block_ids
        if missing:
            raise ValueError(f"rank {self.rank} lacks blocks {sorted(missing)} of the new layout")
        self._control.put(("relayout", stream_id, epoch, first_ticket, layout))

    def _apply_control(self) -> None:
        while True:
            try:
                cmd = self._control.get_nowait()
            except queue.Empty:
                return
            if cmd[0] == "close":
                self._streams.pop(cmd[1], None)
                for key in [k for k in self._queues if k[0] == cmd[1]]:
                    self.stats.drops["stream closed"] += len(self._queues.pop(key))
                    self._nonempty.discard(key)
                continue
            if cmd[0] == "relayout":
                self._apply_relayout(*cmd[1:])
                continue
            _, sid, layout, cond, history, seed, horizon = cmd
            if sid in self._streams:
                raise ValueError(f"stream {sid} is already open on rank {self.rank}")
            self._streams[sid] = self._allocate(layout, cond, history, seed, horizon)

    def _apply_relayout(self, sid: int, epoch: int, first_ticket: int, layout: Layout) -> None:
        st = self._streams.get(sid)
        if st is None:
            self.stats.drops["relayout of an unknown or closed stream"] += 1
            return
        gained = st.change_layout(sid, self.rank, epoch, first_ticket, layout)
        if gained:
            ctx = embed_cond(self.model, st.cond)
            for blk in gained:
                st.cross[blk] = cross_kv(self.model, blk, ctx)
        self._ship_ready(sid, st)
        held, st.held = st.held, []
        for msg in held:
            self._accept(msg)

    def _ship_ready(self, sid: int, st: StreamState) -> None:
        """Send every ring whose stage has run the last chunk it runs here."""
        for stage, ring, dst in st.take_due_rings():
            for msg in st.ring_messages(sid, stage, ring, self.cfg):
                self.transport.send(dst, msg)
            self.stats.rings_sent += 1

    def _install_piece(self, st: StreamState, msg: Activation) -> None:
        if (msg.step, msg.block) in st.rings:
            self.stats.drops["KV ring piece for a stage whose ring is here"] += 1
            return
        pieces = st.add_ring_piece(msg, KVRing.entries_for(self.sampler.window, st.horizon))
        if pieces is None:
            return
        st.install_ring(self._new_ring(st.horizon), pieces, self.cfg)
        self.stats.rings_installed += 1
        self._stalled = False
        if st.ship:  # it may move on at once (two changes before a chunk ran here)
            self._ship_ready(msg.stream_id, st)

    def _new_ring(self, horizon: int) -> KVRing:
        cfg = self.cfg
        return KVRing(
            self.sampler.window,
            cfg.num_heads,
            cfg.tokens_per_chunk,
            cfg.head_dim,
            self.device,
            self.dtype,
            horizon,
        )

    @torch.inference_mode()
    def _allocate(
        self, layout: Layout, cond: torch.Tensor, history: str, seed: int, horizon: int
    ) -> StreamState:
        st = StreamState(layout=layout, history=history, seed=seed, horizon=horizon)
        mine = [
            (k, blk)
            for k in range(self.steps)
            for blk in range(self.blocks)
            if layout[k][blk] == self.rank
        ]
        missing = {blk for _, blk in mine} - self.model.block_ids
        if missing:
            raise ValueError(f"rank {self.rank} hosts blocks {sorted(missing)} its model lacks")
        st.cond = cond
        st.epochs.append((0, layout))
        ctx = embed_cond(self.model, cond) if mine else None
        for k, blk in mine:
            key = (0, blk) if history == "clean" else (k, blk)
            if key not in st.rings:
                st.rings[key] = self._new_ring(horizon)
            if blk not in st.cross:
                st.cross[blk] = cross_kv(self.model, blk, ctx)
        return st

    def record_block_times(self, on: bool = True) -> None:
        """Record the wall time of every batched forward in ``stats.block_times``."""
        self.stats.block_times = [] if on else None
        self.stats.block_cpu_ms = [] if on else None

    def kv_bytes(self) -> int:
        return sum(r.nbytes() for st in self._streams.values() for r in st.rings.values())

    # ---- the event loop --------------------------------------------------------------------
    def has_work(self) -> bool:
        return bool(self._nonempty)

    def queued_tasks(self) -> int:
        """Tasks waiting at this worker's stages (safe from any thread: a snapshot)."""
        return sum(len(q) for q in list(self._queues.values()))

    def run_once(self, timeout_s: float = 0.0) -> int:
        """Receive, then run at most one batch. Returns the number of tasks run."""
        busy = self._nonempty and not self._stalled
        msgs = self.transport.recv(0.0 if busy else timeout_s)
        self._apply_control()
        for msg in msgs:
            self._accept(msg)
        if not self._nonempty:
            return 0
        keys = self._pick()
        self._stalled = not keys
        if not keys:
            return 0
        t0 = time.perf_counter()
        self._run(keys)
        self.stats.busy_s += time.perf_counter() - t0
        self.stats.tasks += len(keys)
        self.stats.batches += 1
        self.stats.mixed_batches += len({key[0] for key in keys}) > 1
        return len(keys)

    def _accept(self, msg: Activation) -> None:
        if msg.step == self.steps:
            if self.rank == self.placement.sink_rank:
                self._to_sink(msg)
            else:
                self.stats.drops["finished chunk at a rank that is not the sink"] += 1
            return
        st = self._streams.get(msg.stream_id)
        if st is None:
            self.stats.drops["unknown or closed stream"] += 1
            return
        if not (0 <= msg.step < self.steps and 0 <= msg.block < self.blocks):
            self.stats.drops["stage out of range"] += 1
            return
        if msg.epoch > st.epoch:  # its placement change has not reached this worker yet
            st.held.append(msg)
            self.stats.held += 1
            return
        if msg.flags & FLAG_KV:
            self._install_piece(st, msg)
            return
        if st.layout_for(msg.ticket)[msg.step][msg.block] != self.rank:
            self.stats.drops["stage placed on another rank"] += 1
            return
        if msg.x.device != self.device:
            msg.x = msg.x.to(self.device)
        if msg.h is not None and (msg.h.device != self.device or msg.h.dtype != self.dtype):
            msg.h = msg.h.to(self.device, self.dtype)
        self._enqueue(msg)

    def _enqueue(self, msg: Activation) -> None:
        key = (msg.stream_id, msg.step, msg.block)
        q = self._queues.get(key)
        if q is None:
            q = self._queues[key] = collections.deque()
        if q and msg.ticket < q[-1].ticket:  # from two senders around a placement change
            i = len(q)
            while i > 0 and q[i - 1].ticket > msg.ticket:
                i -= 1
            q.insert(i, msg)
        else:
            q.append(msg)
        self._nonempty.add(key)
        self._stalled = False

    def _ready(self, key: tuple[int, int, int]) -> bool:
        """The head of the stage's FIFO can run: (noisy history) the stage's ring is here and
        the head is the ticket after the last one that ran here."""
        st = self._streams[key[0]]
        if st.history == "clean":
            return True
        stage = (key[1], key[2])
        head = self._queues[key][0].ticket
        return stage in st.rings and head == st.last_ticket.get(stage, -1) + 1

    def _pick(self) -> list[tuple[int, int, int]]:
        """Ready tasks to run now: the heads of the (stream, stage) FIFOs (arrival order is
        release order, so the head's predecessor is done). Without batching: the most
        downstream one. With batching: the block with most ready tasks (ties: downstream),
        its most downstream ``max_batch`` tasks."""
        L = self.blocks

        def depth(key: tuple[int, int, int]) -> tuple[int, int]:
            return (key[1] * L + key[2], -key[0])

        ready = [key for key in self._nonempty if self._ready(key)]
        if not ready:
            return []
        if not self.batching:
            return [max(ready, key=depth)]
        groups: dict[int, list[tuple[int, int, int]]] = {}
        for key in ready:
            groups.setdefault(key[2], []).append(key)
        best = max(groups.values(), key=lambda g: (len(g), max(depth(k) for k in g)))
        if self.max_batch and len(best) > self.max_batch:
            best = sorted(best, key=depth, reverse=True)[: self.max_batch]
        return best

    def _task(self, st: StreamState, msg: Activation) -> StageTask:
        """What ``run_block`` needs for ``msg`` at its stage, after checking its history."""
        k, blk = msg.step, msg.block
        clean = st.history == "clean"
        last = st.last_ticket.get((k, blk), -1)
        # FIFO per stage keeps release order; a gap would mean attending to the wrong KV.
        if not (msg.ticket > last if clean else msg.ticket == last + 1):
            raise RuntimeError(
                f"stream stage ({k},{blk}): ticket {msg.ticket} (slot {msg.chunk}) after {last}"
            )
        st.last_ticket[(k, blk)] = msg.ticket
        ring = st.rings[(0, blk) if clean else (k, blk)]
        ring.check_history(msg.chunk, msg.anchor)
        x, sigma = msg.x, self.sigmas[k]
        if msg.is_context and (clean or self.sampler.context_noise == "clean"):
            sigma = 0.0
        elif msg.is_context and blk == 0:  # a noised observation: only block 0 embeds x
            x = noise_context(self.cfg, x, context_noise(self.cfg, st.seed, msg.chunk), sigma)
        cross_k, cross_v = st.cross[blk]
        return StageTask(
            chunk=msg.chunk,
            step=k,
            sigma=sigma,
            x=x,
            h=msg.h,
            ring=ring,
            observed=msg.observed,
            cross_k=cross_k,
            cross_v=cross_v,
        )

    def _run(self, keys: list[tuple[int, int, int]]) -> None:
        block = keys[0][2]
        tasks, msgs = [], []
        for key in keys:
            q = self._queues[key]
            msg = q.popleft()
            if not q:
                self._nonempty.discard(key)
            tasks.append(self._task(self._streams[key[0]], msg))
            msgs.append(msg)
        if self.stats.block_times is None:
            h, v = run_block(self.model, block, tasks, self.caches)
        else:
            t0, cpu0 = time.perf_counter(), time.thread_time()
            h, v = run_block(self.model, block, tasks, self.caches)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            ms = (time.perf_counter() - t0) * 1e3
            self.stats.block_times.append((block, len(tasks), min(t.chunk for t in tasks), ms))
            self.stats.block_cpu_ms.append((time.thread_time() - cpu0) * 1e3)
        for i, msg in enumerate(msgs):
            self._forward(msg, h[i], None if v is None else v[i])
        for sid in {key[0] for key in keys}:
            st = self._streams[sid]
            if st.ship:
                self._ship_ready(sid, st)

    def _to_sink(self, msg: Activation) -> None:
        """A finished chunk to ``sink``. From a GPU its x crosses to pinned host memory on a
        copy stream first (``devcopy.HostCopier``): the worker never waits for the GPU, and
        the chunk reaches the sink (its ``left_s`` stamped) when the GPU has produced it."""
        if msg.x.device.type != "cuda":
            self.sink.put((time.monotonic(), msg))
            return
        if self._host_copier is None:
            self._host_copier = HostCopier(msg.x.device)
            # its thread ends with the worker (``close``; a worker dropped unclosed: here, and
            # at the latest devcopy's atexit hook joins it before the interpreter finalises)
            weakref.finalize(self, self._host_copier.close, wait=False)

        def deliver(host: list[torch.Tensor]) -> None:
            msg.x = host[0]
            self.sink.put((time.monotonic(), msg))

        self._host_copier.copy([msg.x], deliver)

    def _preview(self, msg: Activation, x0: torch.Tensor, steps_done: int) -> None:
        """The chunk's x0 estimate after ``steps_done`` steps (x - sigma_k v: flow matching's
        clean state; an x0 head's own output) to the sink, as a finished chunk goes."""
        flags = msg.flags & ~FLAG_PREVIEWS | FLAG_PREVIEW | steps_done << PREVIEW_STEPS_SHIFT
        preview = dataclasses.replace(msg, step=self.steps, block=0, flags=flags, x=x0, h=None)
        if self.placement.sink_rank == self.rank:
            self.sink.put((time.monotonic(), preview))
        else:
            self.transport.send(self.placement.sink_rank, preview)

    def _forward(self, msg: Activation, h: torch.Tensor, v: torch.Tensor | None) -> None:
        k, blk = msg.step, msg.block
        st = self._streams[msg.stream_id]
        if v is None:
            nxt = dataclasses.replace(msg, block=blk + 1, h=h)
        else:
            x = msg.x
            if not msg.is_context:  # Euler step; an observed chunk is never updated
                if msg.flags & FLAG_PREVIEWS and k + 1 < self.steps:
                    self._preview(msg, x - self.sigmas[k] * v, k + 1)
                x = x + (self.sigmas[k + 1] - self.sigmas[k]) * v
            # A clean-history context chunk only fills the (step-shared) caches at step 0.
            done = k + 1 == self.steps or (msg.is_context and st.history == "clean")
            nxt = dataclasses.replace(msg, step=self.steps if done else k + 1, block=0, x=x, h=None)
        if nxt.step == self.steps:
            dst = self.placement.sink_rank
        else:
            dst = st.layout_for(nxt.ticket)[nxt.step][nxt.block]
        if dst == self.rank:
            if nxt.step == self.steps:
                self._to_sink(nxt)
            else:
                self._enqueue(nxt)
        else:
            self.transport.send(dst, nxt)
