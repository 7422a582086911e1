"""One batched block forward over tasks that share a block's weights, with per-task KV rings.

What belongs here: the KV ring of one (stream, stage), the ``StageTask`` a worker hands to
``run_block``, the small caches that keep per-task Python work off the hot path (RoPE tables
per chunk, timestep embeddings per step), and ``measure_block_ms`` (per-block cost for the
benchmark and for the pool's cost model). Scheduling lives in ``worker.py``.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from physis_ros.engine import model as M
from physis_ros.engine.devcopy import to_device
from physis_ros.engine.fused import fused_blocks
from physis_ros.engine.model import WanDiT


class KVRing:
    """Rotated K and V of one stream at one stage: R = W + h entries of n tokens each, entry
    ``s % R`` holding time slot s (h: the stream's horizon, 1 when it has none).

    A chunk of slot c attends to slots c-W..c. Chunks run at a stage in the order they were
    released, and an observed chunk overwrites the entry its slot's prediction left: every
    chunk released later is anchored at or after it and reads the observed version, every
    one released before it has already run here (DESIGN.md §3, live streams). R = W + h keeps
    an entry until no chunk that can still come reads it. With R = W + 1 the window is the
    whole ring (attention does not care about the order of keys), so no copy and no mask;
    with R > W + 1 it is a contiguous view, or two pieces joined when it wraps around.
    """

    def __init__(  # noqa: PLR0917
        self,
        window: int,
        heads: int,
        tokens: int,
        head_dim: int,
        device: torch.device | str,
        dtype: torch.dtype,
        horizon: int = 1,
    ) -> None:
        self.window = window
        self.entries = window + max(horizon, 1)
        self.tokens = tokens
        self.k = torch.zeros(heads, self.entries * tokens, head_dim, device=device, dtype=dtype)
        self.v = torch.zeros_like(self.k)
        self.slot = [-1] * self.entries
        """The slot each entry holds (-1: none yet)."""
        self.observed = [False] * self.entries
        """Whether it holds that slot's observed version."""

    def write(
        self, slot: int, k: torch.Tensor, v: torch.Tensor, *, observed: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v [H, n, d] of slot ``slot`` -> keys/values it attends to [H, m*n, d]."""
        k_entry, v_entry = self.reserve(slot, observed=observed)
        k_entry.copy_(k)
        v_entry.copy_(v)
        return self.attended(slot)

    def reserve(self, slot: int, *, observed: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """The entry of ``slot``, k and v [H, n, d] views for the caller to fill (``write``
        without a copy; then ``attended``), marked as holding that slot's version."""
        n, e = self.tokens, slot % self.entries
        self.slot[e], self.observed[e] = slot, observed
        return self.k[:, e * n : (e + 1) * n], self.v[:, e * n : (e + 1) * n]

    def attended(self, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys/values [H, m*n, d] a chunk of ``slot`` attends to: slots slot-W..slot."""
        n, r = self.tokens, self.entries
        e = slot % r
        first = max(0, slot - self.window)
        if slot - first + 1 == r:  # the window is the whole ring
            return self.k, self.v
        lo = first % r
        if lo <= e:
            return self.k[:, lo * n : (e + 1) * n], self.v[:, lo * n : (e + 1) * n]
        keys = (self.k[:, lo * n :], self.k[:, : (e + 1) * n])
        values = (self.v[:, lo * n :], self.v[:, : (e + 1) * n])
        return torch.cat(keys, 1), torch.cat(values, 1)

    def check_history(self, slot: int, anchor: int) -> None:
        """Raise unless every slot slot-W..slot-1 is here, observed only if <= ``anchor``:
        the history a chunk anchored at ``anchor`` must read (catches an order or size bug)."""
        for s in range(max(0, slot - self.window), slot):
            e = s % self.entries
            if self.slot[e] != s or (self.observed[e] and s > anchor):
                held = "observed" if self.observed[e] else "predicted"
                raise RuntimeError(
                    f"slot {slot} (anchor {anchor}) needs slot {s}; the ring holds "
                    f"{held} slot {self.slot[e]} there"
                )

    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()


@dataclass
class StageTask:
    """One chunk of one stream at stage (step, block), with what the forward needs."""

    chunk: int
    """The chunk's time slot (RoPE position, KV ring entry)."""
    step: int
    sigma: float
    """Noise level it enters the block at (0 for a clean context chunk)."""
    x: torch.Tensor
    """[X] float32 on the worker's device (a noised observation's noised state at block 0)."""
    h: torch.Tensor | None
    """[n, D] entering the block (None at block 0)."""
    ring: KVRing
    observed: bool
    """Its K/V are its slot's observed version (else the predicted one)."""
    cross_k: torch.Tensor
    """[H, Lt, d] cached cross-attention keys of the stream at this block."""
    cross_v: torch.Tensor


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
                self._rope.clear()  # then every chunk of this batch is computed again
                missing = sorted(set(chunks))
            # on the CPU, then one asynchronous copy: no host synchronisation per chunk
            freqs = to_device(M.rope_freqs(self.model, torch.tensor(missing)), self.model.device)
            for i, c in enumerate(missing):
                self._rope[c] = freqs[i]
        if len(chunks) == 1:
            return self._rope[chunks[0]][None]
        return torch.stack([self._rope[c] for c in chunks])

    def time(self, tasks: list[StageTask], xs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """e [B, D], e0 [B, 6, D] of each task at its noise level."""
        sig = [t.sigma for t in tasks]
        if self.model.cfg.action_mode == "condition":  # depends on each chunk's actions
            return M.time_embed(self.model, to_device(torch.tensor(sig), xs.device), xs)
        for s in set(sig):
            if s not in self._time:
                e, e0 = M.time_embed(self.model, to_device(torch.tensor([s]), xs.device))
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
        h = M.embed_tokens(model, xs)
    else:
        h = tasks[0].h[None] if len(tasks) == 1 else torch.stack([t.h for t in tasks])
    rope = caches.rope([t.chunk for t in tasks])
    fused = fused_blocks(model)
    if fused is not None:  # engine/fused.py: the same math in fewer passes
        h = fused.forward(block, h, e0, rope, tasks)
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

    h = M.block_forward(model, block, h[:, None], e0[:, None], rope[:, None], ck, cv, attend)[:, 0]
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
        return M.head_velocity(model, h, e)
    sig = to_device(torch.tensor([t.sigma for t in tasks]), xs.device)
    return M.head_velocity(model, h, e, xs, sig)


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
    ctx = M.embed_cond(model, M.make_cond(cfg, 0))
    ck, cv = M.cross_kv(model, block, ctx)
    gen = torch.Generator().manual_seed(0)
    ring_gen = torch.Generator(device=dev).manual_seed(1)
    tasks = []
    for hist in history_chunks:
        ring = KVRing(win, cfg.num_heads, cfg.tokens_per_chunk, cfg.head_dim, dev, dt)
        ring.k.normal_(generator=ring_gen)  # never time on zeros: GPUs run faster on them
        ring.v.normal_(generator=ring_gen)
        h = torch.randn(cfg.tokens_per_chunk, cfg.dim, generator=gen).to(dev, dt)
        x = torch.randn(M.chunk_numel(cfg), generator=gen).to(dev)
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
