"""Pool-level placement of one stream: which device runs each of its K*L stages.

Stage index ``i = k * L + l`` follows the pipeline order a chunk travels: (0, 0) .. (0, L-1),
(1, 0) .. (K-1, L-1). A chunk hops from device to device only where consecutive stages sit on
different devices. This is the object the admission controller produces, the simulator runs
and the memory model charges; it names devices, not engine workers.
"""

from __future__ import annotations

from dataclasses import dataclass

from physis_ros.engine.config import ModelConfig, SamplerConfig


def check_chunks(chunks_per_interval: int, rollout: int) -> None:
    """Chunks per interval: the generated ones (``rollout`` >= 1) and at most one context."""
    if not 1 <= rollout <= chunks_per_interval <= rollout + 1:
        raise ValueError(
            f"chunks_per_interval {chunks_per_interval} must be rollout {rollout} (>= 1), "
            "plus 1 with a context chunk"
        )


@dataclass(frozen=True, kw_only=True)
class StreamPlan:
    """One admitted (or candidate) stream and where its stages run."""

    stream_id: int
    model: ModelConfig
    sampler: SamplerConfig
    target_interval_ms: float
    """Interval the stream needs between chunks; 0: as fast as its devices allow."""
    stage_devices: tuple[int, ...]
    """Device of stage i = k * L + l, length K * L."""
    chunks_per_interval: int = 1
    """Chunks that pass every stage per target interval: 1, or 2 when each generated chunk
    comes with an observation (a context chunk) that passes them too, 1 + h for a rollout
    of h with its observation."""
    rollout: int = 1
    """Generated chunks per target interval, released together (see ``chunks_per_interval``)."""

    def __post_init__(self) -> None:
        check_chunks(self.chunks_per_interval, self.rollout)
        want = self.sampler.steps * self.model.num_blocks
        if len(self.stage_devices) != want:
            raise ValueError(
                f"stage_devices has {len(self.stage_devices)} entries, the stream has {want} "
                f"stages (K={self.sampler.steps} x L={self.model.num_blocks})"
            )
        if self.target_interval_ms < 0:
            raise ValueError(f"target_interval_ms must be >= 0, got {self.target_interval_ms}")
        if any(d < 0 for d in self.stage_devices):
            raise ValueError("device indices must be >= 0")

    @property
    def num_stages(self) -> int:
        return len(self.stage_devices)

    def block_of(self, stage: int) -> int:
        return stage % self.model.num_blocks

    def devices(self) -> list[int]:
        """Devices the stream uses, in first-visit order."""
        seen: dict[int, None] = {}
        for d in self.stage_devices:
            seen.setdefault(d, None)
        return list(seen)

    def stages_on(self, device: int) -> list[int]:
        return [i for i, d in enumerate(self.stage_devices) if d == device]

    def hops(self) -> list[tuple[int, int, int]]:
        """(stage sending, src device, dst device) for every device change along the path."""
        sd = self.stage_devices
        return [(i, sd[i], sd[i + 1]) for i in range(len(sd) - 1) if sd[i] != sd[i + 1]]

    def describe(self) -> str:
        """Segments like ``d0[(0,0)-(1,9)] -> d1[(1,10)-(3,39)]``."""
        L = self.model.num_blocks
        parts, start = [], 0
        sd = self.stage_devices
        for i in range(1, len(sd) + 1):
            if i == len(sd) or sd[i] != sd[start]:
                a, b = divmod(start, L), divmod(i - 1, L)
                parts.append(f"d{sd[start]}[({a[0]},{a[1]})-({b[0]},{b[1]})]")
                start = i
        return " -> ".join(parts)


def contiguous_split(num_stages: int, devices: list[int]) -> tuple[int, ...]:
    """Stages in pipeline order cut into len(devices) nearly equal contiguous runs."""
    g = len(devices)
    return tuple(devices[i * g // num_stages] for i in range(num_stages))


def block_split(steps: int, num_blocks: int, devices: list[int]) -> tuple[int, ...]:
    """Device j holds blocks [j*L/g, (j+1)*L/g) at every step: each block's weights on one
    device only, at the price of g hops per step."""
    g = len(devices)
    return tuple(devices[b * g // num_blocks] for _ in range(steps) for b in range(num_blocks))


def plan_for(
    stream_id: int,
    model: ModelConfig,
    sampler: SamplerConfig,
    target_interval_ms: float,
    stage_devices: tuple[int, ...],
) -> StreamPlan:
    return StreamPlan(
        stream_id=stream_id,
        model=model,
        sampler=sampler,
        target_interval_ms=target_interval_ms,
        stage_devices=stage_devices,
    )
