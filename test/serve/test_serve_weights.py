"""The weights physis-serve serves, in one process and under torchrun.

Under torchrun the ranks run exactly rank 0's resolved serving spec (sent as JSON), so they
serve the shipped push-wm weights: the same stream seed and observations give the states the
single-process runtime gives (max abs diff <= 1e-5). A weights file that lacks one block key
stops the server, in one process and under torchrun, with a line that names the key."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from stream_plans import observed_plan

REPO_ROOT = Path(__file__).resolve().parents[2]
TORCHRUN = Path(sys.executable).parent / "torchrun"
HELPER = Path(__file__).with_name("dist_predict.py")
CONFIG = """
engine: {model: push-wm, device: cpu}
distributed: {heartbeat_interval_s: 0.2, fault_timeout_s: 3.0, comm_timeout_s: 30.0}
"""
MISSING_KEY = "blocks.2.ffn.0.weight"

needs_torchrun = pytest.mark.skipif(not TORCHRUN.exists(), reason="torchrun is not in this venv")


def _env() -> dict[str, str]:
    pythonpath = os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=pythonpath)


def _torchrun(ranks: int, *args: str, timeout_s: float = 240) -> subprocess.CompletedProcess:
    cmd = [str(TORCHRUN), "--standalone", "--nproc-per-node", str(ranks), *args]
    return subprocess.run(
        cmd, env=_env(), capture_output=True, text=True, timeout=timeout_s, check=False
    )


def _single_process_states(spec) -> dict[int, torch.Tensor]:
    """The single-process runtime (local_engine's, one worker) on the same spec's weights."""
    from physis_ros.contract.safetensors import read_metadata
    from physis_ros.engine.build import build_model
    from physis_ros.engine.pipeline import run_plan
    from physis_ros.engine.placement import layout_single
    from physis_ros.engine.prompts import trained_empty_prompt
    from physis_ros.engine.threads import InProcRuntime

    model = build_model(spec.model_config, seed=spec.seed)
    model.load_safetensors(spec.weights)
    sampler = spec.sampler()
    runtime = InProcRuntime(model, sampler, layout_single(sampler.steps, model.cfg.num_blocks))
    plan = observed_plan(spec.model_config, seed=1, pairs=4)
    empty = trained_empty_prompt(spec.model_config, read_metadata(spec.weights))
    out = run_plan(runtime, {0: plan}, mode="pipelined", seeds={0: 7}, conds={0: empty})
    return {c: r.x.float() for c, r in out[0].items()}


@needs_torchrun
def test_torchrun_serves_the_shipped_weights_as_one_process_does(tmp_path):
    from physis_ros.serve.spec import ServingSpec

    torch.set_num_threads(1)
    (tmp_path / "serve.yaml").write_text(CONFIG)
    out = tmp_path / "dist.npz"
    done = _torchrun(2, str(HELPER), "--config", str(tmp_path / "serve.yaml"), str(out))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    spec = ServingSpec(model="push-wm", device="cpu").resolve()
    assert spec.weights.endswith("push_wm.safetensors")
    dist = {int(c): torch.from_numpy(x) for c, x in np.load(out).items()}
    single = _single_process_states(spec)
    assert sorted(dist) == sorted(single) == [1, 3, 5, 7]
    worst = max((dist[c] - single[c]).abs().max().item() for c in single)
    assert worst <= 1e-5, worst
    # random weights would give other states: the shipped ones were used
    random_model = ServingSpec(model="push-wm", device="cpu", weights="random").resolve()
    assert random_model.weights == ""


def _weights_without_key(tmp_path: Path) -> Path:
    from safetensors.torch import load_file, save_file

    from physis_ros.contract.safetensors import read_metadata
    from physis_ros.weights import DEFAULT_WEIGHTS

    state = load_file(str(DEFAULT_WEIGHTS))
    del state[MISSING_KEY]
    path = tmp_path / "lacking.safetensors"
    save_file(state, str(path), metadata=read_metadata(DEFAULT_WEIGHTS))
    return path


def _serve_args(tmp_path: Path, weights: Path) -> list[str]:
    (tmp_path / "serve.yaml").write_text(CONFIG)
    return ["--config", str(tmp_path / "serve.yaml"), "--weights", str(weights), "--port", "0"]


def _error_lines(text: str) -> list[str]:
    return [
        line
        for line in text.splitlines()
        if MISSING_KEY in line and ("ERROR" in line or "error:" in line)
    ]


def test_a_missing_block_key_stops_the_single_process_server_naming_it(tmp_path):
    args = _serve_args(tmp_path, _weights_without_key(tmp_path))
    done = subprocess.run(
        [sys.executable, "-m", "physis_ros.serve.main", *args],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-2000:]
    lines = _error_lines(done.stderr)
    assert len(lines) == 1, done.stderr[-2000:]
    assert f"lacks 1 key(s) [{MISSING_KEY}]" in lines[0]


@needs_torchrun
def test_a_missing_block_key_stops_every_rank_naming_it(tmp_path):
    args = _serve_args(tmp_path, _weights_without_key(tmp_path))
    done = _torchrun(2, "-m", "physis_ros.serve.main", *args, timeout_s=180)
    assert done.returncode != 0
    log = done.stdout + done.stderr
    assert any(f"lacks 1 key(s) [{MISSING_KEY}]" in line for line in _error_lines(log)), log[-3000:]
    assert "rank 0 refused the serving spec" in log  # rank 1 stopped with rank 0's reason
