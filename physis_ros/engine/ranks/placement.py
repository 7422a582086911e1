"""What rank 0 does to place streams over the ranks, beyond opening them: per-block costs
measured on the ranks, layouts balanced by those costs, ranks loading the blocks a layout needs,
running streams moved to another layout, and per-rank processor usage.

All of it travels as control messages (runtime.py lists them) answered by each rank's loop;
``RankExecutor``'s monitor thread routes the answers to ``_replies``. Nothing here is a barrier:
only the ranks asked pause, for the time they take to answer.
"""

from __future__ import annotations

import logging
import queue
import time

import numpy as np

from physis_ros.engine.placement import (
    Layout,
    layout_balanced,
    slowest_rank_ms,
    stage_costs,
    validate_layout,
)

log = logging.getLogger(__name__)

ANSWER_KINDS = {"usage": "usage_report", "measure": "costs", "load": "loaded"}
"""The control message a rank answers each question with (runtime.py)."""


class PlacementControl:
    """Mixed into ``RankExecutor`` (which provides the attributes used here: cfg, model_cfg,
    world_size, transport, rank_blocks, failed_ranks, _byes, _lock, _ask_lock, _replies,
    _host_control)."""

    def _ask_ranks(self, kind: str, body: dict, host_arg, timeout_s: float) -> dict[int, dict]:
        """Send ``kind`` to every live worker rank and run it on rank 0's own host (in its
        loop thread); wait for every answer. Only those ranks' loops pause (a control
        message, no barrier): call it between streams or accept that pause."""
        with self._ask_lock:
            ranks = [
                r
                for r in range(1, self.world_size)
                if r not in self.failed_ranks and r not in self._byes
            ]
            return self._ask_locked(kind, dict.fromkeys(ranks, body), host_arg, timeout_s)

    def _ask_locked(
        self, kind: str, bodies: dict[int, dict], host_arg, timeout_s: float, *, rank0=True
    ) -> dict[int, dict]:
        """Send ``kind`` with ``bodies[r]`` to each worker rank ``r`` (and, if ``rank0``, run
        it on rank 0's host with ``host_arg``); rank -> its answer's body (rank 0's as
        ``{"rank0": ...}``). Only answers of the kind that ``kind`` expects count, so a late
        answer to an earlier question that timed out is never taken for this one."""
        for r, body in bodies.items():
            self.transport.send_control(r, kind, body)
        mine: queue.SimpleQueue = queue.SimpleQueue()
        if rank0:
            self._host_control.put((kind, (host_arg, mine)))
        answers: dict[int, dict] = {}
        deadline = time.monotonic() + timeout_s
        waiting = set(bodies)
        while waiting:
            left = deadline - time.monotonic()
            if left <= 0 or waiting & set(self.failed_ranks):
                raise TimeoutError(
                    f"ranks {sorted(waiting)} did not answer {kind!r} in {timeout_s} s"
                    + (f" (failed: {self.failed_ranks})" if self.failed_ranks else "")
                )
            try:
                ctl = self._replies.get(timeout=min(left, 0.2))
            except queue.Empty:
                continue
            if ctl.kind == ANSWER_KINDS[kind] and ctl.src in waiting:
                answers[ctl.src] = ctl.body
                waiting.discard(ctl.src)
        if rank0:
            try:
                answers[0] = {"rank0": mine.get(timeout=max(0.1, deadline - time.monotonic()))}
            except queue.Empty:
                raise TimeoutError(f"rank 0's worker did not answer {kind!r}") from None
        return answers

    def rank_usage(self, timeout_s: float = 10.0) -> dict[int, dict]:
        """Per rank: process CPU seconds, worker busy seconds, tasks and batches so far, tasks
        queued now."""
        answers = self._ask_ranks("usage", {}, None, timeout_s)
        return {r: (body["rank0"] if r == 0 else body) for r, body in sorted(answers.items())}

    def measure_block_costs(self, repeats: int = 5) -> dict[int, dict[int, float]]:
        """Per rank, the measured ms of one forward of each block it holds (one task, full
        window) on its own device."""
        timeout_s = self.cfg.startup_timeout_s
        answers = self._ask_ranks("measure", {"repeats": repeats}, repeats, timeout_s)
        out = {0: answers.pop(0)["rank0"]}
        for r, body in answers.items():
            out[r] = {int(b): float(ms) for b, ms in body["block_ms"]}
        return out

    def balanced_layout(
        self, block_ms: dict[int, float] | None = None, *, hop_ms: float = 0.0
    ) -> Layout:
        """Contiguous layout over every rank minimising the slowest rank's work per chunk for
        per-block costs ``block_ms`` (default: measured now on the ranks, median per block
        over the ranks that hold it). Load the blocks it needs with ``load_blocks``."""
        K, L = self.cfg.steps, self.model_cfg.num_blocks
        if block_ms is None:
            per_block: dict[int, list[float]] = {}
            for costs in self.measure_block_costs().values():
                for blk, ms in costs.items():
                    per_block.setdefault(blk, []).append(ms)
            missing = sorted(set(range(L)) - set(per_block))
            if missing:
                raise RuntimeError(f"no rank holds blocks {missing} to measure")
            block_ms = {blk: float(np.median(v)) for blk, v in per_block.items()}
            self.measured_block_ms = dict(block_ms)
        stage_ms = stage_costs(K, block_ms)
        layout = layout_balanced(K, L, self.world_size, stage_ms, hop_ms=hop_ms)
        log.info(
            "balanced layout %s: slowest rank %.2f ms per chunk (block ms %s)",
            layout,
            slowest_rank_ms(layout, stage_ms, hop_ms=hop_ms),
            block_ms,
        )
        return layout

    def load_blocks(self, layout: Layout) -> None:
        """Make every rank hold the blocks of its stages under ``layout`` (ranks build or load
        the missing ones; those ranks pause for that time)."""
        validate_layout(layout, self.cfg.steps, self.model_cfg.num_blocks, self.world_size)
        needed: dict[int, set[int]] = {}
        for row in layout:
            for blk, r in enumerate(row):
                needed.setdefault(r, set()).add(blk)
        short = {r: sorted(b - self.rank_blocks[r]) for r, b in needed.items()}
        short = {r: b for r, b in short.items() if b}
        if not short:
            return
        with self._ask_lock:
            self._load_blocks_locked(short)

    def _load_blocks_locked(self, short: dict[int, list[int]]) -> None:
        for r in short:
            if r in self.failed_ranks:
                raise RuntimeError(f"rank {r} has failed: {self.failed_ranks[r]}")
        bodies = {r: {"blocks": blocks} for r, blocks in short.items() if r != 0}
        answers = self._ask_locked(
            "load", bodies, short.get(0), self.cfg.startup_timeout_s, rank0=0 in short
        )
        with self._lock:
            for r, body in answers.items():
                self.rank_blocks[r] = set(body["rank0"] if r == 0 else body["blocks"])
