"""One stream's state on a worker, and placement changes of a running stream (``relayout``).

A worker holds, per open stream, the KV rings and cross-attention K/V of the stages placed on
it, the ticket that last ran at each stage, and the stream's placement epochs.

Placement changes of a running stream, without a barrier: the controller picks the first
ticket ``t*`` not yet released, bumps the stream's epoch and tells every worker
(``Worker.relayout(stream, epoch, t*, layout)``); chunks from ``t*`` on carry the new epoch and
are routed by the new layout, earlier ones by the old. A worker holds activations of an epoch
it has not heard of yet. The old owner of a moved stage sends that stage's KV ring to the new
owner right after running ticket ``t* - 1`` there (``FLAG_KV`` pieces: ``ring_messages``); the
new owner runs nothing at that stage before the ring is installed (``add_ring_piece``,
``install_ring``), and runs chunks at a stage strictly in ticket order (around a change they
may arrive from two senders out of order).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from physis_ros.engine.config import ModelConfig
from physis_ros.engine.kvring import KVRing
from physis_ros.engine.placement import Layout
from physis_ros.engine.sampler import chunk_numel
from physis_ros.engine.transport import FLAG_KV, FLAG_OBSERVED, Activation

Stage = tuple[int, int]
"""(step k, block l)."""


@dataclass
class StreamState:
    layout: Layout
    """Layout of the latest epoch."""
    history: str
    cond: torch.Tensor | None = None
    """The stream's raw conditioning tokens [n, text_dim] (padded when embedded)."""
    seed: int = 0
    """The stream seed (noise of observations under ``noised`` context)."""
    horizon: int = 1
    """Slots ahead of the newest observation the stream generates (sizes the KV rings)."""
    rings: dict[Stage, KVRing] = field(default_factory=dict)
    cross: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    last_ticket: dict[Stage, int] = field(default_factory=dict)
    """Per stage, the ticket of the last chunk that ran there."""
    epoch: int = 0
    epochs: list[tuple[int, Layout]] = field(default_factory=list)
    """(first ticket, layout) of every epoch, ascending."""
    held: list[Activation] = field(default_factory=list)
    """Activations of a later epoch than this worker knows."""
    pieces: dict[Stage, dict[int, Activation]] = field(default_factory=dict)
    ship: list[tuple[int, int, int, int]] = field(default_factory=list)
    """(k, l, after_ticket, dst): send the stage's ring to dst once after_ticket ran here."""

    def layout_for(self, ticket: int) -> Layout:
        for first, layout in reversed(self.epochs):
            if ticket >= first:
                return layout
        return self.epochs[0][1]

    def change_layout(
        self, stream_id: int, rank: int, epoch: int, first_ticket: int, layout: Layout
    ) -> list[int]:
        """Apply a placement change as seen from worker ``rank``: the stages it loses are due
        to ship after ticket ``first_ticket - 1``. Returns the blocks it gains that need the
        stream's cross-attention K/V (their rings arrive from the old owners)."""
        if self.history != "noisy":
            raise ValueError(f"stream {stream_id}: placement changes need noisy history")
        if epoch != self.epoch + 1 or first_ticket < self.epochs[-1][0]:
            raise ValueError(
                f"stream {stream_id}: relayout epoch {epoch} from ticket {first_ticket} does "
                f"not follow epoch {self.epoch} from ticket {self.epochs[-1][0]}"
            )
        old = self.layout
        self.epochs.append((first_ticket, layout))
        self.layout, self.epoch = layout, epoch
        # A stage runs here while this worker holds its ring (self.rings); a gained stage's
        # ring arrives from the old owner, a lost one leaves after ticket first_ticket - 1.
        gained: dict[int, None] = {}
        for k, (was_row, now_row) in enumerate(zip(old, layout, strict=True)):
            for blk, (was_rank, now_rank) in enumerate(zip(was_row, now_row, strict=True)):
                was, now = was_rank == rank, now_rank == rank
                if was and not now:
                    self.ship.append((k, blk, first_ticket - 1, now_rank))
                elif now and not was and blk not in self.cross:
                    gained[blk] = None
        return list(gained)

    def take_due_rings(self) -> list[tuple[Stage, KVRing, int]]:
        """(stage, ring, destination) of every ring whose stage has run the last chunk it runs
        here, each removed from this worker's rings."""
        keep, due = [], []
        for k, blk, after, dst in self.ship:
            held_here = (k, blk) in self.rings and not any(o[:2] == (k, blk) for o in keep)
            if not held_here or self.last_ticket.get((k, blk), -1) < after:
                keep.append((k, blk, after, dst))
                continue
            due.append(((k, blk), self.rings.pop((k, blk)), dst))
        self.ship = keep
        return due

    def ring_messages(
        self, stream_id: int, stage: Stage, ring: KVRing, cfg: ModelConfig
    ) -> list[Activation]:
        """``ring`` of ``stage`` as ``FLAG_KV`` activations: one [N, D]-shaped piece per entry of
        K, then of V (what a transport already carries), each naming the slot the entry holds
        and whether that is the observed version."""
        k, blk = stage
        n, dim, r = cfg.tokens_per_chunk, cfg.dim, ring.entries
        x = torch.zeros(chunk_numel(cfg), device=ring.k.device)
        last = self.last_ticket.get(stage, -1)
        out = []
        for i in range(2 * r):
            e = i % r
            buf = ring.k if i < r else ring.v
            flags = FLAG_KV | (FLAG_OBSERVED if ring.observed[e] else 0) | (i << 8)
            piece = buf[:, e * n : (e + 1) * n].reshape(n, dim)
            msg = Activation(stream_id, ring.slot[e], k, blk, flags, x, piece, ticket=last)
            msg.epoch = self.epoch
            out.append(msg)
        return out

    def add_ring_piece(self, msg: Activation, entries: int) -> list[Activation] | None:
        """Keep one ``FLAG_KV`` piece of a stage's ring; once all 2 * ``entries`` are here,
        they are returned in order (K of every entry, then V) and forgotten."""
        stage = (msg.step, msg.block)
        got = self.pieces.setdefault(stage, {})
        got[msg.flags >> 8] = msg
        if len(got) < 2 * entries:
            return None
        del self.pieces[stage]
        return [got[i] for i in range(2 * entries)]

    def install_ring(self, ring: KVRing, pieces: list[Activation], cfg: ModelConfig) -> None:
        """Fill ``ring`` from a stage's pieces (``add_ring_piece``) and run the stage here."""
        n, r = cfg.tokens_per_chunk, ring.entries
        shape = (cfg.num_heads, n, cfg.head_dim)
        dev, dt = ring.k.device, ring.k.dtype
        for e in range(r):
            ring.k[:, e * n : (e + 1) * n] = pieces[e].h.to(dev, dt).reshape(shape)
            ring.v[:, e * n : (e + 1) * n] = pieces[r + e].h.to(dev, dt).reshape(shape)
            ring.slot[e] = pieces[e].chunk
            ring.observed[e] = bool(pieces[e].flags & FLAG_OBSERVED)
        stage = (pieces[0].step, pieces[0].block)
        self.rings[stage] = ring
        self.last_ticket[stage] = pieces[-1].ticket
