"""``EngineCore``: the one ``StreamEngine``, whatever executor runs the stages behind it.

It owns what every execution shares: the controller (slots, anchors, release policy, through
a ``Pipeline``), the codec (frames in: encoded and packed with the stream's commanded actions
and state; chunks out: unpacked and decoded into ``ChunkOutput``), the prompts a stream may ask
for, and each stream's promise when no pool stands in front (``engine/pool/service.py``
admits and promises when one does). The executor (worker threads in this process, or
torch.distributed ranks) runs the stages. Callers use it from any thread: one lock guards the
controller; ``poll`` waits on the executor's sink outside it.

Faults: a failure that takes every stream (a worker thread died) makes every call raise
``StreamFailed``; one that takes some streams (a rank that held their stages died) ends those
streams alone: the next ``poll`` with nothing else to return raises it, once per stream, and
calls on such a stream raise it too.
"""

from __future__ import annotations

import logging
import threading
import time

import numpy as np
import torch

from physis_ros.contract.model import WamContract
from physis_ros.engine.api import (
    AdmissionRefused,
    ChunkOutput,
    StreamFailed,
    StreamPromise,
    StreamSpec,
    check_rollouts,
)
from physis_ros.engine.codec import check_stream_codec, make_codec
from physis_ros.engine.controller import MODES, ChunkResult
from physis_ros.engine.pipeline import Pipeline
from physis_ros.engine.placement import Layout, Placement, validate_layout
from physis_ros.engine.pool.service import PoolAdmission
from physis_ros.engine.prompts import PromptBook
from physis_ros.engine.sampler import (
    pack_chunk,
    request_actions,
    request_state,
    unpack_chunk,
    unpack_state,
)
from physis_ros.engine.stage import measure_block_ms

log = logging.getLogger(__name__)


class EngineCore:
    """The stream API over a ``Pipeline`` (see the module docstring)."""

    def __init__(
        self,
        pipeline: Pipeline,
        *,
        prompts: PromptBook,
        mode: str = "pipelined",
        horizon: int = 0,
        max_in_flight: int = 0,
        max_streams: int = 64,
        contract: WamContract | None = None,
    ) -> None:
        """``horizon``: a stream's default (StreamSpec.horizon None; 0: no limit, offline
        generation); ``max_in_flight``: chunks of a pipelined stream in flight at once (0: no
        limit); ``max_streams``: open at once."""
        if mode not in MODES:
            raise ValueError(f"mode {mode!r} is not one of {MODES}")
        if max_streams < 1:
            raise ValueError(f"max_streams must be >= 1, got {max_streams}")
        if horizon < 0:
            raise ValueError(f"horizon must be >= 0 (0: no limit), got {horizon}")
        self.pipeline = pipeline
        self.executor = pipeline.executor
        self.controller = pipeline.controller
        self.model = pipeline.model
        self.cfg = self.model.cfg
        self.sampler = pipeline.sampler
        self.prompts = prompts
        self.codec = make_codec(self.cfg, device=self.model.device)
        self.mode = mode
        self.horizon = horizon
        self.max_in_flight = max_in_flight
        self.max_streams = max_streams
        # One middle block this process holds, a full window: what a promise is made of.
        held = sorted(self.model.block_ids)
        self.block_ms = measure_block_ms(
            self.model, [self.sampler.window], block=held[len(held) // 2], repeats=5, warmup=2
        )
        self.contract = contract
        """A world-action model's contract (its weights'): what its served streams take."""
        self.admission: PoolAdmission | None = None
        """The pool that admits, places and promises (physis-serve sets it once planned);
        None: streams open on the executor's default layout, promised roughly."""
        self._lock = threading.RLock()
        self._open_lock = threading.Lock()
        self._next_stream = 0
        self._layouts: dict[int, Layout] = {}
        self._failed: dict[int, StreamFailed] = {}
        self._unreported: list[StreamFailed] = []

    # ---- StreamEngine ------------------------------------------------------------------------
    def open_stream(
        self,
        spec: StreamSpec,
        *,
        layout: Layout | None = None,
        max_in_flight: int | None = None,
    ) -> StreamPromise:
        """Open a stream on the executor's default layout, checked roughly against its target
        interval here; or on ``layout`` (placed and checked by the pool in front of it,
        ``engine/pool/service.py``), which only has to name this executor's workers.
        ``max_in_flight``: this stream's (None: the engine's). With the pool (``admission``)
        and no layout, the pool admits, places and promises it."""
        if self.admission is not None and layout is None:
            with self._open_lock:  # one admission at a time: each sees the streams before it

                def open_on(placed: Layout) -> StreamPromise:
                    self.load_blocks(placed)
                    return self._open(spec, placed, max_in_flight)

                promise = self.admission.open(spec, open_on)
        else:
            promise = self._open(spec, layout, max_in_flight)
        return promise

    def _open(
        self, spec: StreamSpec, layout: Layout | None, max_in_flight: int | None
    ) -> StreamPromise:
        self._check_alive()
        check_stream_codec(spec, self.codec)
        if spec.task:  # the model's contract names the task values it takes
            if self.contract is None or not self.contract.task_names:
                raise ValueError(f"task values {sorted(spec.task)}: the model takes none")
            self.contract.check_task(spec.task)
        cond = self.prompts.resolve(spec.prompt, spec.prompt_embedding, spec.task)
        K, L = self.sampler.steps, self.cfg.num_blocks
        placed = layout is not None
        layout = layout or self.executor.default_layout
        validate_layout(layout, K, L, self.executor.num_workers)
        horizon = self.horizon if spec.horizon is None else spec.horizon
        check_rollouts(spec, horizon)
        with self._lock:
            open_now = len(self.controller.streams)
            if open_now >= self.max_streams:
                raise AdmissionRefused(
                    f"{open_now} streams open, the engine takes {self.max_streams}",
                    resource="streams",
                    shortfall="1 stream",
                )
            interval_ms, depth = self._rough_interval(layout)
            interval_ms *= open_now + 1  # streams share the same workers
            if not placed and spec.target_interval_ms and interval_ms > spec.target_interval_ms:
                raise AdmissionRefused(
                    f"expected interval {interval_ms:.1f} ms exceeds target "
                    f"{spec.target_interval_ms:.1f} ms",
                    resource="compute",
                    shortfall=f"{interval_ms - spec.target_interval_ms:.1f} ms per chunk",
                )
            self._check_layout(layout)
            sid = self._next_stream
            self.pipeline.open_stream(
                sid,
                seed=spec.seed,
                cond=cond,
                mode=self.mode,
                max_in_flight=self.max_in_flight if max_in_flight is None else max_in_flight,
                layout=layout,
                horizon=horizon,
                previews=spec.previews,
            )
            self._next_stream += 1
            self._layouts[sid] = layout
        cfg = self.cfg
        predicts = cfg.action_mode != "none"  # a world model with actions takes them too
        return StreamPromise(
            stream_id=sid,
            model=cfg.name,
            steps=K,
            blocks=L,
            expected_interval_ms=interval_ms,
            pipeline_depth=depth,
            expected_response_latency_ms=K * L * self.block_ms,
            chunk_frames=cfg.frames_per_chunk,
            image_height=cfg.image_size[0],
            image_width=cfg.image_size[1],
            action_horizon=cfg.action_horizon if predicts else 0,
            action_dim=cfg.action_dim if predicts else 0,
            horizon=horizon,
            action_mode=cfg.action_mode,
            rollouts=spec.rollouts,
            contract=self.contract.to_json() if self.contract is not None else "",
        )

    def _rough_interval(self, layout: Layout) -> tuple[float, int]:
        """(interval ms, chunks in flight) of one stream on ``layout`` from the measured
        block time alone: the busiest worker's stages, or a whole chunk at a time."""
        K, L = self.sampler.steps, self.cfg.num_blocks
        if self.mode != "pipelined":
            clean = L * self.block_ms if self.mode == "sequential-clean" else 0.0
            return K * L * self.block_ms + clean, 1
        per_worker = Placement.uniform(layout, (0,), num_workers=self.executor.num_workers)
        busiest = max(len(per_worker.stages_on(r)) for r in range(per_worker.num_workers))
        return busiest * self.block_ms, len(per_worker.virtual_ranks())

    def close_stream(self, stream_id: int) -> None:
        with self._lock:
            self._failed.pop(stream_id, None)
            if stream_id not in self.controller.streams:
                raise ValueError(f"stream {stream_id} is not open")
            self._close(stream_id)

    def _close(self, stream_id: int) -> None:
        self.pipeline.close_stream(stream_id)
        self._layouts.pop(stream_id, None)
        self.codec.close(stream_id)
        if self.admission is not None:
            self.admission.close(stream_id)

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
        self._check_alive()
        self._check_stream(stream_id)
        latent = self.codec.encode(frames, stream_id=stream_id)
        x = pack_chunk(
            self.cfg,
            latent.cpu(),
            request_actions(self.cfg, actions, context=True),
            request_state(self.cfg, state),
        )
        slot = self.submit_context_x(stream_id, x, slot=slot)
        self.codec.observed(stream_id, slot, latent)
        return slot

    def submit_context_x(self, stream_id: int, x: torch.Tensor, *, slot: int | None = None) -> int:
        """Queue an already encoded observation (packed state [X]) of ``slot`` (None: the
        next new one); returns its slot."""
        with self._lock:
            self._check_alive()
            self._check_stream(stream_id)
            c = self.controller.submit_context(stream_id, x, slot=slot)
            self.controller.pump()
            return c

    def submit_generate(
        self, stream_id: int, actions: np.ndarray | None = None, *, slot: int | None = None
    ) -> int:
        self._check_alive()
        act = request_actions(self.cfg, actions, context=False)
        with self._lock:
            self._check_stream(stream_id)
            c = self.controller.submit_generate(stream_id, act, slot=slot)
            self.controller.pump()
            return c

    def poll_results(self, timeout_s: float) -> list[ChunkResult]:
        """Finished chunks as packed states: per stream in release order (anchor, then slot),
        a chunk's previews (by step) before the chunk itself. Raises ``StreamFailed`` (once
        per failed stream) when nothing else is ready."""
        arrived = self.executor.collect(timeout_s)
        with self._lock:
            self._absorb_failures()
            out = []
            for left_s, act in arrived:
                res = self.controller.finished(left_s, act)
                if res is not None:
                    out.append(res)
            self.controller.pump()
            if not out and self._unreported:
                raise self._unreported.pop(0)
        self._check_alive()
        out.sort(
            key=lambda r: (r.stream_id, r.anchor, r.chunk, r.preview_steps == 0, r.preview_steps)
        )
        return out

    def poll(self, timeout_s: float) -> list[ChunkOutput]:
        outputs = [self._decode(res) for res in self.poll_results(timeout_s)]
        if self.admission is not None:
            self.admission.measure(outputs)
        return outputs

    def take_revisions(self) -> list[StreamPromise]:
        """Promises the pool revised since the last call (a stream joined or left, or the
        measured latencies moved them): one per stream, the newest."""
        return self.admission.take_revisions() if self.admission is not None else []

    def next_slot(self, stream_id: int) -> int:
        """The slot the stream's next generated chunk (or new observation) takes."""
        with self._lock:
            return self.controller.next_slot(stream_id)

    def is_open(self, stream_id: int) -> bool:
        with self._lock:
            return stream_id in self.controller.streams

    def _decode(self, res: ChunkResult) -> ChunkOutput:
        x = res.x.float().cpu()
        latent, actions = unpack_chunk(self.cfg, x)
        state = unpack_state(self.cfg, x)
        return ChunkOutput(
            stream_id=res.stream_id,
            chunk=res.chunk,
            frames=self.codec.decode(latent, stream_id=res.stream_id, chunk=res.chunk),
            actions=actions.numpy().copy() if self.cfg.action_mode == "predict" else None,
            state=None if state is None else state.numpy().copy(),
            entered_s=res.created_s,
            left_s=res.left_s,
            decoded_s=time.monotonic(),
            finite=bool(torch.isfinite(x).all()),
            anchor=res.anchor,
            preview_steps=res.preview_steps,
        )

    def shutdown(self) -> None:
        self.executor.shutdown()

    def __enter__(self) -> EngineCore:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    # ---- placement, beyond opening (executors that place on several workers) ----------------
    def load_blocks(self, layout: Layout) -> None:
        """Make every worker hold the weights of its stages under ``layout``."""
        load = getattr(self.executor, "load_blocks", None)
        if load is not None:
            load(layout)

    def relayout(self, stream_id: int, layout: Layout) -> int:
        """Move a running stream to ``layout`` from its next released chunk on (workers first
        load the blocks it needs); returns that chunk's ticket. Noisy history only."""
        K, L = self.sampler.steps, self.cfg.num_blocks
        validate_layout(layout, K, L, self.executor.num_workers)
        with self._lock:
            self._check_stream(stream_id)
        self.load_blocks(layout)
        self._check_layout(layout)
        with self._lock:
            self._check_stream(stream_id)
            first = self.pipeline.relayout(stream_id, layout)
            self._layouts[stream_id] = layout
            self.controller.pump()
        return first

    def _check_layout(self, layout: Layout) -> None:
        """The executor's own refusals of a layout (a failed worker, missing weights)."""
        check = getattr(self.executor, "check_layout", None)
        if check is not None:
            check(layout)

    def layout_of(self, stream_id: int) -> Layout:
        with self._lock:
            return self._layouts[stream_id]

    # ---- faults --------------------------------------------------------------------------
    def impairment(self) -> str:
        """Why this engine cannot serve as configured ("" when it can)."""
        return self.executor.impairment()

    def failed_streams(self) -> dict[int, str]:
        with self._lock:
            self._absorb_failures()
            return {sid: str(err) for sid, err in self._failed.items()}

    def _absorb_failures(self) -> None:
        """Streams the executor lost: closed here, their callers told (under the lock)."""
        for err in self.executor.take_stream_failures():
            sid = err.stream_id
            if sid in self.controller.streams:
                self._close(sid)
            self._failed[sid] = err
            self._unreported.append(err)

    def _check_stream(self, stream_id: int) -> None:
        with self._lock:
            self._absorb_failures()
            if stream_id in self._failed:
                raise self._failed[stream_id]
            if stream_id not in self.controller.streams:
                raise ValueError(f"stream {stream_id} is not open")

    def _check_alive(self) -> None:
        failure = self.executor.failure()
        if failure is not None:
            raise StreamFailed(f"a worker failed: {failure!r}") from failure
