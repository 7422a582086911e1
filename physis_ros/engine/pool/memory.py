"""Memory model: what a device holds for the stages placed on it.

Per device:
- weights: each block ``l`` of a model hosted there, once, however many steps and streams
  use it; plus the model's embed / time / head parameters where block 0 or L-1 lives;
- KV slots: per (stream, stage) a ring of W chunks x N tokens x (K, V) x D;
- cross-attention cache: per (stream, block) the K/V of the text_len conditioning tokens
  (they depend on the block and the stream's conditioning, not on the step);
- receive buffers: per stream and inbound hop, two activation buffers (double buffering);
- workspace: the live intermediates of the largest batched forward (``max_batch`` tasks;
  flash attention, so no N x N score matrix).

``device_usage`` computes a device's bytes from scratch; the admission controller adds
stages incrementally with ``StageCharge`` and checks its sum against it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from physis_ros.engine.config import ModelConfig, SamplerConfig
from physis_ros.engine.pool.costmodel import GIB, activation_bytes
from physis_ros.engine.pool.plan import StreamPlan


@dataclass(frozen=True, kw_only=True)
class MemoryUsage:
    weights: int = 0
    kv: int = 0
    cross_kv: int = 0
    buffers: int = 0
    workspace: int = 0

    @property
    def total(self) -> int:
        return self.weights + self.kv + self.cross_kv + self.buffers + self.workspace

    def gib(self) -> dict[str, float]:
        return {
            "weights_gib": round(self.weights / GIB, 3),
            "kv_gib": round(self.kv / GIB, 3),
            "cross_kv_gib": round(self.cross_kv / GIB, 3),
            "buffers_gib": round(self.buffers / GIB, 3),
            "workspace_gib": round(self.workspace / GIB, 3),
            "total_gib": round(self.total / GIB, 3),
        }


@dataclass(frozen=True, kw_only=True)
class MemoryModel:
    dtype_bytes: int = 2
    """Bytes per weight, activation and KV element."""
    max_batch: int = 8
    """Most tasks one batched forward takes (sizes the workspace)."""

    def __post_init__(self) -> None:
        if self.dtype_bytes not in (1, 2, 4):
            raise ValueError(f"dtype_bytes must be 1, 2 or 4, got {self.dtype_bytes}")
        if self.max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {self.max_batch}")

    def block_weight_bytes(self, cfg: ModelConfig) -> int:
        return cfg.block_params() * self.dtype_bytes

    def edge_weight_bytes(self, cfg: ModelConfig) -> int:
        """Embed, time embedding and output head: held where block 0 or block L-1 runs."""
        return (cfg.num_params() - cfg.num_blocks * cfg.block_params()) * self.dtype_bytes

    def stage_kv_bytes(self, cfg: ModelConfig, sampler: SamplerConfig) -> int:
        return sampler.window * cfg.tokens_per_chunk * 2 * cfg.dim * self.dtype_bytes

    def cross_kv_bytes(self, cfg: ModelConfig) -> int:
        return cfg.text_len * 2 * cfg.dim * self.dtype_bytes

    def recv_buffer_bytes(self, cfg: ModelConfig) -> int:
        return 2 * activation_bytes(cfg, self.dtype_bytes)

    def workspace_bytes(self, cfg: ModelConfig) -> int:
        n, d, f = cfg.tokens_per_chunk, cfg.dim, cfg.ffn_dim
        return self.max_batch * n * (4 * d + f) * self.dtype_bytes

    def device_usage(self, plans: Iterable[StreamPlan], device: int) -> MemoryUsage:
        """Bytes ``device`` holds for ``plans``, computed from scratch."""
        blocks: set[tuple[str, int]] = set()
        edges: set[str] = set()
        models: dict[str, ModelConfig] = {}
        kv = cross = buffers = 0
        for plan in plans:
            cfg, L = plan.model, plan.model.num_blocks
            stages = plan.stages_on(device)
            if not stages:
                continue
            models[cfg.name] = cfg
            stream_blocks = {i % L for i in stages}
            blocks.update((cfg.name, b) for b in stream_blocks)
            if 0 in stream_blocks or L - 1 in stream_blocks:
                edges.add(cfg.name)
            kv += len(stages) * self.stage_kv_bytes(cfg, plan.sampler)
            cross += len(stream_blocks) * self.cross_kv_bytes(cfg)
            inbound = sum(1 for _, _, dst in plan.hops() if dst == device)
            buffers += inbound * self.recv_buffer_bytes(cfg)
        weights = sum(self.block_weight_bytes(models[name]) for name, _ in blocks)
        weights += sum(self.edge_weight_bytes(models[name]) for name in edges)
        workspace = max((self.workspace_bytes(c) for c in models.values()), default=0)
        return MemoryUsage(
            weights=weights, kv=kv, cross_kv=cross, buffers=buffers, workspace=workspace
        )


class StageCharge:
    """Incremental bytes of adding one new stream's stages to one device, stage by stage.

    Knows what the device already holds (weights, workspace) so weights shared with other
    streams are not charged twice.
    """

    def __init__(
        self,
        *,
        mem: MemoryModel,
        cfg: ModelConfig,
        sampler: SamplerConfig,
        held_blocks: set[tuple[str, int]],
        held_edges: set[str],
        workspace_now: int,
    ) -> None:
        self.mem, self.cfg, self.sampler = mem, cfg, sampler
        self._held_blocks = set(held_blocks)
        self._held_edges = set(held_edges)
        self._stream_blocks: set[int] = set()
        self._workspace_now = workspace_now
        self.added = 0

    def clone(self) -> StageCharge:
        other = StageCharge(
            mem=self.mem,
            cfg=self.cfg,
            sampler=self.sampler,
            held_blocks=self._held_blocks,
            held_edges=self._held_edges,
            workspace_now=self._workspace_now,
        )
        other._stream_blocks = set(self._stream_blocks)
        other.added = self.added
        return other

    def holds(self, block: int) -> bool:
        """True when the block's weights are already on the device (no weight charge)."""
        return (self.cfg.name, block) in self._held_blocks

    def cost(self, stage: int, inbound_hop: bool) -> int:
        """Bytes this stage would add (without adding it)."""
        cfg, mem, L = self.cfg, self.mem, self.cfg.num_blocks
        block = stage % L
        extra = mem.stage_kv_bytes(cfg, self.sampler)
        if block not in self._stream_blocks:
            extra += mem.cross_kv_bytes(cfg)
        if (cfg.name, block) not in self._held_blocks:
            extra += mem.block_weight_bytes(cfg)
        if block in (0, L - 1) and cfg.name not in self._held_edges:
            extra += mem.edge_weight_bytes(cfg)
        if inbound_hop:
            extra += mem.recv_buffer_bytes(cfg)
        extra += max(0, mem.workspace_bytes(cfg) - self._workspace_now)
        return extra

    def add(self, stage: int, inbound_hop: bool) -> int:
        extra = self.cost(stage, inbound_hop)
        L = self.cfg.num_blocks
        block = stage % L
        self._stream_blocks.add(block)
        self._held_blocks.add((self.cfg.name, block))
        if block in (0, L - 1):
            self._held_edges.add(self.cfg.name)
        self._workspace_now = max(self._workspace_now, self.mem.workspace_bytes(self.cfg))
        self.added += extra
        return extra
