"""pool/calibrate.py: the modelled H200 fitted to measured block times recovers the device
that produced them, refuses files that are not calibrations, and physis-sim uses it."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from physis_ros.engine.config import SamplerConfig, get_preset
from physis_ros.engine.pool.calibrate import (
    fit_device,
    fit_report,
    load_calibration,
    merge_calibrations,
)
from physis_ros.engine.pool.calibrate import main as calibrate_main
from physis_ros.engine.pool.costmodel import H200, AnalyticCostModel, block_work
from physis_ros.tools.sim_cli import main as sim_main

SAMPLER = SamplerConfig(steps=4, window=2)
TRUE = replace(
    H200, gemm_efficiency=0.78, attn_efficiency=0.6, elementwise_passes=9.0,
    launch_overhead_ms=0.03,
)  # fmt: skip


def _measured(device, presets=("wan2.1-1.3b", "wan2.1-14b", "dit-33b")) -> dict:
    """What the GPU check would write for a device that behaves exactly like ``device``."""
    cost = AnalyticCostModel(device)
    out = {}
    for name in presets:
        cfg = get_preset(name)
        work = block_work(cfg, SAMPLER, 2)
        out[name] = {
            "tokens_per_chunk": cfg.tokens_per_chunk,
            "gemm_ms": 1e3 * work.gemm_flops / (device.peak_flops * device.gemm_efficiency),
            "attn_ms": 1e3 * work.attn_flops / (device.peak_flops * device.attn_efficiency),
            "entries": [
                {"tasks": b, "ms_p50": cost.group_ms(cfg, SAMPLER, b), "ms_p99": 0.0}
                for b in (1, 2, 4)
            ],
        }
    env = {"device": "NVIDIA H200", "driver": "580.0", "torch": "2.11.0", "cuda": "13.0"}
    return {"environment": env, "dtype": "bfloat16", "steps": 4, "window": 2, "presets": out}


def test_fit_recovers_the_device_that_produced_the_times():
    data = _measured(TRUE)
    fitted = fit_device(H200, data)
    for key in ("gemm_efficiency", "attn_efficiency", "elementwise_passes", "launch_overhead_ms"):
        assert getattr(fitted, key) == pytest.approx(getattr(TRUE, key), rel=1e-6), key
    assert "calibrated: NVIDIA H200" in fitted.name
    report = fit_report(fitted, data)
    assert report["max_abs_error"] < 1e-6
    assert report["environment"]["torch"] == "2.11.0"
    # the uncalibrated model is off against such a device, and the report says by how much
    assert fit_report(H200, data)["max_abs_error"] > 0.05


def test_fit_keeps_overhead_and_passes_non_negative():
    data = _measured(replace(TRUE, elementwise_passes=0.0, launch_overhead_ms=0.0))
    for p in data["presets"].values():  # measured faster than the GEMMs + attention alone
        p["entries"] = [dict(e, ms_p50=e["ms_p50"] * 0.97) for e in p["entries"]]
    fitted = fit_device(H200, data)
    assert fitted.elementwise_passes == 0.0 and fitted.launch_overhead_ms == 0.0


def test_bad_calibration_files_are_refused(tmp_path):
    path = tmp_path / "c.json"
    path.write_text("{}")
    with pytest.raises(ValueError, match="not a calibration file"):
        load_calibration(path)
    data = _measured(TRUE, presets=("wan2.1-1.3b",))
    data["presets"]["wan2.1-1.3b"]["gemm_ms"] = 0
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="gemm_ms and attn_ms > 0"):
        load_calibration(path)
    data["presets"] = {"no-such-model": {}}
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="unknown model preset"):
        load_calibration(path)


def test_sim_runs_depth_on_the_calibrated_device(tmp_path, capsys):
    path = tmp_path / "h200.json"
    path.write_text(json.dumps(_measured(TRUE)))
    assert sim_main(["--experiment", "depth", "--calibration", str(path), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["assumptions"]["device"]["gemm_efficiency"] == pytest.approx(0.78)
    assert out["calibration"]["max_abs_error"] < 1e-6
    stage = AnalyticCostModel(TRUE).group_ms(get_preset("dit-33b"), SAMPLER, 1)
    assert out["stage_ms"] == pytest.approx(stage, abs=1e-3)
    assert sim_main(["--experiment", "depth", "--calibration", str(tmp_path / "none")]) == 2


COMMITTED = Path(__file__).resolve().parents[2] / "docs" / "pool" / "h200_calibration.json"


def test_the_h200_preset_is_the_fit_of_the_committed_calibration():
    """costmodel.H200 carries the numbers fitted to the two H200 runs committed as data: a
    changed file or preset that no longer match fails here."""
    data = load_calibration(COMMITTED)
    env = data["environment"]
    assert env["device"] == "NVIDIA H200" and env["driver"] and env["torch"].startswith("2.")
    fitted = fit_device(H200, data)
    assert fitted.name == H200.name
    for key in ("gemm_efficiency", "attn_efficiency", "elementwise_passes", "launch_overhead_ms"):
        assert getattr(H200, key) == pytest.approx(getattr(fitted, key), rel=1e-3), key
    report = fit_report(H200, data)
    assert set(report["presets"]) == {"wan2.1-1.3b", "wan2.1-14b", "dit-33b"}
    assert report["max_abs_error"] < 0.15  # the 1.3B's launch-bound time is the worst (-9.6%)


def test_merge_averages_runs_and_refuses_other_devices(tmp_path):
    a, b = _measured(TRUE), _measured(TRUE)
    for p in b["presets"].values():
        p["gemm_ms"] *= 1.2
        p["entries"] = [dict(e, ms_p50=e["ms_p50"] * 1.1) for e in p["entries"][:2]]
    merged = merge_calibrations([a, b], ["a.json", "b.json"])
    one = merged["presets"]["wan2.1-14b"]
    assert [e["tasks"] for e in one["entries"]] == [1, 2]  # batch sizes both runs measured
    first = a["presets"]["wan2.1-14b"]
    assert one["gemm_ms"] == pytest.approx(1.1 * first["gemm_ms"])
    assert one["entries"][0]["ms_p50"] == pytest.approx(1.05 * first["entries"][0]["ms_p50"])
    assert merged["merged_from"] == ["a.json", "b.json"]
    out = tmp_path / "m.json"
    (tmp_path / "a.json").write_text(json.dumps(a))
    (tmp_path / "b.json").write_text(json.dumps(b))
    assert calibrate_main(["merge", str(tmp_path / "a.json"), str(tmp_path / "b.json"),
                           "-o", str(out)]) == 0  # fmt: skip
    assert load_calibration(out)["presets"]["dit-33b"]["entries"][1]["tasks"] == 2
    b["environment"]["driver"] = "999.0"
    with pytest.raises(ValueError, match="not one device"):
        merge_calibrations([a, b], ["a", "b"])
