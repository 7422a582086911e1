"""``physis-profile``: block times by batch size and loop costs of this CPU, as JSON that the
cost model reads back; bad options exit 2 with the reason."""

from __future__ import annotations

import json

import pytest
import torch

from physis_ros.engine.pool.costmodel import Profile, ProfileCostModel
from physis_ros.tools.profile_cli import main


def test_profile_measures_every_batch_size_and_round_trips(tmp_path, capsys):
    out = tmp_path / "profile.json"
    argv = ["--model", "tiny", "--batches", "1,2,4", "--repeats", "5", "--warmup", "1"]
    assert main([*argv, "--out", str(out)]) == 0
    printed = json.loads(capsys.readouterr().out)
    profile = Profile.load(str(out))
    provenance = printed.pop("provenance")
    assert profile.to_json() == printed
    assert provenance["torch"] == torch.__version__ and provenance["block_built"] == 1
    assert provenance["block_impl"] == "eager" and provenance["first_entry_s"] > 0
    assert [e.tasks for e in profile.entries] == [1, 2, 4]
    assert all(e.ms_p99 >= e.ms_p50 > 0 for e in profile.entries)
    assert profile.calibrated_on == "inproc" and profile.hop_ms > 0
    # the cost model reads the entries back (and interpolates between them)
    cost = ProfileCostModel(profile)
    assert cost.block_ms(4) == profile.entries[2].ms_p50
    two, four = profile.entries[1].ms_p50, profile.entries[2].ms_p50
    assert cost.block_ms(3) == pytest.approx((two + four) / 2)


def test_bad_options_exit_2_with_the_reason(capsys):
    assert main(["--batches", "1,x"]) == 2
    assert "--batches must be integers" in capsys.readouterr().err
    assert main(["--batches", "0,2"]) == 2
    assert "--batches must be >= 1" in capsys.readouterr().err
    assert main(["--runtime", "gloo", "--device", "cuda:0"]) == 2
    assert "use --device cpu" in capsys.readouterr().err
    assert main(["--gloo-repeats", "0"]) == 2
    assert "--gloo-repeats >= 1" in capsys.readouterr().err


def test_fused_profile_builds_only_the_timed_block(capsys):
    argv = ["--model", "tiny", "--batches", "1,2", "--repeats", "3", "--warmup", "1"]
    assert main([*argv, "--block-impl", "fused", "--loop-chunks", "0"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["provenance"]["block_impl"] == "fused"
    assert printed["provenance"]["kernels"] == "torch"  # on the CPU
    assert printed["task_overhead_ms"] == 0.0  # not measured
    assert main([*argv, "--loop-chunks", "-1"]) == 2
