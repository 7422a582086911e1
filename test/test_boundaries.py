"""DESIGN.md §5: which part may import what, no import cycle, and a ROS-free install of the
workstation side.

Two checks per rule: a static scan of every import statement (lazy ones inside functions
included), and a child process that imports every module of the part and then looks at
sys.modules (catches transitive imports). Every subpackage and top-level module has a rule.
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
    "contract": {"torch", "rclpy", "grpc"},
    "engine": {"rclpy", "rosbags"},
    "serve": {"rclpy"},
    "link": {"torch", "rclpy"},
    "nodes": {"torch"},
    "eval": {"rclpy"},
    "sim": {"torch", "rclpy"},
    "train": {"rclpy"},
    "tools": {"rclpy"},
    "weights": {"torch", "rclpy"},
}
# Files allowed to break their part's rule, and why.
EXCEPTIONS = {
    # physis-replay publishes bag messages into live ROS (the `ros2 bag play` we lack).
    PKG / "eval" / "replay.py": {"rclpy"},
    # The simulated robot's own node and its TF frames draw the simulated scene.
    PKG / "nodes" / "sim_robot.py": {"sim"},
    PKG / "nodes" / "frames.py": {"sim"},
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
    for path in _files(part):
        bad = (_imported_roots(path) & FORBIDDEN[part]) - EXCEPTIONS.get(path, set())
        if bad:
            offenders.append(f"{path.relative_to(REPO_ROOT)} imports {sorted(bad)}")
    assert not offenders, "\n".join(offenders)


PARTS = {
    p.name if p.is_dir() else p.stem
    for p in PKG.iterdir()
    if (p.is_dir() and (p / "__init__.py").exists()) or (p.suffix == ".py" and p.stem != "__init__")
}
"""Every subpackage and top-level module of physis_ros."""
# part -> the parts of this package it may import (DESIGN.md §5: contract at the bottom, the
# engine on it, the server on the engine; the robot side on link; the demo task, evaluation,
# training and tools above; the product knows no demo task)
ALLOWED_PARTS = {
    "contract": set(),
    "cli_errors": set(),
    "children": set(),
    "memtune": set(),
    "weights": {"contract"},
    "link": {"contract", "memtune", "cli_errors"},
    "engine": {"contract", "weights", "memtune", "cli_errors"},
    "serve": {"engine", "link", "contract", "memtune", "cli_errors", "children"},
    "nodes": {"link", "contract", "msg", "cli_errors", "children"},
    "sim": {"contract", "cli_errors"},
    "eval": {"engine", "link", "contract", "sim", "weights", "cli_errors", "children"},
    "train": {"engine", "eval", "sim", "contract", "weights", "cli_errors"},
    "tools": {"engine", "contract", "weights", "cli_errors", "children"},
    "bench": PARTS - {"sim", "train", "demo"},
    "demo": PARTS,
}


def _imported_parts(path: Path) -> set[str]:
    parts = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
            if node.module == "physis_ros":  # from physis_ros import weights
                names = [f"physis_ros.{alias.name}" for alias in node.names]
        parts.update(n.split(".")[1] for n in names if n.startswith("physis_ros."))
    return parts


def _files(part: str) -> list[Path]:
    return sorted((PKG / part).rglob("*.py")) if (PKG / part).is_dir() else [PKG / f"{part}.py"]


def test_every_part_has_a_rule():
    assert set(ALLOWED_PARTS) >= PARTS, (
        f"parts without a rule: {sorted(PARTS - set(ALLOWED_PARTS))}"
    )


@pytest.mark.parametrize("part", sorted(ALLOWED_PARTS))
def test_no_imports_of_parts_it_may_not_know(part):
    offenders = []
    for path in _files(part):
        allowed = ALLOWED_PARTS[part] | {part} | EXCEPTIONS.get(path, set())
        bad = _imported_parts(path) - allowed
        if bad:
            offenders.append(f"{path.relative_to(REPO_ROOT)} imports physis_ros.{sorted(bad)}")
    assert not offenders, "\n".join(offenders)


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO_ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def test_the_package_import_graph_has_no_cycle():
    """Module -> the modules it imports (at any depth: inside functions too), strongly
    connected components by Tarjan's algorithm: none may hold two modules."""
    paths = [p for p in PKG.rglob("*.py") if "proto_gen" not in p.parts]
    modules = {_module_name(p): p for p in paths}

    def owner(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    edges: dict[str, set[str]] = {}
    for name, path in modules.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                targets = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            for t in targets:
                o = owner(t) if t.startswith("physis_ros") else None
                if o and o not in (name, "physis_ros"):
                    deps.add(o)
        edges[name] = deps
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(modules):
        if v not in index:
            visit(v)
    assert len(modules) > 100 and sum(map(len, edges.values())) > 300  # the graph was built
    assert not cycles, "import cycles: " + "; ".join(" <-> ".join(c) for c in cycles)


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
