"""The worker boundary: what moves between workers, and the interface that moves it.

A worker talks to other workers only through a ``Transport``. In one process that is
``InProcTransport`` (queues); across processes it is the torch.distributed transport in
``physis_ros.serve``. KV never moves between stages: a chunk's hidden state and latent do.
Only when a placement change moves a stage to another worker does that stage's KV ring go
with it, once, as ``FLAG_KV`` messages (one [N, D]-shaped piece each, see worker.py).
"""

from __future__ import annotations

import queue
import time
from dataclasses import dataclass, field
from typing import Protocol

import torch

FLAG_CONTEXT = 1
"""Set on a context chunk: an encoded observation clamped at sigma = 0, never updated."""
FLAG_KV = 2
"""Not a chunk: one piece of a stage's KV ring moving to the stage's new owner (``h`` is the
piece of one entry; piece index in bits 8.., ``chunk`` the slot that entry holds, ``ticket``
the last one that ran at the stage)."""
FLAG_OBSERVED = 4
"""On a KV ring piece: the entry holds its slot's observed version."""
FLAG_PREVIEWS = 8
"""On a generated chunk whose stream asked for previews: after every step but the last, the
worker of the step's last block sends the chunk's x0 estimate to the sink."""
FLAG_PREVIEW = 16
"""Not a chunk: the x0 estimate of chunk ``chunk`` after the steps in bits 24.. of ``flags``
(``preview_steps``), on its way to the sink like a finished chunk."""
PREVIEW_STEPS_SHIFT = 24


def preview_steps(flags: int) -> int:
    """Denoising steps done when a preview (``FLAG_PREVIEW``) was taken; 0: not a preview."""
    return (flags >> PREVIEW_STEPS_SHIFT) & 0xFF if flags & FLAG_PREVIEW else 0


@dataclass
class Activation:
    """One chunk of one stream on its way into stage (step, block).

    ``step == K`` (with ``block == 0``) addresses the sink: the chunk is fully denoised.
    Every field is an int, a float or a tensor of a shape fixed per stream, so a
    transport can send it as one int64 header plus pre-agreed tensor buffers.
    """

    stream_id: int
    chunk: int
    """The chunk's time slot: it covers camera frames [chunk*F, (chunk+1)*F) of the stream."""
    step: int
    """k of the destination stage (K: done, goes to the sink)."""
    block: int
    """l of the destination stage."""
    flags: int
    """Bit set of FLAG_* values."""
    x: torch.Tensor
    """[X] float32: the chunk's state x^(k), flattened (video latent tokens ++ action values)."""
    h: torch.Tensor | None
    """[N, D] hidden state entering ``block``; None when ``block == 0`` (the stage embeds x)."""
    created_s: float = field(default_factory=time.monotonic)
    """time.monotonic() when the chunk entered the pipeline (same host only)."""
    epoch: int = 0
    """Placement epoch of the stream when the chunk entered: a worker that does not know this
    epoch yet holds the activation until the controller's placement change reaches it."""
    ticket: int = 0
    """Release order within the stream (0, 1, 2, ...): every stage runs a stream's chunks in
    this order, which decides the version of each slot a chunk reads."""
    anchor: int = -1
    """The newest observed slot when the chunk was released (-1: none): it reads slots up to
    its anchor as observed, later ones as predicted. An observation's anchor is its own slot;
    a clean-history re-encoded output keeps its generated chunk's anchor."""

    @property
    def is_context(self) -> bool:
        """Enters every step clamped (not denoised): an observation or a re-encoded output."""
        return bool(self.flags & FLAG_CONTEXT)

    @property
    def observed(self) -> bool:
        """Its K/V are the slot's observed version (an observation, not a prediction)."""
        return self.is_context and self.anchor >= self.chunk


class Transport(Protocol):
    """Point-to-point delivery of activations between workers (ranks)."""

    rank: int
    world_size: int

    def send(self, dst: int, msg: Activation) -> None:
        """Queue ``msg`` for worker ``dst``; must not wait for the receiver."""

    def recv(self, timeout_s: float) -> list[Activation]:
        """Every activation that arrived for this worker; waits up to ``timeout_s`` for one."""


class InProcTransport:
    """Transport between workers that live in one process (threads or one event loop)."""

    def __init__(self, inboxes: list[queue.SimpleQueue], rank: int) -> None:
        self._inboxes = inboxes
        self.rank = rank
        self.world_size = len(inboxes)

    @classmethod
    def group(cls, world_size: int) -> list[InProcTransport]:
        """One connected transport per worker rank 0..world_size-1."""
        inboxes: list[queue.SimpleQueue] = [queue.SimpleQueue() for _ in range(world_size)]
        return [cls(inboxes, rank) for rank in range(world_size)]

    def send(self, dst: int, msg: Activation) -> None:
        self._inboxes[dst].put(msg)

    def recv(self, timeout_s: float) -> list[Activation]:
        inbox = self._inboxes[self.rank]
        out: list[Activation] = []
        try:
            out.append(inbox.get(timeout=timeout_s) if timeout_s > 0 else inbox.get_nowait())
        except queue.Empty:
            return out
        while True:
            try:
                out.append(inbox.get_nowait())
            except queue.Empty:
                return out
