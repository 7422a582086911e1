"""The KV ring of one (stream, stage), and the ``StageTask`` a worker hands to a block forward:
one chunk of one stream at one stage, with its ring and its stream's text K/V."""

from __future__ import annotations

from dataclasses import dataclass

import torch


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
        self.entries = self.entries_for(window, horizon)
        self.tokens = tokens
        self.k = torch.zeros(heads, self.entries * tokens, head_dim, device=device, dtype=dtype)
        self.v = torch.zeros_like(self.k)
        self.slot = [-1] * self.entries
        """The slot each entry holds (-1: none yet)."""
        self.observed = [False] * self.entries
        """Whether it holds that slot's observed version."""

    @staticmethod
    def entries_for(window: int, horizon: int) -> int:
        """R = W + h entries (h: the horizon, at least 1)."""
        return window + max(horizon, 1)

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
        n, e = self.tokens, self.take_entry(slot, observed=observed)
        return self.k[:, e * n : (e + 1) * n], self.v[:, e * n : (e + 1) * n]

    def take_entry(self, slot: int, *, observed: bool) -> int:
        """The entry ``slot`` goes to, marked as holding that version: the host-side half of
        ``reserve``, for a caller that writes the entry on the device (``block_graphs``)."""
        e = slot % self.entries
        self.slot[e], self.observed[e] = slot, observed
        return e

    def full(self, slot: int) -> bool:
        """A chunk of ``slot`` attends every entry (its own and W earlier slots fill the ring:
        a stream without a horizon beyond 1, past its first W chunks): the steady state, in
        which only the entry written depends on the chunk (``block_graphs``)."""
        return slot - max(0, slot - self.window) + 1 == self.entries

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
