"""The per-rank runtime: configuration, the worker loop of ranks 1..N-1, control, shutdown.

Every rank runs one engine ``Worker`` (``StageHost`` below) on its device over a
``TorchDistTransport``. Rank 0 is also the controller (``physis_ros.engine.ranks.engine``):
it places streams and sends control messages; the other ranks run ``run_worker_rank``:

    loop: apply control messages -> worker.run_once(poll_interval_s) -> heartbeat to rank 0

Control messages (JSON on the p2p channel, kind -> body):
  rank 0 -> worker: ``open`` {stream_id, seed, cond (prompt embedding, prompts.cond_to_json),
                    layout, history, horizon}, ``close`` {stream_id},
                    ``measure`` {repeats} (time each held block), ``load`` {blocks} (build or
                    load the weights of more blocks), ``relayout`` {stream_id, epoch,
                    first_ticket, layout} (see engine/worker.py), ``usage`` {},
                    ``shutdown`` {}
  worker -> rank 0: ``ready`` {rank, blocks}, ``costs`` {rank, block_ms}, ``loaded`` {rank,
                    blocks}, ``usage_report`` {rank, cpu_s, busy_s, tasks, batches},
                    ``error`` {rank, error}, ``bye`` {rank, reason}
No barrier on the data path: an activation that reaches a worker before its stream's
``open`` (it came from another rank) waits in ``StageHost`` until the ``open`` arrives.

Faults: a worker exits (code 3) when it hears nothing from rank 0 for ``fault_timeout_s``;
rank 0 detects a silent worker the same way (see dist/engine.py). SIGINT/SIGTERM end the loop,
say ``bye`` and leave the process group.

Run as ``python -m physis_ros.engine.ranks.runtime [flags]`` under the torchrun environment (the
programmatic launcher ``launch.spawn_ranks`` sets the same variables).
"""

from __future__ import annotations

import argparse
import dataclasses
import faulthandler
import functools
import gc
import json
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from physis_ros.engine.checkpoints import ResolvedModel, load_weights, resolve_model
from physis_ros.engine.config import ModelConfig, SamplerConfig, model_config_from_json
from physis_ros.engine.placement import (
    Layout,
    layout_even,
    layout_groups,
    layout_one_stage_per_worker,
    layout_single,
    validate_layout,
)
from physis_ros.engine.prompts import cond_from_json
from physis_ros.engine.ranks.launch import RankContext, init_from_env, tie_to_parent
from physis_ros.engine.ranks.transport import (
    ActivationShapes,
    TorchDistTransport,
    check_shapes_agree,
)
from physis_ros.memtune import freeze_startup_objects

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
EXIT_CONTROLLER_LOST = 3
ECHO_STREAM_ID = -1
"""Activations of this stream id are sent straight back to rank 0's sink (hop timing)."""


@dataclass(frozen=True, kw_only=True)
class RuntimeConfig:
    """What every rank must agree on (rank 0 sends it to the others as JSON, ``to_json``)."""

    model: str = "tiny"
    """Model preset name (``physis_ros.engine.config.PRESETS``) or model directory (upstream
    Wan or diffusers; ``engine.checkpoints``): every rank must see it at the same path."""
    latent_frames: int = 0
    """Latent frames per chunk of a model directory (0: its default)."""
    resolution: str = ""
    """Camera image ``HxW`` of a model directory ("": its default)."""
    vae: str = ""
    """diffusers AutoencoderKLWan directory: the real codec ("": the preset's or a stand-in)."""
    variant: str = ""
    """Which weight variant of a model directory loads ("": the one ``dtype`` names, else the
    files without one: ``engine.weight_files``)."""
    resolved_config: ModelConfig | None = None
    """The model's full config as rank 0 resolved it (a serving spec's); None: resolved here
    from ``model``."""
    steps: int = 4
    """K: denoising steps."""
    window: int = 2
    """W: history window in chunks."""
    shift: float = 5.0
    """Schedule shift."""
    context_noise: str = "clean"
    """How observations enter the history (``SamplerConfig.context_noise``), as trained."""
    horizon: int = 0
    """Chunks ahead of its newest observation a stream generates unless it asks otherwise
    (0: no limit, offline generation: observations only take new slots)."""
    weights_seed: int = 0
    """Random-init seed of the weights (when ``weights_path`` is empty)."""
    weights_path: str = ""
    """Safetensors checkpoint with upstream key names; empty: random weights."""
    dtype: str = "float32"
    """Compute dtype: float32 or bfloat16."""
    device: str = "auto"
    """``auto`` (cuda:LOCAL_RANK if CUDA exists, else cpu), ``cpu`` or ``cuda``."""
    placement: str = "even"
    """Default layout of a stream over the ranks: ``even``, ``single``, ``one-stage``,
    ``groups:a,b,...`` (contiguous groups of a, b, ... stages in pipeline order), or
    ``balanced`` (contiguous groups balanced by per-block costs measured on the ranks at
    start-up; ranks load the blocks it needs)."""
    batching: bool = True
    """Batch ready tasks that share block weights."""
    threads: int = 1
    """torch intra-op threads per rank."""
    heartbeat_interval_s: float = 0.25
    """How often every rank tells rank 0 it is alive (and rank 0 tells every rank)."""
    fault_timeout_s: float = 5.0
    """A rank silent for this long is dead or hung: its streams fail."""
    comm_timeout_s: float = 60.0
    """torch.distributed process-group timeout: no wait lasts longer."""
    startup_timeout_s: float = 120.0
    """Time for every rank to load weights and report ready."""
    poll_interval_s: float = 0.002
    """Longest a worker waits for an activation before checking control and heartbeats."""

    def __post_init__(self) -> None:
        if self.resolved_config is None:
            # raises ValueError naming an unknown preset or what is wrong with a directory
            _ = self.resolved
        SamplerConfig(
            steps=self.steps,
            window=self.window,
            shift=self.shift,
            context_noise=self.context_noise,
        )
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype {self.dtype!r} is not one of {sorted(DTYPES)}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device {self.device!r} is not auto, cpu or cuda")
        if self.horizon < 0:
            raise ValueError(f"horizon must be >= 0 (0: no limit), got {self.horizon}")
        if self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads}")
        for name in (
            "heartbeat_interval_s",
            "fault_timeout_s",
            "comm_timeout_s",
            "poll_interval_s",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.fault_timeout_s <= 2 * self.heartbeat_interval_s:
            raise ValueError(
                f"fault_timeout_s {self.fault_timeout_s} must exceed two heartbeats "
                f"({2 * self.heartbeat_interval_s} s)"
            )
        if self.comm_timeout_s <= self.fault_timeout_s:
            raise ValueError(
                f"comm_timeout_s {self.comm_timeout_s} must exceed fault_timeout_s "
                f"{self.fault_timeout_s} so faults are reported before waits give up"
            )
        check_placement_spec(self.placement)

    @property
    def resolved(self) -> ResolvedModel:
        files = (self.variant, self.dtype)
        return _resolve(self.model, self.latent_frames, self.resolution, self.vae, *files)

    @property
    def model_config(self) -> ModelConfig:
        if self.resolved_config is not None:
            return self.resolved_config
        return self.resolved.cfg

    @property
    def sampler_config(self) -> SamplerConfig:
        return SamplerConfig(
            steps=self.steps,
            window=self.window,
            shift=self.shift,
            context_noise=self.context_noise,
        )

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    def shapes(self) -> ActivationShapes:
        from physis_ros.engine.sampler import chunk_numel

        cfg = self.model_config
        return ActivationShapes(
            x_numel=chunk_numel(cfg),
            h_tokens=cfg.tokens_per_chunk,
            h_dim=cfg.dim,
            h_dtype=self.torch_dtype,
            steps=self.steps,
        )

    def to_json(self) -> str:
        """JSON text that ``from_json`` rebuilds this config from (the model's config in full)."""
        out = dataclasses.asdict(self)
        out["resolved_config"] = dataclasses.asdict(self.model_config)
        return json.dumps(out, sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes) -> RuntimeConfig:
        try:
            values = json.loads(text)
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise ValueError(f"runtime config is not JSON: {err}") from None
        known = {f.name for f in dataclasses.fields(cls)}
        if not isinstance(values, dict) or set(values) != known:
            raise ValueError("runtime config JSON does not have this runtime's fields")
        values["resolved_config"] = model_config_from_json(values["resolved_config"])
        return cls(**values)


@functools.lru_cache(maxsize=4)
def _resolve(  # noqa: PLR0917 - cached by its arguments
    model: str, latent_frames: int, resolution: str, vae: str, variant: str, dtype: str
) -> ResolvedModel:
    # a model directory's headers are read once per process, not on every model_config
    layout = {"latent_frames": latent_frames, "resolution": resolution, "vae": vae}
    return resolve_model(model, **layout, variant=variant, dtype=dtype)


def _group_sizes(spec: str) -> list[int]:
    try:
        sizes = [int(s) for s in spec[len("groups:") :].split(",")]
    except ValueError:
        raise ValueError(f"placement {spec!r}: groups must be integers, e.g. groups:3,5") from None
    if any(size < 1 for size in sizes):
        raise ValueError(f"placement {spec!r}: every group needs at least one stage")
    return sizes


def check_placement_spec(spec: str) -> None:
    """Raise ValueError naming ``spec`` unless it is a placement name this runtime knows."""
    if spec.startswith("groups:"):
        _group_sizes(spec)
    elif spec not in ("even", "single", "one-stage", "balanced"):
        raise ValueError(
            f"placement {spec!r} is not even, single, one-stage, balanced or groups:a,b,..."
        )


def parse_placement(spec: str, steps: int, blocks: int, workers: int) -> Layout:
    """The layout named by ``spec`` (see ``RuntimeConfig.placement``) over ``workers`` ranks
    (``balanced`` before its costs are measured: ``even``, whose blocks ranks load first)."""
    check_placement_spec(spec)
    if spec == "single":
        return layout_single(steps, blocks)
    if spec in ("even", "balanced"):
        return layout_even(steps, blocks, workers)
    if spec == "one-stage":
        layout = layout_one_stage_per_worker(steps, blocks)
        validate_layout(layout, steps, blocks, workers)
        return layout
    sizes = _group_sizes(spec)
    if len(sizes) > workers:
        raise ValueError(f"placement {spec!r} needs {len(sizes)} ranks, the job has {workers}")
    return layout_groups(steps, blocks, sizes)


class StageHost:
    """One rank's engine worker, plus what the runtime adds around it: streams opened and
    closed by control messages, and activations held back until their stream is open.

    The engine ``Worker`` pulls from ``self`` as its transport (``recv``), so activations of
    streams this rank does not know yet are held here, and those of closed streams dropped
    (counted)."""

    def __init__(
        self, cfg: RuntimeConfig, ctx: RankContext, transport: TorchDistTransport, blocks: set[int]
    ) -> None:
        from physis_ros.engine.build import build_model
        from physis_ros.engine.placement import Placement
        from physis_ros.engine.worker import Worker

        self.cfg = cfg
        self.rank = ctx.rank
        self.world_size = ctx.world_size
        self.transport = transport
        self.blocks = set(blocks)
        self.model = build_model(
            cfg.model_config,
            seed=self._init_seed(),
            device=ctx.device,
            dtype=cfg.torch_dtype,
            block_ids=self.blocks,
        )
        self._load_weights()
        self.open_streams: set[int] = set()
        self.closed_streams: set[int] = set()
        self._held: list = []
        self.dropped: dict[str, int] = {}
        # Streams arrive later with their own layouts; finished chunks go to rank 0.
        placement = Placement(
            steps=cfg.steps,
            blocks=cfg.model_config.num_blocks,
            num_workers=ctx.world_size,
            layouts={},
            sink_rank=0,
        )
        self.worker = Worker(self.model, cfg.sampler_config, self, placement, batching=cfg.batching)

    def _init_seed(self) -> int | None:
        # a model directory's weights are loaded next: build on the device, unseeded
        return None if self.cfg.resolved.weights is not None else self.cfg.weights_seed

    def _load_weights(self) -> None:
        weights = self.cfg.resolved.weights
        if weights is not None:
            if self.cfg.weights_path:
                raise ValueError(f"model {self.cfg.model} is a directory: drop weights_path")
            load_weights(self.model, weights)
        elif self.cfg.weights_path:
            self.model.load_safetensors(self.cfg.weights_path)

    # Transport interface seen by the engine Worker --------------------------------------
    def send(self, dst: int, msg) -> None:
        self.transport.send(dst, msg)

    def recv(self, timeout_s: float) -> list:
        out = []
        held, self._held = self._held, []
        for msg in held + self.transport.recv(timeout_s if not held else 0.0):
            if msg.stream_id == ECHO_STREAM_ID:
                msg.step = self.cfg.steps  # to rank 0's sink, untouched
                self.transport.send(0, msg)
            elif msg.stream_id in self.open_streams:
                out.append(msg)
            elif msg.stream_id in self.closed_streams:
                self.dropped["closed_stream"] = self.dropped.get("closed_stream", 0) + 1
            else:
                self._held.append(msg)
        return out

    # Control --------------------------------------------------------------------------------
    def open_stream(self, body: dict) -> None:
        stream_id = int(body["stream_id"])
        layout: Layout = tuple(tuple(int(r) for r in row) for row in body["layout"])
        needed = {blk for row in layout for blk, r in enumerate(row) if r == self.rank}
        missing = needed - self.blocks
        if missing:
            raise ValueError(f"rank {self.rank} does not hold blocks {sorted(missing)}")
        self.worker.open_stream(
            stream_id,
            layout=layout,
            cond=cond_from_json(body["cond"]),
            history=str(body.get("history", "noisy")),
            seed=int(body.get("seed", 0)),
            horizon=int(body.get("horizon", 0)),
        )
        self.closed_streams.discard(stream_id)
        self.open_streams.add(stream_id)

    def relayout(self, body: dict) -> None:
        stream_id = int(body["stream_id"])
        if stream_id not in self.open_streams:
            return  # closed meanwhile (close and relayout crossed)
        layout: Layout = tuple(tuple(int(r) for r in row) for row in body["layout"])
        self.worker.relayout(
            stream_id,
            epoch=int(body["epoch"]),
            first_ticket=int(body["first_ticket"]),
            layout=layout,
        )

    def close_stream(self, stream_id: int) -> None:
        if stream_id in self.open_streams:
            self.worker.close_stream(stream_id)
        self.open_streams.discard(stream_id)
        self.closed_streams.add(stream_id)
        self._held = [m for m in self._held if m.stream_id != stream_id]

    def run_once(self, timeout_s: float) -> int:
        return self.worker.run_once(timeout_s)

    def usage(self) -> dict:
        """This process's CPU seconds and the worker's busy seconds and task counts so far
        (differences over a window show how much processor each rank got and used)."""
        ws = self.worker.stats
        return {
            "rank": self.rank,
            "gc_frozen": gc.get_freeze_count(),
            "cpu_s": time.process_time(),
            "wall_s": time.monotonic(),  # sampled with cpu_s: shares over the rank's own window
            "busy_s": ws.busy_s,
            "tasks": ws.tasks,
            "batches": ws.batches,
        }

    def measure_block_ms(self, repeats: int) -> dict[int, float]:
        """Median ms of one forward of each held block (one task, a full window), on this
        rank's device: block 0 includes the embedding, block L-1 the head."""
        from physis_ros.engine.stage import measure_block_ms

        repeats = max(1, int(repeats))
        return {
            blk: measure_block_ms(
                self.model, [self.cfg.window], block=blk, repeats=repeats, warmup=2
            )
            for blk in sorted(self.blocks)
        }

    def ensure_blocks(self, blocks) -> set[int]:
        """Build (or load from ``weights_path``) the weights of ``blocks`` this rank lacks, so
        stages of those blocks can be placed here. Returns the blocks added."""
        from physis_ros.engine.build import build_model

        wanted = {int(b) for b in blocks}
        bad = sorted(b for b in wanted if not 0 <= b < self.cfg.model_config.num_blocks)
        if bad:
            raise ValueError(f"blocks {bad} do not exist (model has {len(self.model.blocks)})")
        missing = wanted - set(self.model.block_ids)
        if not missing:
            return set()
        # Blocks are seeded per block index: the same weights as on every other rank.
        extra = build_model(
            self.cfg.model_config,
            seed=self._init_seed(),
            device=self.model.device,
            dtype=self.model.dtype,
            block_ids=missing,
        )
        for blk in missing:
            self.model.blocks[blk] = extra.blocks[blk]
        self.model.block_ids = frozenset(set(self.model.block_ids) | missing)
        self._load_weights()
        self.blocks |= missing
        return missing


def blocks_for_rank(cfg: RuntimeConfig, rank: int, world_size: int) -> set[int]:
    """Blocks whose weights ``rank`` loads: those of its stages under the default layout
    (``single`` puts everything on rank 0, so every rank then loads every block to let
    streams be placed anywhere)."""
    blocks = cfg.model_config.num_blocks
    layout = parse_placement(cfg.placement, cfg.steps, blocks, world_size)
    if cfg.placement == "single":
        return set(range(blocks))
    return {blk for row in layout for blk, r in enumerate(row) if r == rank}


class StopFlag:
    """Set by SIGINT/SIGTERM (main thread) or by a shutdown message."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.reason = ""
        self.wake: Callable[[], None] | None = None
        """Called once set: ends the loop's wait at once (see TorchDistTransport.wake)."""

    def set(self, reason: str) -> None:
        if not self.event.is_set():
            self.reason = reason
            self.event.set()
            if self.wake is not None:
                self.wake()

    def install_signal_handlers(self) -> None:
        def handler(signum, _frame):
            self.set(signal.Signals(signum).name)

        signal.signal(signal.SIGTERM, handler)
        signal.signal(signal.SIGINT, handler)


def run_worker_rank(cfg: RuntimeConfig, ctx: RankContext, stop: StopFlag) -> int:
    """The loop of ranks 1..N-1 (rank 0 runs its host inside RankExecutor). Returns exit code."""
    shapes = cfg.shapes()
    transport = TorchDistTransport(shapes=shapes, device=ctx.device)
    stop.wake = transport.wake
    check_shapes_agree(shapes, ctx.device if ctx.backend == "nccl" else torch.device("cpu"))
    host = None
    code = 0
    try:
        host = StageHost(cfg, ctx, transport, blocks_for_rank(cfg, ctx.rank, ctx.world_size))
        freeze_startup_objects()
        transport.send_control(0, "ready", {"rank": ctx.rank, "blocks": sorted(host.blocks)})
        next_heartbeat_s = 0.0
        while not stop.event.is_set():
            for ctl in transport.recv_control():
                if ctl.kind == "open":
                    host.open_stream(ctl.body)
                elif ctl.kind == "close":
                    host.close_stream(int(ctl.body["stream_id"]))
                elif ctl.kind == "relayout":
                    host.relayout(ctl.body)
                elif ctl.kind == "usage":
                    transport.send_control(0, "usage_report", host.usage())
                elif ctl.kind == "measure":
                    block_ms = host.measure_block_ms(int(ctl.body.get("repeats", 5)))
                    transport.send_control(
                        0, "costs", {"rank": ctx.rank, "block_ms": list(block_ms.items())}
                    )
                elif ctl.kind == "load":
                    host.ensure_blocks(ctl.body["blocks"])
                    transport.send_control(
                        0, "loaded", {"rank": ctx.rank, "blocks": sorted(host.blocks)}
                    )
                elif ctl.kind == "shutdown":
                    stop.set("shutdown from rank 0")
                elif ctl.kind == "recv_stopped":
                    stop.set(f"receive loop stopped: {ctl.body.get('error')}")
                    code = EXIT_CONTROLLER_LOST
            host.run_once(cfg.poll_interval_s)
            now = time.monotonic()
            if now >= next_heartbeat_s:
                transport.send_heartbeat(0)
                next_heartbeat_s = now + cfg.heartbeat_interval_s
            if transport.seconds_since_heard(0) > cfg.fault_timeout_s:
                stop.set(f"rank 0 silent for {transport.seconds_since_heard(0):.1f} s")
                code = EXIT_CONTROLLER_LOST
    except Exception as exc:  # report to rank 0 which rank failed and why, then exit non-zero
        log.exception("rank %d failed", ctx.rank)
        transport.send_control(
            0, "error", {"rank": ctx.rank, "error": f"{type(exc).__name__}: {exc}"}
        )
        stop.set(f"error: {exc}")
        code = 1
    # The goodbye below is bounded (flush, receive join) but gloo's teardown has no timeout
    # of its own; a rank must never outlive its launcher's SIGTERM grace, so leave anyway.
    _exit_after(CLEANUP_FLUSH_S + cfg.fault_timeout_s + CLEANUP_SLACK_S, code)
    stats = {"cpu_s": time.process_time(), "transport": dict(transport.counters)}
    if host is not None:
        host.worker.close()
        ws = host.worker.stats
        stats.update(
            tasks=ws.tasks,
            batches=ws.batches,
            mixed_batches=ws.mixed_batches,
            busy_s=ws.busy_s,
            rings_sent=ws.rings_sent,
            rings_installed=ws.rings_installed,
            drops={**dict(ws.drops), **host.dropped},
        )
    transport.send_control(0, "bye", {"rank": ctx.rank, "reason": stop.reason, "stats": stats})
    transport.close(flush_timeout_s=CLEANUP_FLUSH_S)
    # Left on our own (signal, lost controller): rank 0's ``shutdown`` may still come and
    # end the receive thread; if not, only exiting the process drops its posted receive.
    if not transport.join_recv(timeout_s=cfg.fault_timeout_s if code == 0 else 0.0):
        log.warning("rank %d: receive still posted; exiting without destroying the group", ctx.rank)
        exit_now(code)
    dist.destroy_process_group()
    return code


def main(argv: list[str] | None = None) -> int:
    """Entry of a worker rank started by ``RankExecutor.launch_local``: ``python -m
    physis_ros.engine.ranks.runtime --device D --comm-timeout-s S`` (how to join); the
    ``RuntimeConfig`` comes from rank 0 as JSON (``launch.broadcast_text``)."""
    from physis_ros.engine.ranks.launch import broadcast_text

    tie_to_parent()
    faulthandler.register(signal.SIGUSR1)  # `kill -USR1 <pid>` prints every thread's stack
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    parser.add_argument("--comm-timeout-s", type=float, default=60.0)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s rank%(process)d %(message)s")
    ctx = init_from_env(device=args.device, comm_timeout_s=args.comm_timeout_s)
    if ctx.rank == 0:
        raise SystemExit("rank 0 is the controller: run physis-serve (or ranks_engine), not this")
    stop = StopFlag()  # installed after init: until then SIGTERM ends the process at once
    stop.install_signal_handlers()
    cfg = RuntimeConfig.from_json(broadcast_text(ctx, None))
    torch.set_num_threads(cfg.threads)
    code = run_worker_rank(cfg, ctx, stop)
    exit_now(code)
    return code


CLEANUP_FLUSH_S = 2.0
"""Longest a stopping worker rank waits for its last messages to leave."""
CLEANUP_SLACK_S = 3.0
"""Beyond the flush and the receive join, what a stopping rank's cleanup may take."""


def _exit_after(seconds: float, code: int) -> None:
    timer = threading.Timer(seconds, exit_now, args=(code,))
    timer.daemon = True
    timer.start()


def exit_now(code: int) -> None:
    """End a worker rank once its own cleanup is done. Interpreter finalisation can hang in
    gloo's destructors when the job has more than two ranks (seen with torch 2.13), and there
    is nothing left to finalise: flush and leave."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
