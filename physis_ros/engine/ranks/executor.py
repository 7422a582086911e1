"""``RankExecutor``: the executor of a torch.distributed job, on rank 0.

Rank 0 runs, in its process: its own ``StageHost`` worker in a thread and a monitor thread
(heartbeats out, liveness in, worker ``error`` / ``bye`` messages); the engine core over it
(``ranks_engine``) releases chunks through the transport and collects them at rank 0's sink.
The other ranks run ``runtime.run_worker_rank``.

Faults: a rank that says ``error``, leaves, fails a send, or is silent for
``fault_timeout_s`` is marked failed; every stream placed on it fails (closed on the live
ranks, handed to the core by ``take_stream_failures``: a ``StreamFailed`` naming the stream,
the rank and why, ``err.stream_id`` and ``err.rank``). Streams not placed on it keep running.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from physis_ros.contract.safetensors import read_metadata
from physis_ros.engine.api import AdmissionRefused, StreamFailed
from physis_ros.engine.assembly import contract_of, log_summary, prompt_book
from physis_ros.engine.core import EngineCore
from physis_ros.engine.executor import StreamOrder
from physis_ros.engine.pipeline import Pipeline
from physis_ros.engine.placement import Layout, validate_layout
from physis_ros.engine.prompts import cond_to_json
from physis_ros.engine.ranks.config import RuntimeConfig, blocks_for_rank, parse_placement
from physis_ros.engine.ranks.framing import check_shapes_agree
from physis_ros.engine.ranks.launch import (
    RankContext,
    as_rank,
    broadcast_text,
    free_port,
    init_from_env,
    spawn_ranks,
    stop_ranks,
)
from physis_ros.engine.ranks.placement import PlacementControl
from physis_ros.engine.ranks.runtime import ECHO_STREAM_ID, StageHost
from physis_ros.engine.ranks.transport import TorchDistTransport
from physis_ros.engine.transport import Activation
from physis_ros.memtune import freeze_startup_objects

log = logging.getLogger(__name__)
REPO_ROOT = Path(__file__).resolve().parents[3]


@dataclass
class _StreamInfo:
    layout: Layout
    ranks: set[int]
    """Every rank the stream has been placed on (a placement change keeps the old ones:
    chunks released before it still pass them)."""


def stream_failed(stream_id: int, rank: int, reason: str) -> StreamFailed:
    err = StreamFailed(f"stream {stream_id} failed: rank {rank} {reason}")
    err.stream_id = stream_id
    err.rank = rank
    return err


class RankExecutor(PlacementControl):
    """Rank 0 of a torch.distributed job; the other ranks run ``runtime.run_worker_rank``.

    Placement by measured cost, loading blocks and moving running streams: ``PlacementControl``
    (ranks/placement.py)."""

    def __init__(self, cfg: RuntimeConfig, ctx: RankContext, *, procs=None) -> None:
        if ctx.rank != 0:
            raise ValueError(f"the rank executor runs on rank 0, this is rank {ctx.rank}")
        self.cfg = cfg
        self.ctx = ctx
        self.procs = list(procs or [])
        self.master_port: int | None = None
        """The rendezvous store's port when ``launch_local`` chose it."""
        self.world_size = ctx.world_size
        self.transport = TorchDistTransport(shapes=cfg.shapes(), device=ctx.device)
        check_shapes_agree(
            cfg.shapes(), ctx.device if ctx.backend == "nccl" else torch.device("cpu")
        )
        self.host = StageHost(cfg, ctx, self.transport, blocks_for_rank(cfg, 0, ctx.world_size))
        self.model = self.host.model
        self.model_cfg = cfg.model_config
        self._lock = threading.RLock()
        self._host_control: queue.SimpleQueue = queue.SimpleQueue()
        self._stop = threading.Event()
        self._shutting_down = False
        self.rank_blocks: dict[int, set[int]] = {0: set(self.host.blocks)}
        self.failed_ranks: dict[int, str] = {}
        self.rank_stats: dict[int, dict] = {}
        """Per worker rank, what it reported when it left (tasks, busy_s, cpu_s, drops)."""
        self._byes: set[int] = set()
        self._streams: dict[int, _StreamInfo] = {}
        self._lost: list[StreamFailed] = []
        """Streams failed with a rank, not yet taken by the core."""
        self._replies: queue.SimpleQueue = queue.SimpleQueue()
        """``costs`` / ``loaded`` / ``usage_report`` answers of worker ranks (the monitor
        routes them here); ``_ask_lock`` lets one caller at a time wait for them."""
        self._ask_lock = threading.Lock()
        K, L = cfg.steps, self.model_cfg.num_blocks
        self.default_layout: Layout = parse_placement(cfg.placement, K, L, self.world_size)
        """Layout of a stream opened without one (``balanced``: computed at start-up)."""
        self.measured_block_ms: dict[int, float] = {}
        """Per-block cost (ms, median over the ranks that measured it), if measured."""
        self._wait_ready()
        self.threads = [
            threading.Thread(target=self._host_loop, name="rank0-worker", daemon=True),
            threading.Thread(target=self._monitor_loop, name="rank0-monitor", daemon=True),
        ]
        for thread in self.threads:
            thread.start()
        if cfg.placement == "balanced":
            try:
                self.default_layout = self.balanced_layout()
                self.load_blocks(self.default_layout)
            except BaseException:
                self.shutdown()
                raise
        freeze_startup_objects()

    @classmethod
    def launch_local(
        cls,
        cfg: RuntimeConfig,
        world_size: int,
        *,
        log_dir: str | None = None,
    ) -> RankExecutor:
        """Start ranks 1..N-1 as child processes on this machine and become rank 0."""
        port = free_port()
        env = {
            "PYTHONPATH": os.pathsep.join(
                filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])
            ),
            "OMP_NUM_THREADS": str(cfg.threads),
        }
        # Only how to join travels as flags; the config itself follows as JSON (broadcast).
        argv = ["-m", "physis_ros.engine.ranks.runtime", "--device", cfg.device]
        argv += ["--comm-timeout-s", str(cfg.comm_timeout_s)]
        procs = spawn_ranks(
            world_size=world_size, master_port=port, argv=argv, extra_env=env, log_dir=log_dir
        )
        try:
            with as_rank(rank=0, world_size=world_size, master_port=port):
                ctx = init_from_env(device=cfg.device, comm_timeout_s=cfg.comm_timeout_s)
            broadcast_text(ctx, cfg.to_json())
            executor = cls(cfg, ctx, procs=procs)
            executor.master_port = port
            return executor
        except BaseException:
            stop_ranks(procs, timeout_s=0.0)
            if dist.is_initialized():
                dist.destroy_process_group()
            raise

    # ---------------------------------------------------------------- start-up
    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.cfg.startup_timeout_s
        waiting = set(range(1, self.world_size))
        while waiting:
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"ranks {sorted(waiting)} not ready after {self.cfg.startup_timeout_s} s"
                )
            for ctl in self.transport.recv_control(timeout_s=0.1):
                if ctl.kind == "ready":
                    self.rank_blocks[ctl.src] = set(ctl.body["blocks"])
                    waiting.discard(ctl.src)
                elif ctl.kind in ("error", "bye"):
                    raise RuntimeError(f"rank {ctl.src} failed at start-up: {ctl.body}")
            for proc in self.procs:
                if proc.poll() is not None:
                    raise RuntimeError(f"a rank exited at start-up with code {proc.returncode}")

    # ---------------------------------------------------------------- threads
    def _host_loop(self) -> None:
        try:
            while not self._stop.is_set():
                while True:
                    try:
                        kind, arg = self._host_control.get_nowait()
                    except queue.Empty:
                        break
                    if kind == "open":
                        self.host.open_stream(arg)
                    elif kind == "relayout":
                        self.host.relayout(arg)
                    elif kind == "close":
                        self.host.close_stream(arg)
                    elif kind == "usage":
                        _, reply = arg
                        reply.put(self.host.usage())
                    elif kind == "measure":
                        repeats, reply = arg
                        reply.put(self.host.measure_block_ms(repeats))
                    elif kind == "load":
                        blocks, reply = arg
                        self.host.ensure_blocks(blocks)
                        reply.put(set(self.host.blocks))
                self.host.run_once(self.cfg.poll_interval_s)
                while not self.host.worker.sink.empty():
                    self.transport.put_sink(*self.host.worker.sink.get())
        except Exception as exc:  # rank 0's own worker died: its streams fail, loudly
            log.exception("rank 0 worker failed")
            self._fail_rank(0, f"worker error: {type(exc).__name__}: {exc}")

    def _monitor_loop(self) -> None:
        interval = self.cfg.heartbeat_interval_s
        while not self._stop.wait(interval):
            for rank in range(1, self.world_size):
                if self._shutting_down:
                    break  # after ``shutdown`` a worker's receive thread takes nothing more
                if rank not in self.failed_ranks and rank not in self._byes:
                    self.transport.send_heartbeat(rank)
            for ctl in self.transport.recv_control():
                if ctl.kind == "error":
                    self._fail_rank(ctl.src, f"reported an error: {ctl.body.get('error')}")
                elif ctl.kind == "bye":
                    self._byes.add(ctl.src)
                    self.rank_stats[ctl.src] = ctl.body.get("stats", {})
                    if not self._shutting_down:
                        self._fail_rank(ctl.src, f"left the job ({ctl.body.get('reason')})")
                elif ctl.kind in ("costs", "loaded", "usage_report"):
                    self._replies.put(ctl)
                elif ctl.kind == "recv_stopped" and not self._shutting_down:
                    log.warning("rank 0 receive loop stopped: %s", ctl.body)
            for rank, reason in self.transport.failed_peers().items():
                self._fail_rank(rank, reason)
            for rank in range(1, self.world_size):
                silent_s = self.transport.seconds_since_heard(rank)
                if silent_s > self.cfg.fault_timeout_s and rank not in self._byes:
                    self._fail_rank(
                        rank,
                        f"silent for {silent_s:.1f} s (dead or hung; "
                        f"fault_timeout_s={self.cfg.fault_timeout_s})",
                    )

    def _fail_rank(self, rank: int, reason: str) -> None:
        with self._lock:
            if rank in self.failed_ranks:
                return
            self.failed_ranks[rank] = reason
            log.error("rank %d failed: %s", rank, reason)
            for sid in [s for s, info in self._streams.items() if rank in info.ranks]:
                self._lost.append(stream_failed(sid, rank, reason))
                self.close_stream(sid)

    def impairment(self) -> str:
        """Why this engine cannot serve as configured ("" when it can): failed ranks."""
        with self._lock:
            if not self.failed_ranks:
                return ""
            return "; ".join(
                f"rank {r} failed: {why}" for r, why in sorted(self.failed_ranks.items())
            )

    # ---------------------------------------------------------------- Executor
    @property
    def num_workers(self) -> int:
        return self.world_size

    def check_layout(self, layout: Layout) -> None:
        """Refuse a layout that names a failed rank or a rank without the blocks it needs."""
        validate_layout(layout, self.cfg.steps, self.model_cfg.num_blocks, self.world_size)
        ranks = {r for row in layout for r in row}
        with self._lock:
            dead = sorted(ranks & set(self.failed_ranks))
            if dead:
                raise AdmissionRefused(
                    f"ranks {dead} have failed: {self.failed_ranks[dead[0]]}",
                    resource="ranks",
                    shortfall=f"{len(dead)} rank(s)",
                )
            for r in ranks:
                needed = {blk for row in layout for blk, rr in enumerate(row) if rr == r}
                if not needed <= self.rank_blocks[r]:
                    raise AdmissionRefused(
                        f"rank {r} does not hold blocks {sorted(needed - self.rank_blocks[r])} "
                        f"(loaded for placement {self.cfg.placement!r})",
                        resource=f"weights on rank {r}",
                        shortfall=f"{len(needed - self.rank_blocks[r])} blocks",
                    )

    def open_stream(self, order: StreamOrder) -> None:
        self.check_layout(order.layout)
        body = {
            "stream_id": order.stream_id,
            "seed": order.seed,
            "cond": cond_to_json(order.cond),
            "layout": [list(row) for row in order.layout],
            "history": order.history,
            "horizon": order.horizon,
        }
        with self._lock:
            for r in range(1, self.world_size):
                if r not in self.failed_ranks:
                    self.transport.send_control(r, "open", body)
            self._host_control.put(("open", body))
            ranks = {r for row in order.layout for r in row}
            self._streams[order.stream_id] = _StreamInfo(layout=order.layout, ranks=ranks)

    def close_stream(self, stream_id: int) -> None:
        with self._lock:
            if self._streams.pop(stream_id, None) is None:
                return
            for r in range(1, self.world_size):
                if r not in self.failed_ranks and r not in self._byes:
                    self.transport.send_control(r, "close", {"stream_id": stream_id})
            self._host_control.put(("close", stream_id))

    def relayout(self, stream_id: int, *, epoch: int, first_ticket: int, layout: Layout) -> None:
        """Ranks learn of the change by a control message each and hold chunks of the new
        epoch until theirs arrives; each moved stage's KV ring goes from its old owner to its
        new one after the last chunk of the old epoch ran there (engine/worker.py)."""
        body = {
            "stream_id": stream_id,
            "epoch": epoch,
            "first_ticket": first_ticket,
            "layout": [list(row) for row in layout],
        }
        with self._lock:
            for r in range(1, self.world_size):
                if r not in self.failed_ranks and r not in self._byes:
                    self.transport.send_control(r, "relayout", body)
            self._host_control.put(("relayout", body))
            info = self._streams[stream_id]
            info.ranks |= {r for row in layout for r in row}
            info.layout = layout

    def send(self, dst: int, act: Activation) -> None:
        self.transport.send(dst, act)

    def collect(self, timeout_s: float) -> list[tuple[float, Activation]]:
        return self.transport.recv_sink(timeout_s)

    def failure(self) -> BaseException | None:
        return None  # a rank's failure takes the streams placed on it, not every stream

    def take_stream_failures(self) -> list[StreamFailed]:
        with self._lock:
            lost, self._lost = self._lost, []
        return lost

    def measure_hop_ms(self, peer: int = 1, rounds: int = 30, warmup: int = 5) -> list[float]:
        """One activation hop (x and h of this model) rank 0 -> ``peer``, measured as half
        the round trip through the transports and ``peer``'s worker loop (which echoes
        ``ECHO_STREAM_ID``). Call while no stream is running."""
        cfg = self.model_cfg
        dev, dtype = self.ctx.device, self.cfg.torch_dtype
        x = torch.zeros(self.transport.shapes.x_numel, device=dev)
        h = torch.zeros(cfg.tokens_per_chunk, cfg.dim, device=dev, dtype=dtype)
        out = []
        for i in range(warmup + rounds):
            t0 = time.perf_counter()
            self.transport.send(peer, Activation(ECHO_STREAM_ID, i, 0, 1, 0, x, h))
            got = []
            while not got:
                arrived = self.transport.recv_sink(1.0)
                got = [a for _, a in arrived if a.stream_id == ECHO_STREAM_ID]
                if not got and time.perf_counter() - t0 > self.cfg.fault_timeout_s:
                    raise TimeoutError(f"rank {peer} did not echo in {self.cfg.fault_timeout_s} s")
            if i >= warmup:
                out.append((time.perf_counter() - t0) * 1e3 / 2)
        return out

    def stats(self) -> dict:
        return {
            "ranks": self.world_size,
            "backend": self.ctx.backend,
            "failed_ranks": dict(self.failed_ranks),
            "transport": dict(self.transport.counters),
            "worker_drops": dict(self.host.worker.stats.drops),
            "default_layout": [list(row) for row in self.default_layout],
            "measured_block_ms": dict(self.measured_block_ms),
        }

    def shutdown(self) -> None:
        """Tell every rank to stop, wait for their goodbyes, leave the group, reap children."""
        if self._stop.is_set():
            return
        self._shutting_down = True
        # Every rank whose process may still run gets "shutdown", also one that already said
        # "bye" (on its own SIGTERM it waits for this message to end its receive thread).
        reachable = [
            r
            for r in range(1, self.world_size)
            if r not in self.transport.failed_peers()
            and self.transport.seconds_since_heard(r) < self.cfg.fault_timeout_s
        ]
        waiting = [r for r in reachable if r not in self.transport.byes_from()]
        self.transport.expect_final_byes(waiting)
        for r in reachable:
            self.transport.send_control(r, "shutdown")
        deadline = time.monotonic() + self.cfg.fault_timeout_s
        while (
            any(r not in self.transport.byes_from() for r in waiting)
            and time.monotonic() < deadline
        ):
            time.sleep(0.01)
        self._stop.set()
        for thread in self.threads:
            thread.join(timeout=5.0)
        self.host.worker.close()  # its host copier's thread (a CUDA sink)
        for ctl in self.transport.recv_control():  # goodbyes the monitor did not read
            if ctl.kind == "bye":
                self.rank_stats[ctl.src] = ctl.body.get("stats", {})
        ws = self.host.worker.stats
        self.rank_stats[0] = {
            "cpu_s": time.process_time(),
            "tasks": ws.tasks,
            "batches": ws.batches,
            "mixed_batches": ws.mixed_batches,
            "busy_s": ws.busy_s,
            "rings_sent": ws.rings_sent,
            "rings_installed": ws.rings_installed,
            "transport": dict(self.transport.counters),
        }
        self.transport.close(flush_timeout_s=1.0)
        if waiting and not self.transport.join_recv(timeout_s=self.cfg.fault_timeout_s):
            log.warning("rank 0: a receive is still posted (no rank left to answer it)")
        dist.destroy_process_group()
        if self.procs:
            stop_ranks(self.procs, timeout_s=self.cfg.fault_timeout_s)


def ranks_engine(
    cfg: RuntimeConfig,
    ctx: RankContext | None = None,
    *,
    world_size: int = 0,
    procs=None,
    prompts: tuple | list = (),
    mode: str = "pipelined",
    max_streams: int = 1_000_000,
    log_dir: str | None = None,
) -> EngineCore:
    """The engine core over every rank of the job: rank 0 of a job already joined (``ctx``,
    e.g. under torchrun), or of ``world_size`` ranks started here as child processes.
    ``prompts``: prompt-embedding files whose names streams may ask for (read on rank 0
    only: a stream's embedding travels to the ranks in its ``open`` message)."""
    if ctx is None:
        executor = RankExecutor.launch_local(cfg, world_size, log_dir=log_dir)
    else:
        executor = RankExecutor(cfg, ctx, procs=procs)
    try:
        resolved = cfg.resolved
        meta = None
        if resolved.weights is None and cfg.weights_path:
            meta = read_metadata(cfg.weights_path)  # its empty prompt is the trained one
        book = prompt_book(resolved, files=prompts, checkpoint_meta=meta)
        pipeline = Pipeline(executor, cfg.sampler_config)
        log_summary(resolved, pipeline, cfg.weights_path)
        return EngineCore(
            pipeline,
            prompts=book,
            mode=mode,
            horizon=cfg.horizon,
            max_streams=max_streams,
            contract=contract_of(meta),
        )
    except BaseException:
        executor.shutdown()
        raise
