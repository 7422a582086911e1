"""What running the launch files (test/ros_launch) cannot show: every launch argument is
declared with a description and a default, the arguments users need exist, the parameter
files set only declared parameters, and the rviz config (rviz2 has no wheels here) uses
relative topics and the frames the sim and the bridge publish."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml
from launching import require_ros2_cli

ROOT = Path(__file__).resolve().parents[2]
LAUNCH_FILES = sorted((ROOT / "launch").glob("*.launch.py"))

NEEDED_ARGUMENTS = {
    "robot.launch.py": {
        "namespace", "server", "token_file", "tls_ca", "target_interval_ms", "sim", "rviz",
    },
    "workstation.launch.py": {
        "model", "weights", "host", "port", "token_file", "tls_cert", "tls_key", "nproc_per_node",
    },
    "demo.launch.py": {"model", "weights", "port", "namespace", "target_interval_ms", "rviz"},
}  # fmt: skip


def test_the_three_launch_files_exist():
    assert {p.name for p in LAUNCH_FILES} == set(NEEDED_ARGUMENTS)


@pytest.mark.parametrize("path", LAUNCH_FILES, ids=lambda p: p.name)
def test_every_argument_is_declared_with_a_description_and_a_default(path):
    require_ros2_cli()
    from launch.launch_description_sources import get_launch_description_from_python_launch_file

    arguments = get_launch_description_from_python_launch_file(str(path)).get_launch_arguments()
    names = {a.name for a in arguments}
    assert NEEDED_ARGUMENTS[path.name] <= names, NEEDED_ARGUMENTS[path.name] - names
    for argument in arguments:
        assert len(argument.description) > 10, (path.name, argument.name, argument.description)
        assert argument.default_value is not None, (path.name, argument.name)


def test_launch_files_start_no_program_by_bare_name():
    """Outside the dev venv only the package's lib/physis_ros is known (ros2 run's place)."""
    for path in LAUNCH_FILES:
        source = path.read_text()
        assert not re.search(r"cmd=\[\s*\"", source), f"{path.name} runs a program by name"
        assert '"torchrun"' not in source, path.name


def _ros_params(name: str) -> dict:
    data = yaml.safe_load((ROOT / "config" / name).read_text())
    assert list(data) == ["/**"], f"{name}: expected a /** section"
    return data["/**"]["ros__parameters"]


def test_bridge_yaml_sets_only_declared_parameters_with_their_types():
    from physis_ros.nodes.bridge_params import BridgeParams

    defaults = {
        f: BridgeParams.__dataclass_fields__[f].default for f in BridgeParams.__dataclass_fields__
    }
    params = _ros_params("bridge.yaml")
    assert set(params) <= set(defaults), set(params) - set(defaults)
    for key, value in params.items():
        default = defaults[key]
        expected = list if isinstance(default, tuple) else type(default)
        assert isinstance(value, expected), f"bridge.yaml {key}: {value!r} is not {expected}"
    BridgeParams(**{k: tuple(v) if isinstance(v, list) else v for k, v in params.items()})


def test_sim_robot_yaml_sets_only_declared_parameters_with_their_types():
    from physis_ros.nodes.sim_robot import PARAMETERS

    declared = {name: type(default) for name, default, _, _ in PARAMETERS}
    params = _ros_params("sim_robot.yaml")
    assert params and set(params) <= set(declared), set(params) - set(declared)
    for key, value in params.items():
        assert isinstance(value, declared[key]), f"sim_robot.yaml {key}: {value!r}"


def test_rviz_config_uses_relative_topics_and_the_published_frames():
    rviz = yaml.safe_load((ROOT / "config" / "physis.rviz").read_text())
    displays = rviz["Visualization Manager"]["Displays"]
    topics = {d["Topic"]["Value"]: d["Class"] for d in displays if "Topic" in d}
    assert topics == {
        "camera/image": "rviz_default_plugins/Image",
        "predicted/image": "rviz_default_plugins/Image",
        "predicted/side_by_side": "rviz_default_plugins/Image",
        "predicted/ee_path": "rviz_default_plugins/MarkerArray",
    }
    assert "rviz_default_plugins/TF" in {d["Class"] for d in displays}
    fixed = rviz["Visualization Manager"]["Global Options"]["Fixed Frame"]
    # the TF root sim_robot publishes and the frame of the bridge's markers
    assert fixed == _ros_params("sim_robot.yaml")["table_frame"]
    assert fixed == _ros_params("bridge.yaml")["marker_frame"]


def test_fastdds_profile_has_a_large_shared_memory_segment():
    text = (ROOT / "config" / "fastdds.xml").read_text()
    segment = int(re.search(r"<segment_size>(\d+)</segment_size>", text).group(1))
    assert segment >= 640 * 480 * 3 * 4, segment
    assert "<useBuiltinTransports>false</useBuiltinTransports>" in text
