"""One batched block forward over tasks that share a block's weights, with per-task KV rings.

What belongs here: ``run_block`` (the worker's hot path: eager through ``forward.block_forward``,
or the model's fused implementation, ``fused.py``), the small caches that keep per-task Python
work off the hot path (RoPE tables per chunk, timestep embeddings per step), and
``measure_block_ms`` (per-block cost for the benchmark and for the pool's cost model). The KV
ring and the task live in ``kvring.py``; scheduling in ``worker.py``.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F

from physis_ros.engine.devcopy import to_device
from physis_ros.engine.forward import (
    block_forward,
    cross_kv,
    embed_cond,
    embed_tokens,
    head_velocity,
    make_cond,
    rope_freqs,
    time_embed,
)
from physis_ros.engine.fused import fused_blocks
from physis_ros.engine.kvring import KVRing, StageTask
from physis_ros.engine.model import WanDiT
from physis_ros.engine.sampler import chunk_numel


class StageCaches:
    """RoPE tables per chunk and timestep embeddings per noise level, on one device.

    Both are pure functions of their keys; caching them removes a few small kernels per task."""

    def __init__(self, model: WanDiT, sigmas: list[float], max_chunks: int = 256) -> None:
        self.model = model
        self.sigmas = sigmas
        self.max_chunks = max_chunks
        self._rope: dict[int, torch.Tensor] = {}
        self._time: dict[float, tuple[torch.Tensor, torch.Tensor]] = {}

    def rope(self, chunks: list[int]) -> torch.Tensor:
        """[B, n, d/2] complex rotations."""
        missing = sorted({c for c in chunks if c not in self._rope})
        if missing:
            if len(self._rope) + len(missing) > self.max_chunks:
                # start over with this batch's chunks: cached ones it also needs included
                self._rope.clear()
                missing = sorted(set(chunks))
            # on the CPU, then one asynchronous copy: no host synchronisation per chunk
            freqs = to_device(rope_freqs(self.model, torch.tensor(missing)), self.model.device)
            for i, c in enumerate(missing):
                self._rope[c] = freqs[i]
        if len(chunks) == 1:
            return self._rope[chunks[0]][None]
        return torch.stack([self._rope[c] for c in chunks])

    def time(self, tasks: list[StageTask], xs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """e [B, D], e0 [B, 6, D] of each task at its noise level."""
        sig = [t.sigma for t in tasks]
        if self.model.cfg.action_mode == "condition":  # depends on each chunk's actions
            return time_embed(self.model, to_device(torch.tensor(sig), xs.device), xs)
        for s in set(sig):
            if s not in self._time:
                e, e0 = time_embed(self.model, to_device(torch.tensor([s]), xs.device))
                self._time[s] = (e[0], e0[0])
        if len(tasks) == 1:
            e, e0 = self._time[sig[0]]
            return e[None], e0[None]
        return (
            torch.stack([self._time[s][0] for s in sig]),
            torch.stack([self._time[s][1] for s in sig]),
        )


@torch.inference_mode()
def run_block(
    model: WanDiT, block: int, tasks: list[StageTask], caches: StageCaches
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Batched forward of ``tasks`` (distinct (stream, stage) each) through ``block``.

    Returns h [B, n, D], and at the last block v [B, X] float32 (else None). Weight GEMMs run
    on all B*n tokens at once; attention runs per task against its own KV ring."""
    xs = tasks[0].x[None] if len(tasks) == 1 else torch.stack([t.x for t in tasks])
    e, e0 = caches.time(tasks, xs)
    if block == 0:
        h = embed_tokens(model, xs)
    else:
        h = tasks[0].h[None] if len(tasks) == 1 else torch.stack([t.h for t in tasks])
    rope = caches.rope([t.chunk for t in tasks])
    fused = fused_blocks(model)
    if fused is not None:  # engine/fused.py: the same math in fewer passes (or its graphs)
        h = fused.run(block, h, e0, rope, tasks)
        return h, _head(model, block, tasks, caches, h, e, xs)
    if len(tasks) == 1:
        ck, cv = tasks[0].cross_k[None], tasks[0].cross_v[None]
    else:
        ck = torch.stack([t.cross_k for t in tasks])
        cv = torch.stack([t.cross_v for t in tasks])

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # q, k, v: [B, 1, n, H, d] -> per task [H, n, d] against its ring [H, m*n, d]
        outs = []
        for i, t in enumerate(tasks):
            kk, vv = t.ring.write(
                t.chunk, k[i, 0].transpose(0, 1), v[i, 0].transpose(0, 1), observed=t.observed
            )
            # 4-D inputs: 3-D ones fall back to the slow math kernel on the CPU
            qi = q[i, 0].transpose(0, 1)[None]
            outs.append(F.scaled_dot_product_attention(qi, kk[None], vv[None])[0])
        return torch.stack(outs).transpose(1, 2).unsqueeze(1)

    h = block_forward(model, block, h[:, None], e0[:, None], rope[:, None], ck, cv, attend)[:, 0]
    return h, _head(model, block, tasks, caches, h, e, xs)


def _head(  # noqa: PLR0917
    model: WanDiT,
    block: int,
    tasks: list[StageTask],
    caches: StageCaches,
    h: torch.Tensor,
    e: torch.Tensor,
    xs: torch.Tensor,
) -> torch.Tensor | None:
    """v [B, X] float32 after the last block, else None."""
    if block != model.cfg.num_blocks - 1:
        return None
    if model.cfg.prediction != "x0":  # the velocity head needs neither (no host-to-device copy)
        return head_velocity(model, h, e)
    sig = to_device(torch.tensor([t.sigma for t in tasks]), xs.device)
    return head_velocity(model, h, e, xs, sig)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class BlockTimer:
    """Times one batched forward of ``block`` for tasks whose KV rings hold
    ``history_chunks[i]`` previous chunks each (a batch of len(history_chunks) tasks).

    Measured through ``run_block`` (the worker's hot path), device synchronised. The rings
    are not advanced, so every sample sees the same composition; ``sample()`` can be
    interleaved with a run to see the same machine load."""

    def __init__(
        self,
        model: WanDiT,
        history_chunks: list[int],
        *,
        block: int | None = None,
        window: int | None = None,
    ) -> None:
        self.model = model
        self.block, self.tasks, self.caches = _timing_tasks(model, history_chunks, block, window)

    def sample(self) -> float:
        dev = self.model.device
        _sync(dev)
        t0 = time.perf_counter()
        run_block(self.model, self.block, self.tasks, self.caches)
        _sync(dev)
        return (time.perf_counter() - t0) * 1e3


def _timing_tasks(
    model: WanDiT, history_chunks: list[int], block: int | None, window: int | None
) -> tuple[int, list[StageTask], StageCaches]:
    cfg = model.cfg
    if block is None:  # a middle block: no embedding and no head in the number
        ids = sorted(model.block_ids)
        block = ids[len(ids) // 2] if len(ids) >= 3 else ids[0]
    if block not in model.block_ids:
        raise ValueError(f"model does not hold block {block}")
    if any(hc < 0 for hc in history_chunks) or not history_chunks:
        raise ValueError(
            f"history_chunks must be a non-empty list of counts >= 0, got {history_chunks}"
        )
    dev, dt = model.device, model.dtype
    win = max(history_chunks) if window is None else window
    caches = StageCaches(model, [1.0, 0.5, 0.0])
    ctx = embed_cond(model, make_cond(cfg, 0))
    ck, cv = cross_kv(model, block, ctx)
    gen = torch.Generator().manual_seed(0)
    ring_gen = torch.Generator(device=dev).manual_seed(1)
    tasks = []
    for hist in history_chunks:
        ring = KVRing(win, cfg.num_heads, cfg.tokens_per_chunk, cfg.head_dim, dev, dt)
        ring.k.normal_(generator=ring_gen)  # never time on zeros: GPUs run faster on them
        ring.v.normal_(generator=ring_gen)
        h = torch.randn(cfg.tokens_per_chunk, cfg.dim, generator=gen).to(dev, dt)
        x = torch.randn(chunk_numel(cfg), generator=gen).to(dev)
        tasks.append(
            StageTask(
                chunk=hist,
                step=0,
                sigma=1.0,
                x=x,
                h=None if block == 0 else h,
                ring=ring,
                observed=False,
                cross_k=ck,
                cross_v=cv,
            )
        )
    return block, tasks, caches


def time_block_forward(
    model: WanDiT,
    history_chunks: list[int],
    *,
    block: int | None = None,
    repeats: int = 20,
    warmup: int = 3,
    window: int | None = None,
) -> list[float]:
    """Wall times (ms) of ``repeats`` forwards (after ``warmup``): see ``BlockTimer``."""
    timer = BlockTimer(model, history_chunks, block=block, window=window)
    samples = [timer.sample() for _ in range(warmup + repeats)]
    return samples[warmup:]


def measure_block_ms(model: WanDiT, history_chunks: list[int], **kw) -> float:
    """Median ms of one batched block forward for this batch composition (see
    ``time_block_forward``): the cost model's per-block time."""
    return statistics.median(time_block_forward(model, history_chunks, **kw))
