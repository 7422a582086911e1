"""The executor of one process: N workers in threads, over ``InProcTransport``.

Every worker shares one model. ``start`` gives each worker its own thread (torch releases
the GIL inside ops); ``run_workers_once`` runs them in turn in the caller's thread instead
(deterministic: tests). ``shutdown`` joins every thread the executor and its workers started.
``InProcRuntime`` is a ``Pipeline`` over it, built in one call (tests and benchmarks);
``local_engine`` the engine core over it, the model loaded (physis-serve's single process).
"""

from __future__ import annotations

import logging
import queue
import threading

import torch

from physis_ros.contract.safetensors import read_metadata
from physis_ros.engine.api import StreamFailed
from physis_ros.engine.assembly import contract_of, log_summary, prompt_book
from physis_ros.engine.build import build_model
from physis_ros.engine.checkpoints import ResolvedModel, load_weights, resolve_model
from physis_ros.engine.config import ModelConfig, SamplerConfig
from physis_ros.engine.controller import MODES
from physis_ros.engine.core import EngineCore
from physis_ros.engine.executor import StreamOrder
from physis_ros.engine.model import WanDiT
from physis_ros.engine.pipeline import Pipeline
from physis_ros.engine.placement import Layout, Placement, layout_by_block_even, layout_even
from physis_ros.engine.transport import Activation, InProcTransport
from physis_ros.engine.worker import Worker

log = logging.getLogger(__name__)


class ThreadExecutor:
    """N workers of one model in this process; the sink is worker ``sink_rank``'s."""

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
        self.default_layout = layout
        self.placement = Placement.uniform(layout, (), num_workers=num_workers, sink_rank=sink_rank)
        self.transports = InProcTransport.group(self.placement.num_workers)
        self.workers = [
            Worker(model, sampler, t, self.placement, batching=batching, max_batch=max_batch)
            for t in self.transports
        ]
        self._entry = self.transports[sink_rank]
        self.sink = self.workers[sink_rank].sink
        self._threads: list[threading.Thread] = []
        self._stop = threading.Event()
        self.errors: list[BaseException] = []

    @property
    def num_workers(self) -> int:
        return self.placement.num_workers

    def open_stream(self, order: StreamOrder) -> None:
        for w in self.workers:
            w.open_stream(
                order.stream_id,
                layout=order.layout,
                cond=order.cond,
                history=order.history,
                seed=order.seed,
                horizon=order.horizon,
            )
        self.placement = self.placement.with_stream(order.stream_id, order.layout)

    def close_stream(self, stream_id: int) -> None:
        for w in self.workers:
            w.close_stream(stream_id)
        self.placement = self.placement.without_stream(stream_id)

    def relayout(self, stream_id: int, *, epoch: int, first_ticket: int, layout: Layout) -> None:
        for w in self.workers:
            w.relayout(stream_id, epoch=epoch, first_ticket=first_ticket, layout=layout)
        self.placement = self.placement.without_stream(stream_id).with_stream(stream_id, layout)

    def send(self, dst: int, act: Activation) -> None:
        self._entry.send(dst, act)

    def collect(self, timeout_s: float) -> list[tuple[float, Activation]]:
        items = []
        if timeout_s > 0:
            try:
                items.append(self.sink.get(timeout=timeout_s))
            except queue.Empty:
                return items
        while not self.sink.empty():
            items.append(self.sink.get())
        return items

    def run_workers_once(self) -> None:
        """Each worker's ``run_once`` in turn, in this thread (no worker threads running)."""
        if self._threads:
            raise RuntimeError("workers are running in threads; use wait_idle")
        for w in self.workers:
            w.run_once(0.0)

    def start(self) -> None:
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

    def stop(self) -> None:
        """Join the worker threads; raises a worker's failure."""
        self._stop.set()
        for th in self._threads:
            th.join(timeout=10.0)
        self._threads.clear()
        if self.errors:
            raise RuntimeError(f"a worker failed: {self.errors[0]!r}") from self.errors[0]

    def failure(self) -> BaseException | None:
        return self.errors[0] if self.errors else None

    def take_stream_failures(self) -> list[StreamFailed]:
        return []  # a worker thread holds every stream's stages: its failure is ``failure``

    def impairment(self) -> str:
        failure = self.failure()
        return "" if failure is None else f"a worker failed: {failure!r}"

    def shutdown(self) -> None:
        """Stop every thread the executor and its workers started (worker loops, host
        copiers) and join them; raises a worker's failure like ``stop``. Idempotent."""
        try:
            self.stop()
        finally:
            for w in self.workers:
                w.close()


class InProcRuntime(Pipeline):
    """A controller over a ``ThreadExecutor``, built in one call; ``start_threads`` /
    ``run_inline`` choose how the workers run. ``close`` (or ``with``) joins every thread."""

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
        executor = ThreadExecutor(
            model,
            sampler,
            layout,
            num_workers=num_workers,
            batching=batching,
            max_batch=max_batch,
            sink_rank=sink_rank,
        )
        super().__init__(executor, sampler)
        self.layout = layout
        self.workers = executor.workers
        self.sink = executor.sink
        self.errors = executor.errors

    @property
    def placement(self) -> Placement:
        return self.executor.placement

    def start_threads(self) -> None:
        self.executor.start()

    def stop_threads(self) -> None:
        self.executor.stop()

    def close(self) -> None:
        self.executor.shutdown()

    def __enter__(self) -> InProcRuntime:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def local_engine(
    model: str | ModelConfig = "tiny",
    *,
    steps: int = 4,
    window: int = 2,
    shift: float = 5.0,
    mode: str = "pipelined",
    workers: int = 1,
    layout: Layout | None = None,
    batching: bool = True,
    max_in_flight: int = 0,
    max_streams: int = 64,
    device: str = "cpu",
    dtype: torch.dtype | str = torch.float32,
    seed: int = 0,
    checkpoint: str | None = None,
    prompts: list[str] | tuple[str, ...] = (),
    latent_frames: int = 0,
    resolution: str = "",
    vae: str = "",
    variant: str = "",
    horizon: int = 0,
    context_noise: str = "clean",
) -> EngineCore:
    """The engine of one process: ``workers`` worker threads over one model on ``device``.

    ``model``: a preset name, a model directory (``checkpoints.resolve_model``, with
    ``latent_frames``, ``resolution``, ``vae`` and its weights' ``variant``) or a
    ModelConfig; ``checkpoint``: a physis-train weights file for a preset; ``prompts``:
    prompt-embedding files whose names streams may ask for (``engine.prompts``); ``horizon``:
    a stream's default (0: no limit, offline generation); ``context_noise``: how the model
    was trained to take observations (both from the weights' metadata with shipped weights,
    ``physis_ros.weights``)."""
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"dtype {dtype!r} is not one of {sorted(DTYPES)}")
        dtype = DTYPES[dtype]
    if mode not in MODES:
        raise ValueError(f"mode {mode!r} is not one of {MODES}")
    chunk = {"latent_frames": latent_frames, "resolution": resolution, "vae": vae}
    dtype_name = str(dtype).removeprefix("torch.")
    resolved = (
        resolve_model(model, **chunk, variant=variant, dtype=dtype_name)
        if isinstance(model, str)
        else ResolvedModel(cfg=model)
    )
    if resolved.weights is not None and checkpoint is not None:
        raise ValueError(f"model {model} is a directory with its weights; drop checkpoint")
    cfg = resolved.cfg
    sampler = SamplerConfig(steps=steps, window=window, shift=shift, context_noise=context_noise)
    own = resolved.weights is not None  # loaded below: no seeded init on the CPU first
    net = build_model(cfg, seed=None if own else seed, device=device, dtype=dtype)
    meta = None
    if own:
        load_weights(net, resolved.weights)
    elif checkpoint is not None:
        net.load_safetensors(checkpoint)
        meta = read_metadata(checkpoint)
    book = prompt_book(resolved, files=prompts, checkpoint_meta=meta)
    if layout is None and mode == "sequential-clean":
        layout = layout_by_block_even(steps, cfg.num_blocks, workers)  # caches shared over steps
    elif layout is None:
        layout = layout_even(steps, cfg.num_blocks, workers)
    num_workers = max(workers, 1 + max(max(row) for row in layout))
    executor = ThreadExecutor(net, sampler, layout, num_workers=num_workers, batching=batching)
    pipeline = Pipeline(executor, sampler)
    log_summary(resolved, pipeline, checkpoint or "")
    core = EngineCore(
        pipeline,
        prompts=book,
        mode=mode,
        horizon=horizon,
        max_in_flight=max_in_flight,
        max_streams=max_streams,
        contract=contract_of(meta),
    )
    executor.start()
    return core
