"""``--help`` on every executable of the package, run from where ``ros2 run`` finds it
(lib/physis_ros of the installed package): usage on stdout, exit 0, nothing started (a node
that ignored --help would spin until the timeout). Nodes hand ``--ros-args ...`` to rclpy
and reject any other argument."""

from __future__ import annotations

import ast
import subprocess
from pathlib import Path

import pytest

from physis_testing import REPO_ROOT


def console_scripts() -> list[str]:
    tree = ast.parse((REPO_ROOT / "setup.py").read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "CONSOLE_SCRIPTS":
            return sorted(ast.literal_eval(e).split("=")[0].strip() for e in node.value.elts)
    raise AssertionError("setup.py has no CONSOLE_SCRIPTS list")


def executable(name: str) -> Path:
    from ament_index_python.packages import get_package_prefix

    path = Path(get_package_prefix("physis_ros")) / "lib" / "physis_ros" / name
    assert path.is_file(), f"{name} is not installed where ros2 run looks: {path}"
    return path


def run(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(args, env=env, capture_output=True, text=True, timeout=120, check=False)


def test_every_console_script_has_a_ros2_run_launcher():
    from ament_index_python.packages import get_package_prefix

    lib = Path(get_package_prefix("physis_ros")) / "lib" / "physis_ros"
    missing = set(console_scripts()) - {p.name for p in lib.iterdir()}
    assert not missing, f"no launcher in {lib} for {missing}"


@pytest.mark.parametrize("name", console_scripts())
def test_help_prints_usage_and_exits_0(name, ros_env):
    proc = run([str(executable(name)), "--help"], ros_env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.startswith("usage:"), proc.stdout[:500]
    assert name in proc.stdout.splitlines()[0], proc.stdout[:200]


@pytest.mark.parametrize("name", ["bridge", "sim_robot"])
def test_nodes_pass_ros_arguments_through_and_reject_others(name, ros_env):
    ros_args = ["--ros-args", "-r", "__ns:=/arm1", "-p", "seed:=3", "--"]
    proc = run([str(executable(name)), "--help", *ros_args], ros_env)
    assert proc.returncode == 0 and proc.stdout.startswith("usage:"), proc.stderr
    assert "ROS parameters" in proc.stdout
    proc = run([str(executable(name)), *ros_args, "--no-such-flag"], ros_env)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "unrecognized arguments: --no-such-flag" in proc.stderr
