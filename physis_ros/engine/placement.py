"""Placement: stages (k, l) of each stream -> virtual ranks -> worker ranks.

A *layout* is a K x L grid of worker ranks for one stream. A virtual rank is a maximal run of
consecutive stages (pipeline order k*L + l) of one stream on one worker, together with their
KV caches: the unit that is placed. The sink (``step == K``: finished chunks) is a rank too.
Layouts are plain tuples so that every rank can build the same placement from the same
arguments; ``str(placement)`` prints the table.
"""

from __future__ import annotations

from dataclasses import dataclass, field

Layout = tuple[tuple[int, ...], ...]
"""layout[k][l] = worker rank of stage (k, l)."""


@dataclass(frozen=True)
class VirtualRank:
    stream_id: int
    worker: int
    stages: tuple[tuple[int, int], ...]
    """(k, l) stages in pipeline order."""


def _check(steps: int, blocks: int, workers: int) -> None:
    if steps < 1 or blocks < 1:
        raise ValueError(f"need steps >= 1 and blocks >= 1, got K={steps} L={blocks}")
    if workers < 1:
        raise ValueError(f"need at least one worker, got {workers}")


def layout_single(steps: int, blocks: int, rank: int = 0) -> Layout:
    """Every stage on one worker."""
    _check(steps, blocks, 1)
    return tuple(tuple(rank for _ in range(blocks)) for _ in range(steps))


def layout_groups(steps: int, blocks: int, sizes: list[int] | tuple[int, ...]) -> Layout:
    """Contiguous groups of stages in pipeline order; group i (``sizes[i]`` stages) on rank i."""
    _check(steps, blocks, len(sizes))
    if any(s < 1 for s in sizes) or sum(sizes) != steps * blocks:
        raise ValueError(
            f"group sizes {list(sizes)} must be >= 1 and sum to K*L = {steps * blocks}"
        )
    flat = [rank for rank, size in enumerate(sizes) for _ in range(size)]
    return tuple(tuple(flat[k * blocks : (k + 1) * blocks]) for k in range(steps))


def layout_even(steps: int, blocks: int, workers: int) -> Layout:
    """K*L stages in ``workers`` contiguous groups whose sizes differ by at most one."""
    _check(steps, blocks, workers)
    total = steps * blocks
    if workers > total:
        raise ValueError(f"{workers} workers but only {total} stages")
    base, extra = divmod(total, workers)
    return layout_groups(steps, blocks, [base + (i < extra) for i in range(workers)])


def layout_one_stage_per_worker(steps: int, blocks: int) -> Layout:
    """Stage (k, l) on rank k*L + l (K*L workers)."""
    return layout_groups(steps, blocks, [1] * (steps * blocks))


def layout_by_block(steps: int, blocks: int, sizes: list[int] | tuple[int, ...]) -> Layout:
    """Contiguous groups of *blocks*, each worker holding its blocks at every step (so each
    block's weights live on one worker; needed by ``sequential-clean``, whose caches are
    shared by all steps of a block)."""
    _check(steps, blocks, len(sizes))
    if any(s < 1 for s in sizes) or sum(sizes) != blocks:
        raise ValueError(f"block group sizes {list(sizes)} must be >= 1 and sum to L = {blocks}")
    row = tuple(rank for rank, size in enumerate(sizes) for _ in range(size))
    return tuple(row for _ in range(steps))


def layout_by_block_even(steps: int, blocks: int, workers: int) -> Layout:
    """``layout_by_block`` with the L blocks split as evenly as possible over ``workers``."""
    if workers > blocks:
        raise ValueError(f"{workers} workers but only {blocks} blocks to split")
    base, extra = divmod(blocks, workers)
    return layout_by_block(steps, blocks, [base + (i < extra) for i in range(workers)])


def validate_layout(layout: Layout, steps: int, blocks: int, workers: int) -> None:
    if len(layout) != steps or any(len(row) != blocks for row in layout):
        raise ValueError(f"layout is not {steps}x{blocks}")
    bad = {r for row in layout for r in row if not 0 <= r < workers}
    if bad:
        raise ValueError(f"layout names ranks {sorted(bad)} outside 0..{workers - 1}")


def blocks_share_worker(layout: Layout) -> bool:
    """True when every block's stages (all k) sit on one worker."""
    return all(len({row[blk] for row in layout}) == 1 for blk in range(len(layout[0])))


@dataclass(frozen=True)
class Placement:
    """Which worker runs each stage of each stream, and where finished chunks go."""

    steps: int
    blocks: int
    num_workers: int
    layouts: dict[int, Layout] = field(default_factory=dict)
    """stream_id -> layout."""
    sink_rank: int = 0

    def __post_init__(self) -> None:
        _check(self.steps, self.blocks, self.num_workers)
        if not 0 <= self.sink_rank < self.num_workers:
            raise ValueError(f"sink_rank {self.sink_rank} outside 0..{self.num_workers - 1}")
        for layout in self.layouts.values():
            validate_layout(layout, self.steps, self.blocks, self.num_workers)

    @classmethod
    def uniform(
        cls,
        layout: Layout,
        streams: list[int] | tuple[int, ...] = (0,),
        *,
        num_workers: int | None = None,
        sink_rank: int = 0,
    ) -> Placement:
        """Every stream in ``streams`` with the same layout."""
        workers = (
            num_workers if num_workers is not None else 1 + max(r for row in layout for r in row)
        )
        return cls(
            steps=len(layout),
            blocks=len(layout[0]),
            num_workers=workers,
            layouts={s: layout for s in streams},
            sink_rank=sink_rank,
        )

    @classmethod
    def single(cls, steps: int, blocks: int, streams=(0,)) -> Placement:
        return cls.uniform(layout_single(steps, blocks), streams)

    @classmethod
    def one_stage_per_worker(cls, steps: int, blocks: int, streams=(0,)) -> Placement:
        return cls.uniform(layout_one_stage_per_worker(steps, blocks), streams)

    @classmethod
    def even(cls, steps: int, blocks: int, workers: int, streams=(0,)) -> Placement:
        return cls.uniform(layout_even(steps, blocks, workers), streams)

    @classmethod
    def groups(cls, steps: int, blocks: int, sizes, streams=(0,)) -> Placement:
        return cls.uniform(layout_groups(steps, blocks, sizes), streams)

    @classmethod
    def by_block(cls, steps: int, blocks: int, sizes, streams=(0,)) -> Placement:
        return cls.uniform(layout_by_block(steps, blocks, sizes), streams)

    def with_stream(self, stream_id: int, layout: Layout) -> Placement:
        if stream_id in self.layouts:
            raise ValueError(f"stream {stream_id} is already placed")
        validate_layout(layout, self.steps, self.blocks, self.num_workers)
        layouts = dict(self.layouts)
        layouts[stream_id] = layout
        return Placement(
            steps=self.steps,
            blocks=self.blocks,
            num_workers=self.num_workers,
            layouts=layouts,
            sink_rank=self.sink_rank,
        )

    def without_stream(self, stream_id: int) -> Placement:
        layouts = {s: v for s, v in self.layouts.items() if s != stream_id}
        return Placement(
            steps=self.steps,
            blocks=self.blocks,
            num_workers=self.num_workers,
            layouts=layouts,
            sink_rank=self.sink_rank,
        )

    def worker_of(self, stream_id: int, step: int, block: int) -> int:
        """Rank that runs stage (step, block) of the stream; the sink rank for step == K."""
        if step == self.steps:
            return self.sink_rank
        return self.layouts[stream_id][step][block]

    def entry_rank(self, stream_id: int) -> int:
        """Where a controller sends new chunks: the owner of stage (0, 0)."""
        return self.layouts[stream_id][0][0]

    def stages_on(self, rank: int) -> list[tuple[int, int, int]]:
        """(stream, k, l) of every stage placed on ``rank``."""
        return [
            (s, k, blk)
            for s, lay in sorted(self.layouts.items())
            for k in range(self.steps)
            for blk in range(self.blocks)
            if lay[k][blk] == rank
        ]

    def blocks_on(self, rank: int) -> set[int]:
        """Blocks whose weights ``rank`` must hold (loaded once for every k)."""
        return {blk for _, _, blk in self.stages_on(rank)}

    def virtual_ranks(self) -> list[VirtualRank]:
        out: list[VirtualRank] = []
        for s, lay in sorted(self.layouts.items()):
            run: list[tuple[int, int]] = []
            for i in range(self.steps * self.blocks):
                k, blk = divmod(i, self.blocks)
                if run and lay[run[-1][0]][run[-1][1]] != lay[k][blk]:
                    out.append(VirtualRank(s, lay[run[0][0]][run[0][1]], tuple(run)))
                    run = []
                run.append((k, blk))
            out.append(VirtualRank(s, lay[run[0][0]][run[0][1]], tuple(run)))
        return out

    def __str__(self) -> str:
        lines = [
            f"Placement: K={self.steps} L={self.blocks} workers={self.num_workers} "
            f"sink=rank {self.sink_rank}"
        ]
        for vr in self.virtual_ranks():
            (k0, l0), (k1, l1) = vr.stages[0], vr.stages[-1]
            lines.append(
                f"  stream {vr.stream_id}: stages ({k0},{l0})..({k1},{l1}) "
                f"[{len(vr.stages)}] -> worker {vr.worker}"
            )
        return "\n".join(lines)


def stage_costs(steps: int, block_ms: dict[int, float] | list[float]) -> list[float]:
    """Per-stage cost (ms) in pipeline order k*L + l from per-block costs (a stage (k, l)
    costs what block l costs; block 0 includes the embedding, block L-1 the head)."""
    costs = [block_ms[blk] for blk in range(len(block_ms))]
    if any(not c >= 0 for c in costs):
        raise ValueError(f"block costs must be >= 0, got {costs}")
    return costs * steps


def _greedy_groups(stage_ms: list[float], limit: float, hop_ms: float) -> list[int] | None:
    """Fewest contiguous groups with cost + hop_ms <= limit each (None: a stage alone is over)."""
    sizes, load = [], 0.0
    for c in stage_ms:
        if c + hop_ms > limit:
            return None
        if sizes and load + c + hop_ms <= limit:
            sizes[-1] += 1
            load += c
        else:
            sizes.append(1)
            load = c
    return sizes


def balanced_group_sizes(
    stage_ms: list[float] | tuple[float, ...], workers: int, *, hop_ms: float = 0.0
) -> list[int]:
    """Split stages (pipeline order) into at most ``workers`` contiguous groups minimising the
    slowest group's work per chunk, ``sum(stage_ms in group) + hop_ms`` (each group takes in
    one activation hop per chunk). Uses every worker when there are enough stages (splitting
    never raises the slowest group). Exact up to float round-off (binary search on the limit
    with a greedy feasibility test, then a final greedy pass)."""
    costs = [float(c) for c in stage_ms]
    if not costs:
        raise ValueError("no stages to place")
    if workers < 1:
        raise ValueError(f"need at least one worker, got {workers}")
    if any(not c >= 0 for c in costs) or not hop_ms >= 0:
        raise ValueError(f"costs must be >= 0, got stages {costs} and hop_ms {hop_ms}")
    lo, hi = max(costs) + hop_ms, sum(costs) + hop_ms
    for _ in range(100):
        if hi - lo <= 1e-12 * max(hi, 1.0):
            break
        mid = (lo + hi) / 2
        sizes = _greedy_groups(costs, mid, hop_ms)
        if sizes is not None and len(sizes) <= workers:
            hi = mid
        else:
            lo = mid
    sizes = _greedy_groups(costs, hi, hop_ms)
    if sizes is None or len(sizes) > workers:  # cannot happen: hi is feasible by construction
        raise RuntimeError(f"no partition of {costs} into {workers} groups under {hi} ms")
    # Use the idle workers too: split the costliest splittable group at its best point.
    while len(sizes) < min(workers, len(costs)):
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        loads = [sum(costs[s : s + n]) for s, n in zip(starts, sizes, strict=True)]
        i = max((j for j in range(len(sizes)) if sizes[j] > 1), key=lambda j: loads[j])
        part = costs[starts[i] : starts[i] + sizes[i]]
        cut = min(range(1, len(part)), key=lambda m: max(sum(part[:m]), sum(part[m:])))
        sizes[i : i + 1] = [cut, len(part) - cut]
    return sizes


def layout_balanced(
    steps: int,
    blocks: int,
    workers: int,
    stage_ms: list[float] | tuple[float, ...],
    *,
    hop_ms: float = 0.0,
) -> Layout:
    """The contiguous layout (group i on rank i) of ``balanced_group_sizes``: stages with
    measured costs ``stage_ms`` (K*L, pipeline order) balanced over ``workers`` ranks."""
    if len(stage_ms) != steps * blocks:
        raise ValueError(f"{len(stage_ms)} stage costs for K*L = {steps * blocks} stages")
    return layout_groups(steps, blocks, balanced_group_sizes(stage_ms, workers, hop_ms=hop_ms))


def slowest_rank_ms(layout: Layout, stage_ms: list[float], *, hop_ms: float = 0.0) -> float:
    """Predicted interval of one stream: the busiest rank's stage cost per chunk plus one hop
    per virtual rank it hosts (``hop_ms`` per hop taken in)."""
    blocks = len(layout[0])
    work: dict[int, float] = {}
    runs: dict[int, int] = {}
    prev = None
    for i, cost in enumerate(stage_ms):
        rank = layout[i // blocks][i % blocks]
        work[rank] = work.get(rank, 0.0) + cost
        if rank != prev:
            runs[rank] = runs.get(rank, 0) + 1
        prev = rank
    return max(work[r] + hop_ms * runs[r] for r in work)
