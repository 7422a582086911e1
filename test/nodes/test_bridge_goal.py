"""The bridge with ``goal_topic`` (a goal-prompted push-wam): its stream opens only once the
task's goal is known, with the prompt naming it, and reopens with each new goal; a bad goal
is dropped and counted. Real topics in a real ROS process (helpers/goal_bridge.py); the
client side of the reopening is test/link/test_link_stream.py's, the server's
test/engine/test_embed.py's."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from physis_testing import child_report

HELPER = str(Path(__file__).parent / "helpers" / "goal_bridge.py")


@pytest.mark.ros
def test_the_stream_opens_with_the_goal_and_reopens_with_each_new_one(ros_env):
    report = child_report([sys.executable, HELPER], ros_env)
    assert not report["started_before_goal"]
    assert report["started_with"] == ["goal_xy_0.100_-0.300"]  # the late joiner got it
    # the same goal again changes nothing; the NaN one is dropped; the new one reopens
    assert report["prompts"] == ["goal_xy_0.100_-0.300", "goal_xy_-0.200_-0.250"]
    assert report["drops"].get("bad_goal") == 1
