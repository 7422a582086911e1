"""``DistEngine``: the ``StreamEngine`` of rank 0, backed by every rank of the job.

Rank 0 runs, in its process: the engine ``Controller`` (numbers chunks, draws noise, releases
chunks into the pipeline, collects finished ones), its own ``StageHost`` worker in a thread,
and a monitor thread (heartbeats out, liveness in, worker ``error`` / ``bye`` messages). The
front end (physis-serve) calls the ``StreamEngine`` methods from its own thread.

Faults: a rank that says ``error``, leaves, fails a send, or is silent for
``fault_timeout_s`` is marked failed; every stream placed on it fails, and the next ``poll``
(or a ``submit_*`` on such a stream) raises ``StreamFailed`` naming the stream, the rank and
why (``err.stream_id``, ``err.rank``). Streams not placed on it keep running.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from physis_ros.engine.api import (
    AdmissionRefused,
    ChunkOutput,
    StreamFailed,
    StreamPromise,
    StreamSpec,
    check_rollouts,
)
from physis_ros.engine.checkpoints import summary
from physis_ros.engine.codec import check_stream_codec, make_codec
from physis_ros.engine.placement import Layout, Placement, validate_layout
from physis_ros.engine.prompts import (
    PromptBook,
    cond_to_json,
    goal_prompted,
    trained_empty_prompt,
)
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
from physis_ros.engine.ranks.runtime import (
    ECHO_STREAM_ID,
    RuntimeConfig,
    StageHost,
    blocks_for_rank,
    parse_placement,
)
from physis_ros.engine.ranks.transport import TorchDistTransport, check_shapes_agree
from physis_ros.engine.runtime import ChunkResult, Controller
from physis_ros.engine.sampler import (
    pack_chunk,
    request_actions,
    request_state,
    unpack_chunk,
    unpack_state,
)
from physis_ros.engine.transport import Activation
from physis_ros.memtune import freeze_startup_objects

log = logging.getLogger(__name__)
REPO_ROOT = Path(__file__).resolve().parents[2]


@dataclass
class _StreamInfo:
    spec: StreamSpec
    layout: Layout
    ranks: set[int]
    """Every rank the stream has been placed on (a placement change keeps the old ones:
    chunks released before it still pass them)."""
    history: str = "noisy"


def stream_failed(stream_id: int, rank: int, reason: str) -> StreamFailed:
    err = StreamFailed(f"stream {stream_id} failed: rank {rank} {reason}")
    err.stream_id = stream_id
    err.rank = rank
    return err


class DistEngine(PlacementControl):
    """Rank 0 of a torch.distributed job; the other ranks run ``runtime.run_worker_rank``.

    Placement by measured cost, loading blocks and moving running streams: ``PlacementControl``
    (dist/placement.py)."""

    def __init__(
        self, cfg: RuntimeConfig, ctx: RankContext, *, procs=None, prompts: tuple | list = ()
    ) -> None:
        """``prompts``: prompt-embedding files whose names streams may ask for (read here on
        rank 0 only: a stream's embedding travels to the ranks in its ``open`` message)."""
        if ctx.rank != 0:
            raise ValueError(f"DistEngine runs on rank 0, this is rank {ctx.rank}")
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
        self.model_cfg = cfg.model_config
        self.controller = Controller(self.host.model, cfg.sampler_config, self.transport.send)
        self.codec = make_codec(self.model_cfg, device=ctx.device)
        meta = self._checkpoint_meta()
        self.prompts = PromptBook(
            self.model_cfg,
            list(prompts),
            empty=None
            if cfg.resolved.weights is not None
            else trained_empty_prompt(self.model_cfg, meta),
            goal_prompts=goal_prompted(meta),
        )
        log.info(
            "\n%s",
            summary(cfg.resolved, cfg.sampler_config, cfg.torch_dtype, checkpoint=cfg.weights_path),
        )
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
        self._failed_streams: dict[int, StreamFailed] = {}
        self._unreported: list[StreamFailed] = []
        self._next_stream_id = 0
        self._block_ms: float | None = None
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
        self._threads = [
            threading.Thread(target=self._host_loop, name="rank0-worker", daemon=True),
            threading.Thread(target=self._monitor_loop, name="rank0-monitor", daemon=True),
        ]
        for thread in self._threads:
            thread.start()
        if cfg.placement == "balanced":
            try:
                self.default_layout = self.balanced_layout()
                self.load_blocks(self.default_layout)
            except BaseException:
                self.shutdown()
                raise
        freeze_startup_objects()

    def _checkpoint_meta(self) -> dict[str, str] | None:
        """A physis-train checkpoint's metadata (a Wan checkpoint's empty prompt is its text
        encoder's: a prompts file)."""
        if self.cfg.resolved.weights is not None or not self.cfg.weights_path:
            return None
        from physis_ros.weights import read_metadata

        return read_metadata(self.cfg.weights_path)

    @classmethod
    def launch_local(
        cls,
        cfg: RuntimeConfig,
        world_size: int,
        *,
        log_dir: str | None = None,
        prompts: tuple | list = (),
    ):
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
            engine = cls(cfg, ctx, procs=procs, prompts=prompts)
            engine.master_port = port
            return engine
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
                err = stream_failed(sid, rank, reason)
                self._failed_streams[sid] = err
                self._unreported.append(err)
                self._close_everywhere(sid)

    def impairment(self) -> str:
        """Why this engine cannot serve as configured ("" when it can): failed ranks."""
        with self._lock:
            if not self.failed_ranks:
                return ""
            return "; ".join(
                f"rank {r} failed: {why}" for r, why in sorted(self.failed_ranks.items())
            )

    # ---------------------------------------------------------------- StreamEngine
    def open_stream(
        self,
        spec: StreamSpec,
        *,
        layout: Layout | None = None,
        mode: str = "pipelined",
        max_in_flight: int = 0,
    ) -> StreamPromise:
        """Admit a stream with ``layout`` (default: the configured placement); ``mode`` and
        ``max_in_flight`` (0: no limit) as in the engine's ``Controller``; its horizon is
        ``spec.horizon`` (None: the configured one)."""
        check_stream_codec(spec, self.codec)
        K, L = self.cfg.steps, self.model_cfg.num_blocks
        if layout is None:
            layout = self.default_layout
        validate_layout(layout, K, L, self.world_size)
        cond = cond_to_json(self.prompts.resolve(spec.prompt, spec.prompt_embedding))
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
            sid = self._next_stream_id
            self._next_stream_id += 1
            horizon = self.cfg.horizon if spec.horizon is None else spec.horizon
            if horizon < 0:
                raise ValueError(f"horizon must be >= 0 (0: no limit), got {horizon}")
            check_rollouts(spec, horizon)
            body = {
                "stream_id": sid,
                "seed": spec.seed,
                "cond": cond,
                "layout": [list(row) for row in layout],
                "history": "clean" if mode == "sequential-clean" else "noisy",
                "horizon": horizon,
            }
            for r in range(1, self.world_size):
                if r not in self.failed_ranks:
                    self.transport.send_control(r, "open", body)
            self._host_control.put(("open", body))
            self.controller.open_stream(
                sid,
                seed=spec.seed,
                mode=mode,
                entry_rank=layout[0][0],
                max_in_flight=max_in_flight,
                horizon=horizon,
                previews=spec.previews,
            )
            self._streams[sid] = _StreamInfo(
                spec=spec, layout=layout, ranks=ranks, history=body["history"]
            )
        return self._promise(sid, layout, horizon, spec.rollouts)

    def _promise(self, sid: int, layout: Layout, horizon: int, rollouts: bool) -> StreamPromise:
        from physis_ros.engine.stage import measure_block_ms

        cfg, K, L = self.model_cfg, self.cfg.steps, self.model_cfg.num_blocks
        if self._block_ms is None:  # one middle block this rank holds, a full window
            block = sorted(self.host.blocks)[len(self.host.blocks) // 2]
            self._block_ms = measure_block_ms(
                self.host.model, [self.cfg.window], block=block, repeats=5, warmup=2
            )
        per_rank = Placement.uniform(layout, (sid,), num_workers=self.world_size)
        busiest = max(len(per_rank.stages_on(r)) for r in range(self.world_size))
        h, w = cfg.image_size
        return StreamPromise(
            stream_id=sid,
            model=cfg.name,
            steps=K,
            blocks=L,
            expected_interval_ms=busiest * self._block_ms,
            pipeline_depth=len(per_rank.virtual_ranks()),
            expected_response_latency_ms=K * L * self._block_ms,
            chunk_frames=cfg.frames_per_chunk,
            image_height=h,
            image_width=w,
            # a world model conditioned on actions takes them with its observations too
            action_horizon=cfg.action_horizon if cfg.action_mode != "none" else 0,
            action_dim=cfg.action_dim if cfg.action_mode != "none" else 0,
            horizon=horizon,
            action_mode=cfg.action_mode,
            rollouts=rollouts,
        )

    def _check_stream(self, stream_id: int) -> None:
        if stream_id in self._failed_streams:
            raise self._failed_streams[stream_id]
        if stream_id not in self._streams:
            raise ValueError(f"stream {stream_id} is not open")

    def _close_everywhere(self, stream_id: int) -> None:
        for r in range(1, self.world_size):
            if r not in self.failed_ranks and r not in self._byes:
                self.transport.send_control(r, "close", {"stream_id": stream_id})
        self._host_control.put(("close", stream_id))
        self.controller.close_stream(stream_id)
        self._streams.pop(stream_id, None)
        self.codec.close(stream_id)

    def close_stream(self, stream_id: int) -> None:
        with self._lock:
            if stream_id in self._streams:
                self._close_everywhere(stream_id)
            self._failed_streams.pop(stream_id, None)

    def submit_context_x(self, stream_id: int, x: torch.Tensor, *, slot: int | None = None) -> int:
        """Queue an already encoded observation (packed state [X]) of ``slot`` (None: the
        next new one); returns its slot."""
        with self._lock:
            self._check_stream(stream_id)
            c = self.controller.submit_context(stream_id, x, slot=slot)
            self.controller.pump()
            return c

    def submit_context(
        self,
        stream_id: int,
        frames: np.ndarray,
        actions: np.ndarray | None = None,
        state: np.ndarray | None = None,
        *,
        slot: int | None = None,
    ) -> int:
        """Encode an observation with the codec and queue it as slot ``slot``'s context."""
        cfg = self.model_cfg
        latent = self.codec.encode(frames, stream_id=stream_id)
        x = pack_chunk(
            cfg,
            latent.cpu(),
            request_actions(cfg, actions, context=True),
            request_state(cfg, state),
        )
        chunk = self.submit_context_x(stream_id, x, slot=slot)
        self.codec.observed(stream_id, chunk, latent)
        return chunk

    def submit_generate(
        self, stream_id: int, actions: np.ndarray | None = None, *, slot: int | None = None
    ) -> int:
        act = request_actions(self.model_cfg, actions, context=False)
        with self._lock:
            self._check_stream(stream_id)
            c = self.controller.submit_generate(stream_id, act, slot=slot)
            self.controller.pump()
            return c

    def poll_results(self, timeout_s: float) -> list[ChunkResult]:
        """Finished generated chunks as packed states, in per-stream chunk order. Raises
        ``StreamFailed`` (once per failed stream) when nothing else is ready."""
        arrived = self.transport.recv_sink(timeout_s)
        with self._lock:
            out = []
            for left_s, act in arrived:
                res = self.controller.finished(left_s, act)
                if res is not None:
                    out.append(res)
            self.controller.pump()
            if not out and self._unreported:
                raise self._unreported.pop(0)
        # per stream in release order (anchor, then slot), a chunk's previews (by step)
        # before the chunk itself
        out.sort(
            key=lambda r: (r.stream_id, r.anchor, r.chunk, r.preview_steps == 0, r.preview_steps)
        )
        return out

    def poll(self, timeout_s: float) -> list[ChunkOutput]:
        outputs = []
        predict = self.model_cfg.action_mode == "predict"
        for res in self.poll_results(timeout_s):
            x = res.x.float().cpu()
            latent, actions = unpack_chunk(self.model_cfg, x)
            state = unpack_state(self.model_cfg, x)
            outputs.append(
                ChunkOutput(
                    stream_id=res.stream_id,
                    chunk=res.chunk,
                    frames=self.codec.decode(latent, stream_id=res.stream_id, chunk=res.chunk),
                    actions=actions.numpy().copy() if predict else None,
                    state=None if state is None else state.numpy().copy(),
                    entered_s=res.created_s,
                    left_s=res.left_s,
                    decoded_s=time.monotonic(),
                    finite=bool(torch.isfinite(x).all()),
                    anchor=res.anchor,
                    preview_steps=res.preview_steps,
                )
            )
        return outputs

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

    def failed_streams(self) -> dict[int, str]:
        with self._lock:
            return {sid: str(err) for sid, err in self._failed_streams.items()}

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
        for thread in self._threads:
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

    def __enter__(self) -> DistEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
