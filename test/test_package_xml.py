"""package.xml names every dependency the package imports, and nothing it does not use;
the pip-only rosdep keys are defined in rosdep.yaml and pinned in requirements.txt."""

from __future__ import annotations

import ast
import re
import sys
import xml.etree.ElementTree as ET

import yaml

from physis_testing import REPO_ROOT

# import name -> (rosdep key, PyPI distribution); ROS packages import under their own key
THIRD_PARTY = {
    "numpy": ("python3-numpy", "numpy"),
    "yaml": ("python3-yaml", "PyYAML"),
    "grpc": ("python3-grpcio", "grpcio"),
    "grpc_health": ("python3-grpcio-health-checking-pip", "grpcio-health-checking"),
    "prometheus_client": ("python3-prometheus-client", "prometheus-client"),
    "grpc_tools": ("python3-grpc-tools", "grpcio-tools"),
    "google": ("python3-protobuf", "protobuf"),
    "torch": ("python3-torch-pip", "torch"),
    # Triton comes with torch's Linux CUDA wheels; the fused block imports it only where present
    "triton": ("python3-torch-pip", "torch"),
    "safetensors": ("python3-safetensors-pip", "safetensors"),
    "rosbags": ("python3-rosbags-pip", "rosbags"),
    "PIL": ("python3-pil", "pillow"),
    "tqdm": ("python3-tqdm", "tqdm"),
    "setuptools": ("python3-setuptools", "setuptools"),
    "transformers": ("python3-transformers-pip", "transformers"),
    "diffusers": ("python3-diffusers-pip", "diffusers"),
    "skimage": ("python3-skimage", "scikit-image"),
}
# -pip keys rosdistro itself defines (rosdep/python.yaml); the others are in rosdep.yaml
ROSDISTRO_PIP_KEYS = {"python3-transformers-pip"}
# keys used without a Python import of that name
USED_OTHERWISE = {
    "rosidl_default_runtime": "the generated messages",
    "builtin_interfaces": "msg/ fields",
    "std_msgs": "msg/ fields",
    "rviz2": "robot.launch.py rviz:=true",
}
SOURCES = [
    *sorted((REPO_ROOT / "physis_ros").rglob("*.py")),
    *sorted((REPO_ROOT / "launch").glob("*.py")),
    REPO_ROOT / "proto" / "generate.py",
    REPO_ROOT / "setup.py",
]


def imported_modules() -> dict[str, set[str]]:
    """Top-level module -> files importing it (absolute imports outside the stdlib)."""
    found: dict[str, set[str]] = {}
    for path in SOURCES:
        if "proto_gen" in path.parts:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top not in sys.stdlib_module_names and top not in ("__future__", "physis_ros"):
                    found.setdefault(top, set()).add(str(path.relative_to(REPO_ROOT)))
    return found


def package_keys() -> set[str]:
    root = ET.parse(REPO_ROOT / "package.xml").getroot()
    tags = ("depend", "exec_depend", "build_depend", "buildtool_depend")
    return {e.text.strip() for tag in tags for e in root.iter(tag)}


def test_every_import_has_its_key_in_package_xml():
    keys = package_keys()
    missing = {
        name: sorted(files)
        for name, files in imported_modules().items()
        if THIRD_PARTY.get(name, (name,))[0] not in keys
    }
    assert not missing, (
        f"imported but not in package.xml (add the key, and to THIRD_PARTY): {missing}"
    )


def test_every_runtime_key_in_package_xml_is_used():
    root = ET.parse(REPO_ROOT / "package.xml").getroot()
    runtime = {e.text.strip() for tag in ("depend", "exec_depend") for e in root.iter(tag)}
    used = {THIRD_PARTY.get(name, (name,))[0] for name in imported_modules()} | set(USED_OTHERWISE)
    assert runtime <= used, f"in package.xml but never used: {runtime - used}"


def test_pip_only_keys_are_defined_and_every_distribution_is_pinned():
    defined = yaml.safe_load((REPO_ROOT / "rosdep.yaml").read_text())
    pinned = {
        re.split(r"[=<>\[ ]", line, maxsplit=1)[0].lower()
        for line in (REPO_ROOT / "requirements.txt").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    }
    for name in imported_modules():
        if name not in THIRD_PARTY:
            continue
        key, distribution = THIRD_PARTY[name]
        if key.endswith("-pip") and key not in ROSDISTRO_PIP_KEYS:
            assert defined[key]["debian"]["pip"]["packages"] == [distribution], key
        assert distribution.lower() in pinned, f"{distribution} is not pinned in requirements.txt"
