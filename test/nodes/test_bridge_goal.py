"""The bridge with ``task_topic`` (push-wam, which takes the task values goal_x, goal_y): its
stream opens only once the task's goal is known, with its values named as the model's
contract names them, and reopens with each new goal; a bad goal is dropped and counted. Real
topics in a real ROS process (helpers/goal_bridge.py); the client side of the reopening is
test/link/test_link_stream.py's, the server's test/engine/test_embed.py's."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from physis_testing import child_report

HELPER = str(Path(__file__).parent / "helpers" / "goal_bridge.py")


@pytest.mark.ros
def test_the_stream_opens_with_the_goal_and_reopens_with_each_new_one(ros_env):
    report = child_report([sys.executable, HELPER], ros_env)
    first = {"goal_x": 0.1, "goal_y": -0.3}
    # the client is started at once (it learns the contract's task names from the server),
    # with no task: it opens its stream only once the first one is set (the late joiner's)
    assert report["started_before_goal"] and report["started_with"] == []
    # the same goal again changes nothing; the NaN one is dropped; the new one reopens
    assert report["tasks"] == [first, {"goal_x": -0.2, "goal_y": -0.25}]
    assert report["drops"].get("bad_task") == 1
