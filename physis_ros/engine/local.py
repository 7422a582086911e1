"""``LocalEngine``: the ``StreamEngine`` of one process (workers in threads, InProcTransport).

The front end calls ``open_stream``/``submit_*``/``poll`` from its own threads; a driver thread
collects finished chunks from the sink, decodes them with the codec and queues them for
``poll``. Images and actions cross this boundary as numpy arrays only.
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time

import numpy as np
import torch

from physis_ros.engine.api import (
    AdmissionRefused,
    ChunkOutput,
    StreamFailed,
    StreamPromise,
    StreamSpec,
    check_rollouts,
)
from physis_ros.engine.build import build_model
from physis_ros.engine.checkpoints import ResolvedModel, load_weights, resolve_model, summary
from physis_ros.engine.codec import check_stream_codec, make_codec
from physis_ros.engine.config import ModelConfig, SamplerConfig
from physis_ros.engine.placement import (
    Layout,
    layout_by_block_even,
    layout_even,
    validate_layout,
)
from physis_ros.engine.prompts import PromptBook, goal_prompted, trained_empty_prompt
from physis_ros.engine.runtime import MODES, ChunkResult, InProcRuntime
from physis_ros.engine.sampler import (
    pack_chunk,
    request_actions,
    request_state,
    unpack_chunk,
    unpack_state,
)
from physis_ros.engine.stage import measure_block_ms

log = logging.getLogger(__name__)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class LocalEngine:
    """In-process engine: ``workers`` workers in threads, one shared model, one codec."""

    def __init__(
        self,
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
        horizon: int = 0,
        context_noise: str = "clean",
    ) -> None:
        """``model``: a preset name, a model directory (``checkpoints.resolve_model``, with
        ``latent_frames``, ``resolution`` and ``vae``) or a ModelConfig; ``checkpoint``: a
        physis-train weights file for a preset; ``prompts``: prompt-embedding files whose
        names streams may ask for (``engine.prompts``); ``horizon``: a stream's default
        (StreamSpec.horizon None; 0: no limit, offline generation); ``context_noise``: how the
        model was trained to take observations (both from the weights' metadata with shipped
        weights, ``physis_ros.weights.engine_kwargs``)."""
        if mode not in MODES:
            raise ValueError(f"mode {mode!r} is not one of {MODES}")
        if max_streams < 1:
            raise ValueError(f"max_streams must be >= 1, got {max_streams}")
        if isinstance(dtype, str):
            if dtype not in DTYPES:
                raise ValueError(f"dtype {dtype!r} is not one of {sorted(DTYPES)}")
            dtype = DTYPES[dtype]
        if horizon < 0:
            raise ValueError(f"horizon must be >= 0 (0: no limit), got {horizon}")
        self.horizon = horizon
        resolved = (
            resolve_model(model, latent_frames=latent_frames, resolution=resolution, vae=vae)
            if isinstance(model, str)
            else ResolvedModel(cfg=model)
        )
        if resolved.weights is not None and checkpoint is not None:
            raise ValueError(f"model {model} is a directory with its weights; drop checkpoint")
        self.cfg = resolved.cfg
        self.sampler = SamplerConfig(
            steps=steps, window=window, shift=shift, context_noise=context_noise
        )
        self.mode = mode
        self.max_in_flight = max_in_flight
        self.max_streams = max_streams
        own = resolved.weights is not None  # loaded below: no seeded init on the CPU first
        self.model = build_model(self.cfg, seed=None if own else seed, device=device, dtype=dtype)
        meta = None
        if resolved.weights is not None:
            load_weights(self.model, resolved.weights)
        elif checkpoint is not None:
            from physis_ros.weights import read_metadata

            self.model.load_safetensors(checkpoint)
            meta = read_metadata(checkpoint)
        empty = None if resolved.weights is not None else trained_empty_prompt(self.cfg, meta)
        self.prompts = PromptBook(
            self.cfg, list(prompts), empty=empty, goal_prompts=goal_prompted(meta)
        )
        self.codec = make_codec(self.cfg, device=device)
        log.info("\n%s", summary(resolved, self.sampler, dtype, checkpoint=checkpoint or ""))
        L = self.cfg.num_blocks
        if layout is None and mode == "sequential-clean":
            layout = layout_by_block_even(steps, L, workers)  # caches shared over steps
        elif layout is None:
            layout = layout_even(steps, L, workers)
        num_workers = max(workers, 1 + max(max(row) for row in layout))
        self.runtime = InProcRuntime(
            self.model, self.sampler, layout, num_workers=num_workers, batching=batching
        )
        self.workers = self.runtime.placement.num_workers
        # One measured block forward calibrates what the promise says.
        self.block_ms = measure_block_ms(self.model, [window], repeats=5, warmup=2)
        self._lock = threading.Lock()
        self._outputs: queue.SimpleQueue[ChunkOutput] = queue.SimpleQueue()
        self._closed: set[int] = set()
        self._next_stream = 0
        self._stop = threading.Event()
        self._failure: BaseException | None = None
        self.drops: collections.Counter = collections.Counter()
        self.runtime.start_threads()
        self._driver = threading.Thread(target=self._drive, name="engine-driver", daemon=True)
        self._driver.start()

    # ---- StreamEngine ------------------------------------------------------------------------
    def open_stream(self, spec: StreamSpec, *, layout: Layout | None = None) -> StreamPromise:
        """Open a stream on the engine's default layout, checked roughly against its target
        interval here; or on ``layout`` (placed and checked by the pool in front of it,
        ``physis_ros.engine.pool.service``), which only has to name this engine's workers."""
        self._check_alive()
        check_stream_codec(spec, self.codec)
        cond = self.prompts.resolve(spec.prompt, spec.prompt_embedding)
        cfg, k, L = self.cfg, self.sampler.steps, self.cfg.num_blocks
        if layout is not None:
            validate_layout(layout, k, L, self.workers)
        per_chunk_ms = k * L * self.block_ms
        if self.mode == "pipelined":
            interval_ms, depth = per_chunk_ms / self.workers, self.workers
        else:
            interval_ms, depth = (
                per_chunk_ms + (L * self.block_ms if self.mode == "sequential-clean" else 0.0),
                1,
            )
        with self._lock:
            open_now = len(self.runtime.controller.streams)
            if open_now >= self.max_streams:
                raise AdmissionRefused(
                    f"{open_now} streams open, the engine takes {self.max_streams}",
                    resource="streams",
                    shortfall="1 stream",
                )
            interval_ms *= open_now + 1  # streams share the same workers
            if layout is None and spec.target_interval_ms and interval_ms > spec.target_interval_ms:
                raise AdmissionRefused(
                    f"expected interval {interval_ms:.1f} ms exceeds target "
                    f"{spec.target_interval_ms:.1f} ms",
                    resource="compute",
                    shortfall=f"{interval_ms - spec.target_interval_ms:.1f} ms per chunk",
                )
            sid = self._next_stream
            self._next_stream += 1
            horizon = self.horizon if spec.horizon is None else spec.horizon
            check_rollouts(spec, horizon)
            self.runtime.open_stream(
                sid,
                seed=spec.seed,
                cond=cond,
                mode=self.mode,
                max_in_flight=self.max_in_flight,
                horizon=horizon,
                layout=layout,
                previews=spec.previews,
            )
        return StreamPromise(
            stream_id=sid,
            model=cfg.name,
            steps=k,
            blocks=L,
            expected_interval_ms=interval_ms,
            pipeline_depth=depth,
            expected_response_latency_ms=per_chunk_ms,
            chunk_frames=cfg.frames_per_chunk,
            image_height=cfg.image_size[0],
            image_width=cfg.image_size[1],
            action_horizon=cfg.action_horizon if cfg.action_mode != "none" else 0,
            action_dim=cfg.action_dim if cfg.action_mode != "none" else 0,
            horizon=horizon,
            action_mode=cfg.action_mode,
            rollouts=spec.rollouts,
        )

    def close_stream(self, stream_id: int) -> None:
        with self._lock:
            if stream_id not in self.runtime.controller.streams:
                raise ValueError(f"stream {stream_id} is not open")
            self.runtime.close_stream(stream_id)
            self._closed.add(stream_id)
        self.codec.close(stream_id)

    def submit_context(
        self,
        stream_id: int,
        frames: np.ndarray,
        actions: np.ndarray | None = None,
        state: np.ndarray | None = None,
        *,
        slot: int | None = None,
    ) -> int:
        self._check_alive()
        latent = self.codec.encode(frames, stream_id=stream_id)
        x = pack_chunk(
            self.cfg,
            latent.cpu(),
            request_actions(self.cfg, actions, context=True),
            request_state(self.cfg, state),
        )
        with self._lock:
            c = self.runtime.controller.submit_context(stream_id, x, slot=slot)
            self.runtime.controller.pump()
        self.codec.observed(stream_id, c, latent)
        return c

    def submit_generate(
        self, stream_id: int, actions: np.ndarray | None = None, *, slot: int | None = None
    ) -> int:
        self._check_alive()
        act = request_actions(self.cfg, actions, context=False)
        with self._lock:
            c = self.runtime.controller.submit_generate(stream_id, act, slot=slot)
            self.runtime.controller.pump()
        return c

    def poll(self, timeout_s: float) -> list[ChunkOutput]:
        out = []
        try:
            out.append(
                self._outputs.get(timeout=timeout_s)
                if timeout_s > 0
                else self._outputs.get_nowait()
            )
            while True:
                out.append(self._outputs.get_nowait())
        except queue.Empty:
            pass  # nothing more finished yet: what we have is the answer
        self._check_alive()
        return [o for o in out if o.stream_id not in self._closed]

    def shutdown(self) -> None:
        self._stop.set()
        self._driver.join(timeout=10.0)
        self.runtime.close()

    def __enter__(self) -> LocalEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    # ---- internals ---------------------------------------------------------------------------
    def _check_alive(self) -> None:
        if self._failure is not None:
            raise StreamFailed(f"engine stopped: {self._failure!r}") from self._failure
        if self.runtime.errors:
            raise StreamFailed(
                f"a worker failed: {self.runtime.errors[0]!r}"
            ) from self.runtime.errors[0]

    def _drive(self) -> None:
        sink = self.runtime.sink
        try:
            while not self._stop.is_set():
                try:
                    item = sink.get(timeout=0.01)
                except queue.Empty:
                    continue
                with self._lock:
                    res = self.runtime.controller.finished(*item)
                    self.runtime.controller.pump()
                if res is not None:
                    self._outputs.put(self._decode(res))
        except BaseException as err:  # noqa: BLE001 - surfaced to callers by _check_alive
            self._failure = err

    def _decode(self, res: ChunkResult) -> ChunkOutput:
        x = res.x.float().cpu()
        latent, actions = unpack_chunk(self.cfg, x)
        frames = self.codec.decode(latent, stream_id=res.stream_id, chunk=res.chunk)
        state = unpack_state(self.cfg, x)
        return ChunkOutput(
            stream_id=res.stream_id,
            chunk=res.chunk,
            frames=frames,
            actions=actions.numpy().copy() if self.cfg.action_mode == "predict" else None,
            state=None if state is None else state.numpy().copy(),
            entered_s=res.created_s,
            left_s=res.left_s,
            decoded_s=time.monotonic(),
            finite=bool(torch.isfinite(x).all()),
            anchor=res.anchor,
            preview_steps=res.preview_steps,
        )
