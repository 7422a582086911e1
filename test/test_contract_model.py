"""The model contract: JSON round trip, every refusal names what is wrong, the shipped
world-action model carries its contract, and a task_features prompt is what push-wam was
trained on."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from physis_ros.contract.model import (
    ContractError,
    PromptSpec,
    StateInput,
    WamContract,
    prompt_features,
)
from physis_ros.contract.safetensors import read_metadata, write_metadata
from physis_ros.weights import WAM_WEIGHTS


def _contract(**kw) -> WamContract:
    base = dict(
        action_names=("a", "b", "c"),
        action_unit="rad",
        action_hz=20.0,
        rows_per_chunk=8,
        frame_hz=10.0,
        image_height=32,
        image_width=32,
        frames_per_chunk=2,
        state=(
            StateInput("a_pos", "joint_position", "a"),
            StateInput("c_vel", "joint_velocity", "c"),
            StateInput("fz", "wrench", "force_z"),
            StateInput("cup_x", "object", "cup.x"),
            StateInput("target_y", "task", "target_y"),
        ),
        prompt=PromptSpec("task_features", ("target_x", "target_y"), 0.5),
    )
    base.update(kw)
    return WamContract(**base)


def test_round_trip_and_derived_names():
    c = _contract()
    assert WamContract.from_json(c.to_json()) == c
    assert c.state_names == ("a_pos", "c_vel", "fz", "cup_x", "target_y")
    assert c.task_names == ("target_y", "target_x")
    assert c.objects == ("cup",)
    assert [s.name for s in c.robot_state] == ["a_pos", "c_vel", "fz", "cup_x"]
    vec = c.state_vector({"a_pos": 1, "c_vel": 2, "fz": 3, "cup_x": 4}, {"target_y": 5})
    assert vec.tolist() == [1, 2, 3, 4, 5] and vec.dtype == np.float32


@pytest.mark.parametrize(
    ("change", "says"),
    [
        ({"action_names": ()}, "action names"),
        ({"action_names": ("a", "a")}, "action names"),
        ({"action_hz": 0.0}, "action_hz"),
        ({"rows_per_chunk": 0}, "rows_per_chunk"),
        ({"state": (StateInput("x", "gps", "x"),)}, "source 'gps'"),
        ({"state": (StateInput("x", "wrench", "force_w"),)}, "wrench key"),
        ({"state": (StateInput("x", "object", "cup"),)}, "object key"),
        ({"state": (StateInput("x", "task", "t"), StateInput("x", "task", "u"))}, "repeat"),
        ({"prompt": PromptSpec("task_features", (), 1.0)}, "names no task values"),
        ({"prompt": PromptSpec("voice")}, "prompt kind"),
        ({"min_committed_ms": -1.0}, "min_committed_ms"),
    ],
)
def test_a_bad_contract_is_refused_naming_the_field(change, says):
    with pytest.raises(ContractError, match=says):
        _contract(**change)


def test_task_values_are_checked_by_name_and_finiteness():
    c = _contract()
    c.check_task({"target_x": 0.1, "target_y": 0.2})
    with pytest.raises(ContractError, match=r"missing \['target_x'\]"):
        c.check_task({"target_y": 0.2})
    with pytest.raises(ContractError, match=r"unknown \['goal'\]"):
        c.check_task({"target_x": 0.1, "target_y": 0.2, "goal": 1.0})
    with pytest.raises(ContractError, match="not finite"):
        c.check_task({"target_x": float("nan"), "target_y": 0.2})


def test_metadata_without_a_contract_says_so():
    with pytest.raises(ContractError, match="no model contract"):
        WamContract.from_metadata({"model": "push-wm"})
    with pytest.raises(ContractError, match="not JSON"):
        WamContract.from_metadata({"contract": "{"})


def test_the_shipped_world_action_model_carries_its_contract():
    c = WamContract.from_metadata(read_metadata(WAM_WEIGHTS))
    meta = read_metadata(WAM_WEIGHTS)
    assert c.state_names == tuple(meta["state_names"].split(","))
    assert c.action_names == tuple(meta["action_names"].split(","))
    assert c.task_names == ("goal_x", "goal_y") and c.objects == ("box",)


def test_task_features_are_the_trained_goal_token():
    """push-wam was trained on [x, y, then per scale pi*2^k: sin, cos of x, sin, cos of y],
    each coordinate divided by 0.5 m: written out here, not through the function."""
    import math

    goal = (0.12, -0.31)
    x, y = goal[0] / 0.5, goal[1] / 0.5
    expect = [x, y]
    for k in range(3):
        w = math.pi * 2**k
        expect += [math.sin(w * x), math.cos(w * x), math.sin(w * y), math.cos(w * y)]
    got = prompt_features(goal, 0.5, 16)
    assert got.shape == (1, 16)
    np.testing.assert_array_equal(got[0, :14], np.asarray(expect, np.float32))
    assert not got[0, 14:].any()
    with pytest.raises(ContractError, match="text_dim >= 14"):
        prompt_features(goal, 0.5, 8)


def test_write_metadata_keeps_the_tensors(tmp_path):
    import torch
    from safetensors.torch import load_file, save_file

    path = tmp_path / "w.safetensors"
    tensors = {"a": torch.arange(6.0).reshape(2, 3), "b": torch.ones(5, dtype=torch.float16)}
    save_file(tensors, str(path), metadata={"old": "1"})
    c = dataclasses.replace(_contract(), rows_per_chunk=4)
    write_metadata(path, {"old": "1", "contract": c.to_json()})
    assert WamContract.from_metadata(read_metadata(path)) == c
    loaded = load_file(str(path))
    assert all(torch.equal(loaded[k], tensors[k]) for k in tensors)
