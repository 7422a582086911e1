"""Launch files, parameter files and the rviz config, checked without ``ros2 launch`` (not
installable here): every argument is declared with a description, every executable is a
console script, every file they name exists and is installed, YAML keys are real parameters."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
LAUNCH_FILES = sorted((ROOT / "launch").glob("*.launch.py"))


def _calls(tree: ast.AST, name: str) -> list[ast.Call]:
    return [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and getattr(node.func, "id", getattr(node.func, "attr", None)) == name
    ]


def _kwarg(call: ast.Call, name: str):
    for kw in call.keywords:
        if kw.arg == name:
            return kw.value
    return None


def _console_scripts() -> set[str]:
    tree = ast.parse((ROOT / "setup.py").read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "CONSOLE_SCRIPTS":
            return {ast.literal_eval(e).split("=")[0].strip() for e in node.value.elts}
    raise AssertionError("setup.py has no CONSOLE_SCRIPTS list")


def test_the_three_launch_files_exist():
    assert {p.name for p in LAUNCH_FILES} == {
        "robot.launch.py",
        "workstation.launch.py",
        "demo.launch.py",
    }


@pytest.mark.parametrize("path", LAUNCH_FILES, ids=lambda p: p.name)
def test_every_argument_is_declared_with_a_description_and_used(path):
    source = path.read_text()
    tree = ast.parse(source)
    declared = {}
    for call in _calls(tree, "DeclareLaunchArgument"):
        name = ast.literal_eval(call.args[0])
        description = _kwarg(call, "description")
        assert description is not None, f"{path.name}: argument {name} has no description"
        text = ast.literal_eval(description)
        assert len(text) > 10, f"{path.name}: argument {name} description {text!r} says nothing"
        assert _kwarg(call, "default_value") is not None, f"{path.name}: {name} has no default"
        declared[name] = text
    used = {ast.literal_eval(c.args[0]) for c in _calls(tree, "LaunchConfiguration")}
    assert used == set(declared), f"{path.name}: used {used} vs declared {set(declared)}"
    assert "generate_launch_description" in {
        n.name for n in tree.body if isinstance(n, ast.FunctionDef)
    }


@pytest.mark.parametrize("path", LAUNCH_FILES, ids=lambda p: p.name)
def test_executables_and_files_exist_and_are_installed(path):
    tree = ast.parse(path.read_text())
    scripts = _console_scripts()
    for call in _calls(tree, "Node"):
        package = ast.literal_eval(_kwarg(call, "package"))
        executable = ast.literal_eval(_kwarg(call, "executable"))
        if package == "physis_ros":
            assert executable in scripts, f"{path.name}: {executable} is not a console script"
    for call in _calls(tree, "ExecuteProcess"):
        cmd = _kwarg(call, "cmd")
        programs = [ast.literal_eval(e) for e in cmd.elts if isinstance(e, ast.Constant)]
        ours = [p for p in programs if p.startswith("physis-")]
        assert ours, f"{path.name}: ExecuteProcess runs none of our programs: {programs}"
        assert all(p in scripts for p in ours), f"{path.name}: {ours} not all console scripts"
    # files named as os.path.join(share|config, "config", "x") / (config, "x")
    named = set()
    for call in _calls(tree, "join"):
        parts = [ast.literal_eval(a) for a in call.args if isinstance(a, ast.Constant)]
        if parts and "." in parts[-1]:
            named.add(parts[-1])
    assert named, f"{path.name} names no parameter/config file"
    for name in named:
        assert (ROOT / "config" / name).is_file(), f"{path.name}: config/{name} missing"
    cmake = (ROOT / "CMakeLists.txt").read_text()
    assert re.search(r"install\(DIRECTORY[^)]*\blaunch\b[^)]*\bconfig\b", cmake), (
        "CMakeLists.txt does not install launch/ and config/"
    )


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


def test_sim_robot_yaml_sets_only_declared_parameters():
    source = (ROOT / "physis_ros" / "nodes" / "sim_robot.py").read_text()
    declared = set(re.findall(r'declare_parameter\(\s*"(\w+)"', source))
    params = _ros_params("sim_robot.yaml")
    assert params and set(params) <= declared, set(params) - declared


def test_rviz_config_shows_camera_predictions_and_markers():
    rviz = yaml.safe_load((ROOT / "config" / "physis.rviz").read_text())
    displays = rviz["Visualization Manager"]["Displays"]
    topics = {d["Topic"]["Value"]: d["Class"] for d in displays if "Topic" in d}
    assert topics == {
        "/camera/image": "rviz_default_plugins/Image",
        "/predicted/image": "rviz_default_plugins/Image",
        "/predicted/side_by_side": "rviz_default_plugins/Image",
        "/predicted/ee_path": "rviz_default_plugins/MarkerArray",
    }
    assert rviz["Visualization Manager"]["Global Options"]["Fixed Frame"] == "table"


def test_fastdds_profile_has_a_large_shared_memory_segment():
    text = (ROOT / "config" / "fastdds.xml").read_text()
    segment = int(re.search(r"<segment_size>(\d+)</segment_size>", text).group(1))
    assert segment >= 640 * 480 * 3 * 4, segment
    assert "<useBuiltinTransports>false</useBuiltinTransports>" in text
