"""scripts/gpu_verify.sh (the short GPU verification of the CUDA-graph block path): its --smoke
mode runs the same code end to end on the CPU, every step writes its JSON, and everything it
imports exists on the GPU machine."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_gpu_check import DEVICE_THIRD_PARTY, _closure

ROOT = Path(__file__).resolve().parents[1]


def test_everything_the_verification_imports_is_on_the_device():
    mods, others = _closure("physis_ros.tools.gpu_verify")
    assert "physis_ros.tools.gpu_check" in mods and "physis_ros.engine.block_graphs" in mods
    third = {m for m in others if m not in set(sys.stdlib_module_names) | {"__future__"}}
    assert third <= DEVICE_THIRD_PARTY, third - DEVICE_THIRD_PARTY


@pytest.mark.slow
def test_smoke_runs_the_verification_end_to_end(tmp_path):
    out = tmp_path / "out"
    env = {**os.environ, "PYTHON": sys.executable}
    env.pop("OUT", None)
    res = subprocess.run(
        ["bash", str(ROOT / "scripts/gpu_verify.sh"), str(out), "--smoke"],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    for step in ("env", "block", "engine", "summary"):
        assert f"gpu_verify: {step} rc=0" in res.stdout, res.stdout
    block = json.loads((out / "block_tiny.json").read_text())
    assert block["errors"] == {}, block["errors"]
    for key in ("eager_ms", "fused_ms", "graph_impl_ms", "gemm_ms", "attn_ms", "floor_ms"):
        assert block[key] > 0, key
    # on the CPU nothing is captured: graph runs the static path, equal to fused bit for bit
    assert block["graph_vs_fused_max_abs"] == 0.0 and not block["graph_replayed"]
    assert block["graph_stats_errors"]["eager"] == 3
    assert 0 < block["graph_vs_eager_max_abs"] < 0.1 * block["eager_max_abs"]  # bf16
    assert block["errors_ok"]
    engine = json.loads((out / "engine.json").read_text())
    assert engine["errors"] == {} and set(engine) >= {"fused", "graph"} and "eager" not in engine
    for impl in ("fused", "graph"):
        assert engine[impl]["chunks"] == [4, 8]
        assert math.isfinite(engine[impl]["interval_ms"]) and engine[impl]["tail_chunks"] == 3
    verify = json.loads((out / "verify.json").read_text())
    assert verify["failed_steps"] == {} and verify["missing"] == []
    assert verify["block"]["graph_impl_ms"] == block["graph_impl_ms"]
    assert verify["engine"]["graph"] == engine["graph"]
    assert "block-task p50 ms: eager" in res.stdout and "engine graph: interval" in res.stdout


def test_it_refuses_to_run_without_an_output_directory():
    env = {k: v for k, v in os.environ.items() if k != "OUT"}
    res = subprocess.run(
        ["bash", str(ROOT / "scripts/gpu_verify.sh"), "--smoke"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert res.returncode == 2 and "usage" in res.stderr
