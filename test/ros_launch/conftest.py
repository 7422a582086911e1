"""What the tests that run ``ros2 launch`` share."""

from __future__ import annotations

import pytest
from launching import require_ros2_cli

from physis_testing import REPO_ROOT


@pytest.fixture
def ros_launch_env(ros_env, monkeypatch):
    """ros_env for the launches; this process's monitors discover on localhost too."""
    require_ros2_cli()
    for key in ("ROS_AUTOMATIC_DISCOVERY_RANGE", "FASTDDS_DEFAULT_PROFILES_FILE"):
        monkeypatch.setenv(key, ros_env[key])
    env = dict(ros_env)
    # the launch files are found in the installed package, not next to the tests
    env["PYTHONPATH"] = env["PYTHONPATH"].replace(str(REPO_ROOT), "").strip(":")
    return env
