"""A controller driving an executor: packed chunks in, ``ChunkResult``s out.

The level below the engine core (no codec, no prompts, no promises): streams are opened with
explicit ids and prompt tensors, observations are packed states. Tests hold every executor
to the oracle at this level (``run_plan``), and the core runs on one.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from physis_ros.engine.config import SamplerConfig
from physis_ros.engine.controller import ChunkResult, Controller, submit_item
from physis_ros.engine.executor import HISTORY_OF_MODE, Executor, StreamOrder
from physis_ros.engine.forward import make_cond
from physis_ros.engine.placement import Layout


class Pipeline:
    """A ``Controller`` (slots, anchors, release policy) over an ``Executor`` (the workers).
    Not thread-safe: one thread drives it (the core holds a lock around it)."""

    def __init__(self, executor: Executor, sampler: SamplerConfig) -> None:
        self.executor = executor
        self.model = executor.model
        self.sampler = sampler
        self.controller = Controller(executor.model, sampler, executor.send)

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
        ``previews``: its chunks' x0 estimates reach the sink after each step but the last;
        ``layout``: where its stages run (default: the executor's)."""
        layout = layout or self.executor.default_layout
        if mode not in HISTORY_OF_MODE:
            raise ValueError(f"mode {mode!r} is not one of {tuple(HISTORY_OF_MODE)}")
        order = StreamOrder(
            stream_id=stream_id,
            seed=seed,
            cond=cond,
            layout=layout,
            history=HISTORY_OF_MODE[mode],
            horizon=horizon,
        )
        self.executor.open_stream(order)
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
        self.executor.close_stream(stream_id)

    def relayout(self, stream_id: int, layout: Layout) -> int:
        """Move the stream to ``layout`` from its next released chunk on (the KV rings of
        moved stages follow, see worker.py). Returns that chunk's ticket."""
        epoch, first = self.controller.relayout(stream_id, entry_rank=layout[0][0])
        self.executor.relayout(stream_id, epoch=epoch, first_ticket=first, layout=layout)
        return first

    def drain(self, wait_s: float = 0.0) -> list[ChunkResult]:
        """Account for every chunk that reached the sink (waiting up to ``wait_s`` for the
        first), then release what the modes allow."""
        out = []
        for left_s, act in self.executor.collect(wait_s):
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
        """Drive every worker in turn in this thread until all released chunks are done
        (an executor whose workers can run inline: ``run_workers_once``). ``on_output`` runs
        after each finished chunk (e.g. interleaved timing)."""
        out = self.drain()
        for _ in range(max_rounds):
            self.executor.run_workers_once()
            new = self.drain()
            if new:
                out += new
                if on_output is not None:
                    for res in new:
                        on_output(res)
            if self.controller.idle():
                return out
        raise RuntimeError(f"pipeline not idle after {max_rounds} rounds")

    def wait_idle(self, timeout_s: float, poll_s: float = 0.01) -> list[ChunkResult]:
        """Collect finished chunks until everything released is done (workers running)."""
        deadline = time.monotonic() + timeout_s
        out = self.drain()
        while not self.controller.idle():
            failure = self.executor.failure()
            if failure is not None:
                raise RuntimeError(f"a worker failed: {failure!r}") from failure
            if time.monotonic() > deadline:
                raise TimeoutError(f"pipeline not idle after {timeout_s} s")
            out += self.drain(wait_s=poll_s)  # blocks on the sink: no busy polling
        return out


def run_plan(
    pipeline: Pipeline,
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
    ``make_cond`` seeded 100 + stream). ``threads``: the workers run in their threads (else
    inline in this one)."""
    for sid in plans:
        pipeline.open_stream(
            sid,
            seed=(seeds or {}).get(sid, sid),
            cond=(conds or {}).get(sid, make_cond(pipeline.model.cfg, 100 + sid)),
            mode=mode,
            max_in_flight=max_in_flight,
            horizon=horizon,
        )
    for sid, plan in plans.items():
        for item in plan:
            submit_item(pipeline.controller, sid, item)
    pipeline.controller.pump()
    if threads:
        pipeline.executor.start()
        try:
            results = pipeline.wait_idle(timeout_s)
        finally:
            pipeline.executor.stop()
    else:
        results = pipeline.run_inline(on_output=on_output)
    out: dict[int, dict[int, ChunkResult]] = {sid: {} for sid in plans}
    for r in results:
        out[r.stream_id][r.chunk] = r
    return out
