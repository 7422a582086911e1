"""DESIGN.md §5: which part may import what, and a ROS-free install of the workstation side.

Two checks per rule: a static scan of every import statement (lazy ones inside functions
included), and a child process that imports every module of the part and then looks at
sys.modules (catches transitive imports).
"""

import ast
import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from physis_testing import REPO_ROOT

PKG = REPO_ROOT / "physis_ros"

# part -> top-level modules it must never import
FORBIDDEN = {
    "engine": {"rclpy", "rosbags"},
    "serve": {"rclpy"},
    "link": {"torch", "rclpy"},
    "nodes": {"torch"},
    "eval": {"rclpy"},
    "sim": {"torch", "rclpy"},
    "tools": {"rclpy"},
}
# Files allowed to break their part's rule, and why.
EXCEPTIONS = {
    # physis-replay publishes bag messages into live ROS (the `ros2 bag play` we lack).
    PKG / "eval" / "replay.py": {"rclpy"},
}


def _imported_roots(path: Path) -> set[str]:
    roots = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            roots.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            roots.add(node.module.split(".")[0])
    return roots


def _modules(part: str) -> list[str]:
    base = PKG / part
    mods = []
    for path in sorted(base.rglob("*.py")):
        if "proto_gen" in path.parts or path in EXCEPTIONS:
            continue
        rel = path.relative_to(REPO_ROOT).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts.pop()
        mods.append(".".join(parts))
    return mods


@pytest.mark.parametrize("part", sorted(FORBIDDEN))
def test_no_forbidden_import_statements(part):
    offenders = []
    for path in sorted((PKG / part).rglob("*.py")):
        bad = (_imported_roots(path) & FORBIDDEN[part]) - EXCEPTIONS.get(path, set())
        if bad:
            offenders.append(f"{path.relative_to(REPO_ROOT)} imports {sorted(bad)}")
    assert not offenders, "\n".join(offenders)


# part -> parts of this package it must never import (DESIGN.md §5: the engine is the bottom
# layer; the server, the tools and the benchmarks build on it, never the other way round)
FORBIDDEN_PARTS = {
    "engine": {"serve", "tools", "bench", "nodes", "eval", "link", "sim", "train"},
    "link": {"engine", "serve", "nodes", "tools", "bench"},
}


def _imported_parts(path: Path) -> set[str]:
    parts = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        parts.update(n.split(".")[1] for n in names if n.startswith("physis_ros.") and "." in n)
    return parts


@pytest.mark.parametrize("part", sorted(FORBIDDEN_PARTS))
def test_no_imports_of_higher_parts(part):
    offenders = []
    for path in sorted((PKG / part).rglob("*.py")):
        bad = _imported_parts(path) & FORBIDDEN_PARTS[part]
        if bad:
            offenders.append(f"{path.relative_to(REPO_ROOT)} imports physis_ros.{sorted(bad)}")
    assert not offenders, "\n".join(offenders)


CHILD = """
import importlib, json, sys
mods = json.loads(sys.argv[1])
for m in mods:
    importlib.import_module(m)
print(json.dumps(sorted(k for k in sys.modules if "." not in k)))
"""


@pytest.mark.parametrize(
    ("parts", "forbidden"),
    [(("link", "nodes", "sim"), "torch"), (("engine", "serve", "eval"), "rclpy")],
)
def test_importing_a_side_never_loads_the_other(parts, forbidden):
    mods = [m for part in parts if (PKG / part).exists() for m in _modules(part)]
    assert mods, f"no modules found under {parts}"
    out = subprocess.run(
        [sys.executable, "-c", CHILD, json.dumps(mods)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    loaded = set(json.loads(out.stdout.strip().splitlines()[-1]))
    assert forbidden not in loaded, f"importing {parts} loaded {forbidden}"


def test_workstation_wheel_has_engine_and_server_without_ros(tmp_path):
    """`pip install .` on a machine without ROS: the wheel carries engine + serve and
    declares no ROS dependency."""
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path),
            str(REPO_ROOT),
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    (wheel,) = tmp_path.glob("physis_ros-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        metadata = next(zf.read(n).decode() for n in names if n.endswith("METADATA"))
    assert "physis_ros/engine/config.py" in names
    assert "physis_ros/serve/__init__.py" in names
    requires = [
        line.split(":", 1)[1].split(";")[0].strip().lower()
        for line in metadata.splitlines()
        if line.startswith("Requires-Dist")
    ]
    assert "torch" in requires
    ros_wheels = [r for r in requires if r.startswith("ros-") or r == "rclpy"]
    assert not ros_wheels, f"the workstation install would pull ROS: {ros_wheels}"
