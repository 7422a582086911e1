"""The analytic device model (``costmodel.DeviceSpec``) fitted to block times measured on it.

Input: a calibration file (JSON), as ``physis_ros.tools.gpu_check`` writes it on the device::

    {"environment": {"device": "NVIDIA H200", "driver": "...", "torch": "...", "cuda": "..."},
     "dtype": "bfloat16", "steps": 4, "window": 2,
     "presets": {"wan2.1-14b": {"tokens_per_chunk": 4680,
                                "gemm_ms": 3.6, "attn_ms": 2.4,     # one task, each alone
                                "entries": [{"tasks": 1, "ms_p50": 6.4}, ...]}, ...}}

``entries`` are ``physis-profile`` block-task times (the engine's own forward) by batch size;
``gemm_ms`` / ``attn_ms`` the block's weight GEMMs and its attention timed alone at one task.

Fit (``fit_device``), in the terms of ``AnalyticCostModel.group_ms``:
- ``gemm_efficiency`` = sum of GEMM FLOPs / (sum of GEMM-alone times x peak), over the presets;
- ``attn_efficiency`` likewise from the attention-alone times;
- what the measured block times leave beyond the modelled GEMMs and attention is fitted by least
  squares over every preset and batch size as ``launch_overhead_ms`` (per forward) +
  ``elementwise_passes`` passes over [N, D] per task at the achieved bandwidth (both >= 0).
Everything else (memory, links) stays the base spec's. ``fit_report`` gives the modelled and
measured time and the error of every entry, the per-preset error at one task first.
``merge_calibrations`` averages several runs' files into one (what
``docs/pool/h200_calibration.json`` is: ``python -m physis_ros.engine.pool.calibrate merge``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import replace
from pathlib import Path

from physis_ros.engine.config import SamplerConfig, get_preset
from physis_ros.engine.pool.costmodel import H200, AnalyticCostModel, DeviceSpec, block_work


def load_calibration(path: str | Path) -> dict:
    try:
        data = json.loads(Path(path).read_text())
        presets = data["presets"]
        for name, p in presets.items():
            get_preset(name)
            if not p["entries"] or not (p["gemm_ms"] > 0 and p["attn_ms"] > 0):
                raise ValueError(f"preset {name}: needs entries, gemm_ms and attn_ms > 0")
    except (OSError, json.JSONDecodeError, KeyError, TypeError) as err:
        raise ValueError(f"{path}: not a calibration file ({err!r})") from None
    if not presets:
        raise ValueError(f"{path}: no presets measured")
    return data


def _sampler(data: dict) -> SamplerConfig:
    return SamplerConfig(steps=int(data.get("steps", 4)), window=int(data.get("window", 2)))


def fit_device(base: DeviceSpec, data: dict) -> DeviceSpec:
    """``base`` with its compute efficiencies, elementwise passes and per-forward overhead
    fitted to ``data`` (see the module docstring)."""
    sampler = _sampler(data)
    db = base.dtype_bytes
    gemm_flops = attn_flops = gemm_s = attn_s = 0.0
    for name, p in data["presets"].items():
        work = block_work(get_preset(name), sampler, db)
        gemm_flops += work.gemm_flops
        attn_flops += work.attn_flops
        gemm_s += p["gemm_ms"] / 1e3
        attn_s += p["attn_ms"] / 1e3
    ge = min(1.0, gemm_flops / (gemm_s * base.peak_flops))
    ae = min(1.0, attn_flops / (attn_s * base.peak_flops))
    compute = replace(
        base, gemm_efficiency=ge, attn_efficiency=ae, launch_overhead_ms=0.0, elementwise_passes=0
    )
    cost = AnalyticCostModel(compute)
    bw = base.mem_bandwidth_Bps * base.bandwidth_efficiency
    rows = []  # (1, seconds of one pass over [N, D] x tasks, measured rest in ms)
    for name, p in data["presets"].items():
        cfg = get_preset(name)
        one_pass_ms = 1e3 * cfg.tokens_per_chunk * cfg.dim * db / bw
        for e in p["entries"]:
            rest = e["ms_p50"] - cost.group_ms(cfg, sampler, e["tasks"])
            rows.append((e["tasks"] * one_pass_ms, rest))
    overhead, passes = _nonneg_line(rows)
    return replace(
        compute,
        name=f"{base.name.split(' (')[0]} (calibrated: {data['environment'].get('device', '?')})",
        launch_overhead_ms=overhead,
        elementwise_passes=passes,
    )


def _nonneg_line(rows: list[tuple[float, float]]) -> tuple[float, float]:
    """Least squares rest = a + b * x with a, b >= 0."""
    n = len(rows)
    sx = sum(x for x, _ in rows)
    sy = sum(y for _, y in rows)
    sxx = sum(x * x for x, _ in rows)
    sxy = sum(x * y for x, y in rows)
    det = n * sxx - sx * sx
    if det > 0:
        b = (n * sxy - sx * sy) / det
        a = (sy - b * sx) / n
        if a >= 0 and b >= 0:
            return a, b
    # on a bound: one of them 0, the other fitted alone (and clipped at 0)
    a_only = (max(sy / n, 0.0), 0.0)
    b_only = (0.0, max(sxy / sxx, 0.0) if sxx > 0 else 0.0)

    def sse(ab: tuple[float, float]) -> float:
        return sum((y - ab[0] - ab[1] * x) ** 2 for x, y in rows)

    return min(a_only, b_only, key=sse)


def fit_report(spec: DeviceSpec, data: dict) -> dict:
    """Modelled vs measured block time of every measured entry, with the fitted spec."""
    sampler = _sampler(data)
    cost = AnalyticCostModel(spec)
    presets = {}
    for name, p in data["presets"].items():
        cfg = get_preset(name)
        entries = []
        for e in p["entries"]:
            model_ms = cost.group_ms(cfg, sampler, e["tasks"])
            entries.append(
                {
                    "tasks": e["tasks"],
                    "measured_ms": e["ms_p50"],
                    "modelled_ms": round(model_ms, 4),
                    "error": round(model_ms / e["ms_p50"] - 1, 4),
                }
            )
        presets[name] = {"one_task_error": entries[0]["error"], "entries": entries}
    return {
        "environment": data["environment"],
        "device": {
            k: getattr(spec, k)
            for k in ("name", "gemm_efficiency", "attn_efficiency", "elementwise_passes")
        }
        | {"launch_overhead_ms": spec.launch_overhead_ms},
        "presets": presets,
        "max_abs_error": max(abs(e["error"]) for p in presets.values() for e in p["entries"]),
    }


def merge_calibrations(runs: list[dict], sources: list[str]) -> dict:
    """One calibration from several runs on the same device and software: per preset the mean
    of the GEMM-alone and attention-alone times and of every batch size's p50/p99 (the presets
    and batch sizes every run measured). ``sources`` names the runs (kept in the file)."""
    if not runs:
        raise ValueError("no calibration runs to merge")
    env = runs[0]["environment"]
    for r in runs[1:]:
        if r["environment"] != env or (r.get("steps"), r.get("window")) != (
            runs[0].get("steps"),
            runs[0].get("window"),
        ):
            raise ValueError("runs differ in device, versions, steps or window: not one device")
    presets = {}
    for name in runs[0]["presets"]:
        if not all(name in r["presets"] for r in runs):
            continue
        ps = [r["presets"][name] for r in runs]
        sizes = [{e["tasks"] for e in p["entries"]} for p in ps]
        entries = []
        for tasks in sorted(set.intersection(*sizes)):
            rows = [next(e for e in p["entries"] if e["tasks"] == tasks) for p in ps]
            entries.append(
                {
                    "tasks": tasks,
                    "ms_p50": statistics.fmean(e["ms_p50"] for e in rows),
                    "ms_p99": statistics.fmean(e.get("ms_p99", e["ms_p50"]) for e in rows),
                    "runs_ms_p50": [e["ms_p50"] for e in rows],
                }
            )
        presets[name] = {
            "tokens_per_chunk": ps[0]["tokens_per_chunk"],
            "gemm_ms": statistics.fmean(p["gemm_ms"] for p in ps),
            "attn_ms": statistics.fmean(p["attn_ms"] for p in ps),
            "entries": entries,
            "provenance": ps[0].get("provenance", {}),
        }
    return {
        "environment": env,
        "dtype": runs[0].get("dtype"),
        "steps": runs[0].get("steps", 4),
        "window": runs[0].get("window", 2),
        "merged_from": sources,
        "presets": presets,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m physis_ros.engine.pool.calibrate",
        description="fit the modelled H200 to a calibration file, or merge several runs' files",
    )
    sub = p.add_subparsers(dest="cmd", required=True)
    fit = sub.add_parser("fit", help="print the fitted device and its error per entry (JSON)")
    fit.add_argument("calibration")
    merge = sub.add_parser("merge", help="average runs' calibration.json files into one")
    merge.add_argument("runs", nargs="+")
    merge.add_argument("-o", "--out", required=True)
    args = p.parse_args(argv)
    try:
        if args.cmd == "fit":
            data = load_calibration(args.calibration)
            print(json.dumps(fit_report(fit_device(H200, data), data), indent=1))
            return 0
        data = merge_calibrations([load_calibration(r) for r in args.runs], args.runs)
    except ValueError as err:
        print(f"calibrate: {err}", file=sys.stderr)
        return 2
    Path(args.out).write_text(json.dumps(data, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
