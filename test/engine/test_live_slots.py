"""Frames -> observed slots (engine/slots.py): slot n // F, gaps filled and counted, slots in
order, the timeline goes on after a long gap."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from physis_ros.engine.slots import MAX_GAP_SLOTS, FrameIn, SlotAssembler


def obs(seq: int, action: float | None = None) -> FrameIn:
    return FrameIn(
        seq=seq,
        capture_stamp_ns=seq,
        send_stamp_ns=seq,
        received_ns=seq,
        frames=np.full((1, 2, 2, 3), seq % 256, np.uint8),
        actions=None if action is None else np.full((2, 1), action, np.float32),
    )


def values(chunk) -> list[int]:
    return [int(f[0, 0, 0]) for f in chunk.frames]


def test_consecutive_frames_make_one_chunk_per_slot():
    slots = SlotAssembler(frames_per_chunk=2, action_horizon=2)
    out = []
    for seq in range(100, 106):
        out += slots.add(obs(seq, action=seq / 1000))
    assert [c.slot for c in out] == [0, 1, 2]
    assert [values(c) for c in out] == [[100, 101], [102, 103], [104, 105]]
    assert [c.newest.seq for c in out] == [101, 103, 105]
    # row j: the command of frame j (each frame's own command, as training lays them out)
    assert out[1].actions[:, 0].tolist() == pytest.approx([0.102, 0.103])
    assert slots.filled_frames == slots.incomplete_chunks == 0 and slots.observed_chunks == 3


def test_a_slot_is_completed_when_a_later_slot_starts_and_gaps_are_filled():
    slots = SlotAssembler(frames_per_chunk=3, action_horizon=3)
    assert slots.add(obs(0)) == [] and slots.add(obs(1)) == []
    # frame 2 lost; frame 4 (slot 1, position 1) completes slot 0 with what it has
    (first,) = slots.add(obs(4))
    assert first.slot == 0 and values(first) == [0, 1, 1]  # frame 2: nearest is frame 1
    assert first.filled == 1 and slots.incomplete_chunks == 1
    (second,) = slots.add(obs(5))
    assert second.slot == 1 and values(second) == [4, 4, 5]  # frame 3: nearest is frame 4
    # slots 2 and 3 have no frame at all: filled from their neighbours, in order
    done = slots.add(obs(12))  # slot 4, position 0
    assert [c.slot for c in done] == [2, 3]
    assert values(done[0]) == [5, 5, 5] and values(done[1]) == [12, 12, 12]
    assert slots.filled_frames == 1 + 1 + 6 and slots.observed_chunks == 4


def test_a_gap_too_long_to_fill_continues_the_timeline_at_the_next_slot():
    slots = SlotAssembler(frames_per_chunk=2, action_horizon=2)
    slots.add(obs(0))
    slots.add(obs(1))
    jump = 2 + 2 * (MAX_GAP_SLOTS + 5)
    assert slots.add(obs(jump)) == []
    (chunk,) = slots.add(obs(jump + 1))
    assert chunk.slot == 1 and values(chunk) == [jump % 256, (jump + 1) % 256]
    assert slots.skipped_frames == jump - 2 and slots.filled_frames == 0


def test_frames_must_come_in_order():
    slots = SlotAssembler(frames_per_chunk=2, action_horizon=2)
    slots.add(obs(5))
    with pytest.raises(ValueError, match="not after"):
        slots.add(obs(5))


def test_actions_missing_on_some_frames_come_from_the_nearest_frame_with_one():
    slots = SlotAssembler(frames_per_chunk=2, action_horizon=4)
    slots.add(obs(0, action=None))
    (chunk,) = slots.add(obs(1, action=0.5))
    assert chunk.actions.shape == (4, 1) and chunk.actions[:, 0].tolist() == [0.5] * 4
    slots.add(obs(2))
    (none,) = slots.add(obs(3))
    assert none.actions is None


def test_frames_after_an_empty_slot_never_emit_it_again():
    """Slots with no frame are emitted once: the next frames of the slot after them complete
    only that slot (a repeat killed the stream in the engine under load)."""
    slots = SlotAssembler(frames_per_chunk=2, action_horizon=2)
    out = [c.slot for seq in (0, 1) for c in slots.add(obs(seq))]
    out += [c.slot for c in slots.add(obs(6))]  # slot 3, position 0: slots 1 and 2 empty
    out += [c.slot for c in slots.add(obs(7))]  # slot 3, position 1: slot 3 complete
    out += [c.slot for c in slots.add(obs(9))]  # slot 4, position 1
    assert out == [0, 1, 2, 3, 4]


@settings(max_examples=300, deadline=None)
@given(
    frames=st.integers(1, 4),
    steps=st.lists(st.integers(1, 3 * (MAX_GAP_SLOTS + 3)), min_size=1, max_size=40),
)
def test_any_increasing_frames_emit_each_slot_once_in_order(frames, steps):
    """Whatever frames are lost, every slot is emitted once, in order, with no slot left out
    (the timeline may jump past a gap too long to fill, never back)."""
    slots = SlotAssembler(frames_per_chunk=frames, action_horizon=frames)
    emitted = []
    seq = 0
    for step in steps:
        seq += step
        emitted += [c.slot for c in slots.add(obs(seq))]
    assert emitted == list(range(len(emitted)))
