"""The bridge's parameters checked against a model's contract when its stream opens: every
input the model takes must be bound to a topic; what is not is named with its fix (the
stream is then refused, never fed zeros: helpers/object_bridge.py sees it refused)."""

from __future__ import annotations

import dataclasses

import pytest

from physis_ros.contract.model import StateInput, WamContract
from physis_ros.contract.safetensors import read_metadata
from physis_ros.nodes.bridge_inputs import binding_problems
from physis_ros.nodes.bridge_params import BridgeParams
from physis_ros.weights import WAM_WEIGHTS

pytestmark = pytest.mark.ros
PUSH = WamContract.from_metadata(read_metadata(WAM_WEIGHTS))


def test_push_wam_needs_its_box_and_its_task_bound():
    problems = binding_problems(PUSH, BridgeParams(), ())
    assert any("object 'box' (box_x, box_y)" in p and "object_topics" in p for p in problems)
    assert any("task values ['goal_x', 'goal_y']" in p and "task_topic" in p for p in problems)
    bound = BridgeParams(object_topics=("box=object_position",), task_topic="goal")
    assert binding_problems(PUSH, bound, tuple(bound.objects())) == []


def test_a_second_robots_inputs_are_named_by_its_contract():
    """A 3-joint arm reaching a target: joints and its task values; no wrench, no object."""
    reach = dataclasses.replace(
        PUSH,
        action_names=("j0", "j1", "j2"),
        state=(
            *(StateInput(f"j{i}_pos", "joint_position", f"j{i}") for i in range(3)),
            StateInput("target_x", "task", "target_x"),
            StateInput("target_y", "task", "target_y"),
        ),
        prompt=dataclasses.replace(PUSH.prompt, values=("target_x", "target_y")),
    )
    problems = binding_problems(reach, BridgeParams(wrench_topic=""), ())
    assert problems == [
        "it takes task values ['target_x', 'target_y']: set task_topic (a PointStamped)"
    ]
    assert binding_problems(reach, BridgeParams(wrench_topic="", task_topic="target"), ()) == []


def test_object_bindings_are_name_equals_topic():
    assert BridgeParams(object_topics=("box=tracker/box", "cup=c")).objects() == {
        "box": "tracker/box",
        "cup": "c",
    }
    for bad in (("box",), ("=topic",), ("box=a", "box=b")):
        with pytest.raises(ValueError, match="name=topic"):
            BridgeParams(object_topics=bad)
