"""A served world-action stream's requests (engine/wam_rows.py, serve/observations.py),
without a server: the state vector in the contract's order, the known rows on the robot
clock (capped as trained), the first frame's time of a slot whose frames came with a gap,
and what a bad observation is dropped as."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from physis_ros.contract.model import ContractError, StateInput, WamContract
from physis_ros.engine.slots import FrameIn, SlotAssembler
from physis_ros.engine.wam_rows import WamRows, known_until
from physis_ros.link.wire import Observation, WireError
from physis_ros.serve.observations import wam_inputs

MS = 1_000_000
STATE = (
    StateInput("elbow_pos", "joint_position", "elbow"),
    StateInput("shoulder_pos", "joint_position", "shoulder"),
    StateInput("shoulder_vel", "joint_velocity", "shoulder"),
    StateInput("elbow_vel", "joint_velocity", "elbow"),
    StateInput("force_x", "wrench", "force_x"),
    StateInput("torque_z", "wrench", "torque_z"),
)
CONTRACT = WamContract(
    action_names=("shoulder", "elbow"),
    action_unit="rad",
    action_hz=20.0,
    rows_per_chunk=6,
    frame_hz=10.0,
    image_height=2,
    image_width=2,
    frames_per_chunk=2,
    state=STATE,
    max_known_rows_ahead=3,
)


ROBOT_STATE = {
    "elbow_pos": 0.2,
    "shoulder_pos": 0.1,
    "shoulder_vel": 0.3,
    "elbow_vel": 0.4,
    "force_x": 1.0,
    "torque_z": 6.0,
}
"""What a bridge sends for CONTRACT: the model's robot inputs by name."""


def _obs(**kw) -> Observation:
    base = dict(seq=0, capture_stamp_ns=0, state=dict(ROBOT_STATE))
    return Observation(**(base | kw))


def test_state_follows_the_contracts_names_and_missing_parts_are_named():
    state, timeline = wam_inputs(_obs(), CONTRACT, {})
    np.testing.assert_array_equal(state, np.float32([0.2, 0.1, 0.3, 0.4, 1, 6]))
    assert timeline is None  # no command timeline: every row is generated
    without_velocity = {k: v for k, v in ROBOT_STATE.items() if k != "elbow_vel"}
    for bad, reason, named in (
        ({"state": without_velocity}, "missing_state", "elbow_vel"),
        ({"state": {}}, "missing_state", "torque_z"),
        ({"state": ROBOT_STATE | {"gripper": 0.02}}, "unknown_state", "gripper"),
        (
            {"commands": np.zeros((4, 3), np.float32), "commands_dt_ns": 50 * MS},
            "commands_shape",
            "shoulder,elbow",
        ),
    ):
        with pytest.raises(WireError) as err:
            wam_inputs(_obs(**bad), CONTRACT, {})
        assert err.value.reason == reason and named in err.value.detail


def test_task_and_object_inputs_come_from_the_stream_and_the_object_tracker():
    """push-wam's last state inputs: the goal from the stream's task values, the box centre
    from the robot's object tracker (named state values box_x, box_y, as the bridge sends
    them from its object_topics binding)."""
    contract = dataclasses.replace(
        CONTRACT,
        state=(
            *STATE,
            StateInput("goal_x", "task", "goal_x"),
            StateInput("goal_y", "task", "goal_y"),
            StateInput("box_x", "object", "box.x"),
            StateInput("box_y", "object", "box.y"),
        ),
    )
    task = {"goal_x": 0.1, "goal_y": -0.3}
    box = {"box_x": 0.05, "box_y": -0.25}
    state, _ = wam_inputs(_obs(state=ROBOT_STATE | box), contract, task)
    assert state.shape == (10,)
    np.testing.assert_array_equal(state[-4:], np.float32([0.1, -0.3, 0.05, -0.25]))
    with pytest.raises(WireError) as err:
        wam_inputs(_obs(), contract, task)
    assert err.value.reason == "missing_state"
    assert "box_x" in err.value.detail and "bridge" in err.value.detail
    # a model without the box inputs (tiny-wam) refuses values it does not take
    with pytest.raises(WireError) as err:
        wam_inputs(_obs(state=ROBOT_STATE | box), CONTRACT, {})
    assert err.value.reason == "unknown_state"


def test_known_rows_reach_the_capture_plus_the_latency_at_most_as_far_as_trained():
    assert known_until(CONTRACT, 1000 * MS, 0.0) == 1000 * MS
    assert known_until(CONTRACT, 1000 * MS, 51.0) == 1100 * MS  # rounded up to a row
    assert known_until(CONTRACT, 1000 * MS, 900.0) == 1150 * MS  # 3 rows at most


def test_the_contracts_min_committed_ms_is_a_floor_under_the_latency():
    """A model whose contract says min_committed_ms 100 is told the rows up to 100 ms after
    the newest frame however soon the answer comes; a longer latency still reaches further,
    as far as trained; a value that is not a time is refused when the contract is read."""
    floored = dataclasses.replace(CONTRACT, min_committed_ms=100.0)
    assert CONTRACT.min_committed_ms == 0.0  # no floor
    assert known_until(floored, 1000 * MS, 0.0) == 1100 * MS
    assert known_until(floored, 1000 * MS, 120.0) == 1150 * MS
    assert known_until(floored, 1000 * MS, 900.0) == 1150 * MS
    for bad in (-5.0, float("nan"), "soon"):
        with pytest.raises(ContractError, match="min_committed_ms"):
            dataclasses.replace(CONTRACT, min_committed_ms=bad)


def test_a_slot_with_a_missing_frame_is_timed_from_its_newest_frame():
    """Frames 0, 1, 3 arrive (frame 2 of slot 1 is filled from frame 3): slot 1's first frame
    is at 200 ms, slot 2's at 400 ms; the rows known are the timeline's up to the newest
    capture plus the latency; the reply timing is kept for previews, forgotten after."""
    stream = WamRows(CONTRACT)
    slots = SlotAssembler(2, 0)
    commands = np.stack([np.arange(20.0), -np.arange(20.0)], axis=1).astype(np.float32)
    done = []
    for n in (0, 1, 3):
        obs = _obs(seq=10 + n, capture_stamp_ns=n * 100 * MS)
        obs = Observation(**{**obs.__dict__, "commands": commands, "commands_dt_ns": 50 * MS})
        state, timeline = wam_inputs(obs, CONTRACT, {})
        ctx = FrameIn(
            seq=obs.seq, capture_stamp_ns=obs.capture_stamp_ns, send_stamp_ns=0, received_ns=0,
            frames=np.zeros((1, 2, 2, 3), np.uint8), actions=None, state=state,
            commands=timeline,
        )  # fmt: skip
        done += slots.add(ctx)
    assert [c.slot for c in done] == [0, 1] and done[1].filled == 1
    slot1 = done[1]
    assert slot1.newest_frame == 3 and slot1.state.shape == (2, 6)
    assert stream.first_frame_ns(slot1, 1) == 200 * MS
    # known: after the newest capture (300 ms), until it plus the latency (rounded up: 350)
    rows = stream.known_rows(slot1, 1, latency_ms=40.0)
    assert np.isnan(rows[:3]).all()  # 200, 250, 300 ms: done before the frame, not given
    assert rows[3, 0] == 7  # 350 ms
    assert np.isnan(rows[4:]).all()
    generated = stream.generate_rows(slot1, 2, latency_ms=40.0)  # its rows start at 400 ms
    assert np.isnan(generated).all()
    timing = stream.reply_timing(2, final=False)
    assert (timing.start_ns, timing.dt_ns, timing.known_rows) == (400 * MS, 50 * MS, 0)
    assert stream.reply_timing(2, final=True) == timing
    assert stream.reply_timing(2, final=True) is None
