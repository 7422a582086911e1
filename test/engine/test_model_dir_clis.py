"""--model PATH everywhere a preset name is accepted: physis-sim, physis-profile, physis-bench
engine and physis-eval take a Wan model directory (here a random tiny diffusers one)."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import pytest
from wan_fixtures import make_diffusers_wan

from physis_ros.eval.cli import engine_settings
from physis_ros.tools import profile_cli

SMALL = ("--resolution", "64x64", "--latent-frames", "2")
"""A chunk of 2 x 8 x 8 latents instead of the 480x832 default: seconds on a CPU."""


@pytest.fixture(scope="module")
def wan_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("clidir")
    make_diffusers_wan(root)
    return root


def _run(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", *argv], capture_output=True, text=True, timeout=300, check=False
    )


def test_sim_and_bench_take_a_model_dir(wan_dir):
    sim = _run("physis_ros.tools.sim_cli", "--model", str(wan_dir), "--streams", "2", "--json")
    assert sim.returncode == 0, sim.stderr
    assert json.loads(sim.stdout)["model"] == wan_dir.name
    bench = _run(
        "physis_ros.bench.cli", "engine", "--model", str(wan_dir), *SMALL, "--mode",
        "pipelined", "--chunks", "3", "--steps", "2", "--json",
    )  # fmt: skip
    assert bench.returncode == 0, bench.stderr
    assert json.loads(bench.stdout)["model"] == wan_dir.name
    bad = _run("physis_ros.tools.sim_cli", "--model", str(wan_dir / "absent"))
    assert bad.returncode == 2 and "no such preset or directory" in bad.stderr


def test_profile_takes_a_model_dir(wan_dir, capsys):
    argv = ["--model", str(wan_dir), *SMALL, "--batches", "1,2", "--repeats", "3", "--warmup", "1"]
    assert profile_cli.main(argv) == 0
    assert json.loads(capsys.readouterr().out)["model"] == wan_dir.name


def test_eval_serves_a_model_dir_with_its_own_weights(wan_dir):
    args = argparse.Namespace(
        model=str(wan_dir), weights=None, random_weights=False, steps=None, window=None,
        shift=None, workers=1, mode="pipelined", vae=None, resolution="64x64",
        latent_frames=2, prompts=["p.safetensors"], dtype=None,
    )  # fmt: skip
    kwargs, _ = engine_settings(args)
    assert kwargs["model"] == str(wan_dir) and "checkpoint" not in kwargs
    assert kwargs["resolution"] == "64x64" and kwargs["prompts"] == ["p.safetensors"]
    args.weights = "other.safetensors"
    with pytest.raises(ValueError, match="drop --weights"):
        engine_settings(args)
