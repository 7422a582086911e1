"""scripts/gpu_check.sh: its --smoke mode runs the GPU check's own code end to end on the CPU,
and everything the check imports exists on the GPU machine (Python 3.12, torch 2.11, Triton
3.6, no generated protobuf code, no ROS)."""

from __future__ import annotations

import ast
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
GPU_PATH = [
    "physis_ros/tools/gpu_check.py",
    "physis_ros/engine/fused.py",
    "physis_ros/engine/fused_triton.py",
    "physis_ros/engine/block_graphs.py",
    "physis_ros/tools/gpu_verify.py",
    "physis_ros/tools/gpu_timing.py",
    "physis_ros/engine/devcopy.py",
    "physis_ros/engine/stage.py",
    "physis_ros/engine/kvring.py",
]
"""The modules whose torch / Triton calls the device runs new in this check."""
DEVICE_THIRD_PARTY = {"torch", "numpy", "safetensors", "triton"}
"""Third-party packages of the device image that the check may import (KINDS.md's list)."""
REMOVED_BY_312 = {"distutils", "imp", "asynchat", "asyncore", "smtpd"}
TORCH_2_11 = {
    # every torch / F / tl / triton name the GPU path calls, each present in torch 2.11 and
    # Triton 3.6 (a new name fails this test until someone checks it exists there)
    "torch._addmm_activation", "torch.addcmul", "torch.bfloat16", "torch.cat", "torch.complex64",
    "torch.cuda.CUDAGraph", "torch.cuda.Event", "torch.cuda.Stream", "torch.cuda.current_stream",
    "torch.cuda.default_stream", "torch.cuda.get_device_capability",
    "torch.cuda.get_device_properties", "torch.cuda.graph", "torch.cuda.is_available",
    "torch.cuda.set_device", "torch.cuda.stream", "torch.cuda.synchronize", "torch.device",
    "torch.dtype", "torch.empty", "torch.empty_like", "torch.float32", "torch.float64",
    "torch.Generator", "torch.inference_mode", "torch.no_grad", "torch.randn", "torch.rsqrt",
    "torch.set_num_threads", "torch.stack", "torch.Tensor", "torch.tensor", "torch.version.cuda",
    "torch.view_as_complex", "torch.view_as_real", "torch.zeros", "torch.zeros_like",
    "torch.__version__", "torch.long", "torch.ones_like", "torch.polar", "torch.full",
    "torch.arange", "torch.meshgrid", "torch.isfinite",
    "torch.contiguous_format", "torch.cuda.graph_pool_handle", "torch.int64",
    "F.gelu", "F.layer_norm", "F.linear", "F.scaled_dot_product_attention",
    "tl.arange", "tl.constexpr", "tl.float32", "tl.int64", "tl.load", "tl.program_id",
    "tl.rsqrt", "tl.store", "tl.sum", "tl.where", "triton.jit",
}  # fmt: skip


def _dotted(node: ast.AST) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return ".".join([node.id, *reversed(parts)])
    return None


def _imports(path: Path, *, everywhere: bool) -> set[str]:
    """Modules ``path`` imports at import time (``everywhere``: in its functions too)."""
    tree = ast.parse(path.read_text())
    nodes = ast.walk(tree) if everywhere else tree.body
    out = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
    return out


CALLED = {"physis_ros.tools.gpu_check", "physis_ros.tools.profile_cli"} | {
    p.removesuffix(".py").replace("/", ".") for p in GPU_PATH
}
"""Modules whose functions the check runs: their imports inside functions count too."""


def _closure(start: str) -> tuple[set[str], set[str]]:
    """(physis_ros modules the check imports, every other top-level module they import)."""
    seen, others, todo = set(), set(), [start]
    while todo:
        mod = todo.pop()
        path = ROOT / (mod.replace(".", "/") + ".py")
        if not path.exists():
            path = ROOT / mod.replace(".", "/") / "__init__.py"
        if mod in seen or not path.exists():
            continue
        seen.add(mod)
        for name in _imports(path, everywhere=mod in CALLED):
            if name.startswith("physis_ros"):
                todo.append(name)
            else:
                others.add(name.split(".")[0])
    return seen, others


def test_everything_the_gpu_check_imports_is_on_the_device():
    mods, others = _closure("physis_ros.tools.gpu_check")
    assert "physis_ros.engine.fused" in mods and "physis_ros.engine.pool.calibrate" in mods
    # our protobuf code is generated at setup (absent there), ROS is not installed there
    assert not [m for m in mods if m.startswith(("physis_ros.link.proto_gen", "physis_ros.nodes"))]
    stdlib = set(sys.stdlib_module_names) | {"__future__"}
    third = {m for m in others if m not in stdlib}
    assert third <= DEVICE_THIRD_PARTY, third - DEVICE_THIRD_PARTY
    assert not others & REMOVED_BY_312
    for path in GPU_PATH:
        ast.parse((ROOT / path).read_text(), feature_version=(3, 12))


def test_the_gpu_path_calls_only_torch_2_11_names():
    used = set()
    for path in GPU_PATH:
        for node in ast.walk(ast.parse((ROOT / path).read_text())):
            name = _dotted(node) if isinstance(node, ast.Attribute) else None
            if name and name.split(".")[0] in {"torch", "F", "tl", "triton"}:
                used.add(name)
    # keep the longest known prefix: torch.cuda.Event(...).record is a method, not a name
    unknown = {
        n for n in used if not any(n == k or k.startswith(n + ".") for k in TORCH_2_11)
        and not any(n.startswith(k + ".") for k in TORCH_2_11)
        and n.split(".")[-1] not in {"dtype", "element_ty"}
    }  # fmt: skip
    assert not unknown, f"check these exist in torch 2.11 / Triton 3.6, then list them: {unknown}"


@pytest.mark.slow
def test_smoke_runs_the_check_end_to_end(tmp_path):
    out = tmp_path / "out"
    env = {**os.environ, "GPU_CHECK_PRESETS": "tiny", "PYTHON": sys.executable}
    res = subprocess.run(
        ["bash", str(ROOT / "scripts/gpu_check.sh"), str(out), "--smoke"],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    block = json.loads((out / "block_tiny.json").read_text())
    assert block["errors"] == {}, block["errors"]
    for key in ("eager_ms", "fused_ms", "gemm_ms", "attn_ms", "eager4_ms", "fused4_ms"):
        assert block[key] > 0, key
    assert block["accuracy_ok"] and block["fused_vs_eager"] < 2e-2  # bf16 on the CPU
    # block impl graph: on the CPU its static path (nothing captured), equal to fused
    assert block["graph_impl_ms"] > 0 and block["graph_impl_vs_fused"] < 1e-2
    assert block["graph_impl_stats"]["eager"] > 0
    engine = json.loads((out / "engine.json").read_text())
    assert engine["errors"] == {}
    # every path ran and gave an interval: a difference of two wall times, whose sign a busy
    # CPU may flip at these sizes (only its being a number is checked here)
    for impl in ("fused", "graph", "eager"):
        assert math.isfinite(engine[impl]["interval_ms"]), impl
    profile = json.loads((out / "profile_tiny.json").read_text())
    assert profile["provenance"]["block_impl"] == "fused"
    calibration = json.loads((out / "calibration.json").read_text())
    assert calibration["presets"]["tiny"]["entries"] == profile["entries"]
    summary = json.loads((out / "summary.json").read_text())
    assert "tiny" in summary["fit"]["presets"]
    assert "preset        eager ms  fused ms" in res.stdout  # the table, printed last
