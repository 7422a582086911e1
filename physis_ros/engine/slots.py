"""A served stream's camera frames -> observed chunks, one per time slot (DESIGN.md §3.1).

Frame n of a stream (n = seq - the seq of its first observation) belongs to slot n // F (F
frames per chunk), position n % F. A slot's observed chunk is complete when its last frame
arrives, or when a frame of a later slot arrives first: then it is completed with what it has
(counted ``incomplete_chunks``). A missing frame is filled with the nearest frame received (by
frame index; on a tie the earlier one), and so is every frame of a slot no frame arrived for
(both counted ``filled_frames``), so every slot up to the newest gets its observation, in slot
order. A jump of more than ``MAX_GAP_SLOTS`` slots (a robot that paused, a client that
renumbered) is not filled: the stream's timeline goes on at the next slot, the frames in
between counted as ``skipped_frames``. The chunk's commanded actions are those of its frames
(each frame's observation carries the command in force when it was captured), as training
lays them out. No torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from physis_ros.engine.wam_rows import CommandTimeline


@dataclass(frozen=True, kw_only=True)
class FrameIn:
    """One checked camera frame of a served stream, as the front end hands it to the core."""

    seq: int
    capture_stamp_ns: int
    """Robot clock."""
    send_stamp_ns: int
    """Robot clock."""
    received_ns: int
    """Server wall clock, after parsing and checking."""
    frames: np.ndarray
    """[1, H, W, 3] uint8: the observation's frame."""
    actions: np.ndarray | None
    """[H, A] float32 commanded actions, or None."""
    state: np.ndarray | None = None
    """[S] float32 proprioception at the capture (a world-action model's, contract order)."""
    commands: CommandTimeline | None = None
    """The robot's command timeline sent with it (a world-action model's)."""


MAX_GAP_SLOTS = 4
"""Whole slots a gap may span and still be filled; a longer one continues the timeline."""


@dataclass(frozen=True)
class ObservedChunk:
    """One slot's observation, ready for ``StreamEngine.submit_context(slot=...)``."""

    slot: int
    frames: np.ndarray
    """[F, H, W, 3] uint8."""
    actions: np.ndarray | None
    """[H, A] float32 commanded actions (None: no frame carried one)."""
    newest: FrameIn
    """The newest observation received for the slot (seq and stamps of replies)."""
    filled: int
    """Frames filled from a neighbour."""
    newest_frame: int = -1
    """Frame index of ``newest`` on the stream's timeline (slot * F + its position)."""
    state: np.ndarray | None = None
    """[F, S] float32 proprioception of each frame (None: the frames carry none)."""


class SlotAssembler:
    """Assigns a stream's checked observations to slots (one reader thread calls ``add``)."""

    def __init__(self, frames_per_chunk: int, action_horizon: int) -> None:
        if frames_per_chunk < 1:
            raise ValueError(f"frames_per_chunk must be >= 1, got {frames_per_chunk}")
        self.frames = frames_per_chunk
        self.action_horizon = action_horizon
        self.first_seq: int | None = None
        """Seq of the stream's first observation: frame 0 of its timeline."""
        self._slot: int | None = None
        self._have: dict[int, FrameIn] = {}
        """Position -> observation of the slot being assembled."""
        self._previous: tuple[int, FrameIn] | None = None
        """(frame index, observation) of the newest frame of the slots completed so far."""
        self._emitted = -1
        """The newest slot completed (an empty slot has no frame for ``_previous`` to hold)."""
        self.filled_frames = 0
        self.incomplete_chunks = 0
        self.observed_chunks = 0
        self.skipped_frames = 0
        """Frames of gaps too long to fill (the timeline went on past them)."""

    def frame_index(self, seq: int) -> int:
        return seq - (self.first_seq if self.first_seq is not None else seq)

    def add(self, obs: FrameIn) -> list[ObservedChunk]:
        """Take one observation (seq strictly increasing); returns the slots it completed."""
        if self.first_seq is None:
            self.first_seq = obs.seq
        n = obs.seq - self.first_seq
        newest = max([self._previous[0]] if self._previous else [], default=-1)
        newest = max([newest, *(self._slot * self.frames + p for p in self._have)])
        if n <= newest:
            raise ValueError(f"observation {obs.seq} is not after the frames already taken")
        slot, pos = divmod(n, self.frames)
        last_slot = newest // self.frames if newest >= 0 else -1
        if slot - last_slot > MAX_GAP_SLOTS + 1:  # the timeline goes on at the next slot
            self.skipped_frames += n - newest - 1
            n = (last_slot + 1) * self.frames
            self.first_seq = obs.seq - n
            slot, pos = last_slot + 1, 0
        done: list[ObservedChunk] = []
        if self._slot is not None and slot > self._slot:
            done.append(self._complete(following=(n, obs)))
        for empty in range(self._emitted + 1, slot):  # slots no frame arrived for
            self._slot, self._have = empty, {}
            done.append(self._complete(following=(n, obs)))
        if self._slot != slot:
            self._slot, self._have = slot, {}
        self._have[pos] = obs
        if pos == self.frames - 1:
            done.append(self._complete(following=None))
        return done

    def _complete(self, following: tuple[int, FrameIn] | None) -> ObservedChunk:
        """The slot being assembled, its missing frames filled from the nearest received."""
        slot, have = self._slot, self._have
        base = slot * self.frames
        known = [(base + p, o) for p, o in sorted(have.items())]
        if self._previous is not None:
            known.insert(0, self._previous)
        if following is not None:
            known.append(following)
        picked, filled = [], 0
        for p in range(self.frames):
            if p in have:
                picked.append((base + p, have[p]))
                continue
            # nearest by frame index; min() keeps the first (earlier) of equally near ones
            picked.append(min(known, key=lambda item, m=base + p: abs(item[0] - m)))
            filled += 1
        if have and len(have) < self.frames and following is not None:
            self.incomplete_chunks += 1
        self.filled_frames += filled
        self.observed_chunks += 1
        newest_pos = max(have) if have else None
        newest_frame, newest = (base + newest_pos, have[newest_pos]) if have else picked[-1]
        self._previous = (newest_frame, newest) if newest_pos is not None else self._previous
        self._slot, self._have = None, {}
        self._emitted = slot
        states = [o.state for _, o in picked]
        return ObservedChunk(
            slot=slot,
            frames=np.concatenate([o.frames[-1:] for _, o in picked]),
            actions=self._actions([o.actions for _, o in picked]),
            newest=newest,
            filled=filled,
            newest_frame=newest_frame,
            state=None if any(x is None for x in states) else np.stack(states),
        )

    def _actions(self, per_frame: list[np.ndarray | None]) -> np.ndarray | None:
        """[H, A]: row j is the command of the frame its time falls in (H = F: frame j)."""
        rows = [a[-1] if a is not None else None for a in per_frame]
        known = [i for i, r in enumerate(rows) if r is not None]
        if not known or not self.action_horizon:
            return None
        rows = [rows[min(known, key=lambda k, i=i: abs(k - i))] for i in range(len(rows))]
        h, f = self.action_horizon, self.frames
        frame_of = [min(f - 1, math.ceil((j + 1) * f / h) - 1) for j in range(h)]
        return np.stack([rows[i] for i in frame_of]).astype(np.float32)
