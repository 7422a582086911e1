"""``physis-sim``: the pool simulator from the command line.

Experiments: ``--experiment pool24`` (static vs shared max verified concurrency on 24 modelled
H200s) and ``--experiment depth`` (one dit-33b stream, one stage per GPU on 200 GPUs).
Otherwise it admits ``--streams`` streams of ``--model`` on ``--devices`` devices under
``--policy`` (cost from ``--profile`` JSON of ``physis-profile``, or the modelled H200) and
prints the admissions and the simulation report. ``--json`` prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys

from physis_ros.engine.api import AdmissionRefused
from physis_ros.engine.checkpoints import add_layout_arguments, resolve_model_config
from physis_ros.engine.config import SamplerConfig
from physis_ros.engine.pool.admission import AdmissionController, PoolConfig, StreamRequest
from physis_ros.engine.pool.costmodel import H200, AnalyticCostModel, Profile, ProfileCostModel
from physis_ros.engine.pool.experiments import depth, max_verified_concurrency, pool24, sim_streams
from physis_ros.engine.pool.memory import MemoryModel
from physis_ros.engine.pool.simulator import SimConfig, simulate


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="physis-sim", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--experiment",
        choices=("pool24", "depth", "realcheck"),
        help="run a fixed experiment (realcheck: the simulator against gloo ranks on this host)",
    )
    p.add_argument(
        "--model",
        default="wan2.1-14b",
        help="model preset, or a model directory (upstream Wan or diffusers: its shapes)",
    )
    add_layout_arguments(p)
    p.add_argument("--steps", type=int, default=4, help="K denoising steps")
    p.add_argument("--window", type=int, default=2, help="W history window (chunks)")
    p.add_argument("--devices", type=int, default=24, help="G devices in the pool")
    p.add_argument("--streams", type=int, default=0, help="streams to admit (0: until refused)")
    p.add_argument("--target-ms", type=float, default=1600.0, help="target interval per stream")
    p.add_argument("--policy", choices=("shared", "static"), default="shared")
    p.add_argument("--max-utilization", type=float, default=0.9)
    p.add_argument("--profile", help="physis-profile JSON (else the modelled H200)")
    p.add_argument(
        "--calibration",
        help="calibration JSON measured on an H200 (scripts/gpu_check.sh): the modelled H200 "
        "of pool24, depth and the pool is fitted to it (engine/pool/calibrate.py)",
    )
    p.add_argument(
        "--memory-gib",
        type=float,
        default=0.0,
        help="usable memory per device with --profile (GiB)",
    )
    p.add_argument("--chunks", type=int, default=16, help="chunks simulated per stream")
    p.add_argument("--no-batching", action="store_true")
    p.add_argument(
        "--verify",
        action="store_true",
        help="report max verified concurrency instead of one simulation",
    )
    p.add_argument("--seed", type=int, default=0, help="seeds the stream phases")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p


def run_pool(args: argparse.Namespace) -> dict:
    sampler = SamplerConfig(steps=args.steps, window=args.window)
    cfg = resolve_model_config(
        args.model, resolution=args.resolution, latent_frames=args.latent_frames
    )
    if args.profile:
        profile = Profile.load(args.profile)
        cost = ProfileCostModel(profile)
        if args.memory_gib <= 0:
            raise ValueError("--profile needs --memory-gib (usable memory per device)")
        usable, dtype_bytes = args.memory_gib * 1024**3, 4 if profile.dtype == "float32" else 2
    else:
        device = _device(args)
        cost = AnalyticCostModel(device)
        usable, dtype_bytes = device.usable_bytes, device.dtype_bytes
    pool = PoolConfig(
        num_devices=args.devices,
        usable_bytes=usable,
        policy=args.policy,
        max_utilization=args.max_utilization,
        memory=MemoryModel(dtype_bytes=dtype_bytes),
    )
    request = StreamRequest(model=cfg, sampler=sampler, target_interval_ms=args.target_ms)
    sim = SimConfig(
        num_devices=args.devices,
        chunks=args.chunks,
        warmup_chunks=4,
        cooldown_chunks=2,
        batching=not args.no_batching,
    )
    if args.verify:
        return {
            "model": cfg.name,
            "cost_model": cost.name,
            **max_verified_concurrency(
                request=request, pool=pool, cost=cost, sim=sim, seed=args.seed
            ),
        }
    controller = AdmissionController(pool, cost)
    admitted, refusals = [], []
    limit = args.streams or 10_000
    while len(admitted) < limit:
        try:
            admitted.append(controller.admit(request))
        except AdmissionRefused as refusal:
            refusals.append(
                {
                    "resource": refusal.resource,
                    "reason": refusal.reason,
                    "shortfall": refusal.shortfall,
                }
            )
            break
    out: dict = {
        "model": cfg.name,
        "cost_model": cost.name,
        "policy": args.policy,
        "admitted": [
            {
                "stream_id": a.plan.stream_id,
                "candidate": a.candidate,
                "placement": a.plan.describe(),
                "expected_interval_ms": a.expected_interval_ms,
                "expected_response_latency_ms": round(a.expected_response_latency_ms, 3),
            }
            for a in admitted
        ],
        "refused": refusals,
    }
    if admitted:
        report = simulate(sim_streams(admitted, args.seed), cost, sim, pool.memory)
        out["simulation"] = report.to_json()
    return out


def _print_human(result: dict) -> None:
    if result.get("experiment") == "pool24":
        print(f"{'backbone':<16}{'static':>8}{'shared':>8}{'ratio':>8}")
        for row in result["rows"]:
            print(f"{row['backbone']:<16}{row['static']:>8}{row['shared']:>8}{row['ratio']:>8}")
        return
    if result.get("experiment") == "realcheck":
        for c in result["cases"]:
            print(
                f"ranks {c['ranks']} streams {c['streams']}: measured "
                f"{c['measured_interval_ms']:.3f} ms, predicted {c['predicted_interval_ms']:.3f} "
                f"ms, error {c['error']:+.1%}"
            )
        return
    if result.get("experiment") == "depth":
        for key in ("model", "gpus", "interval_ms", "response_latency_ms", "published_interval_ms"):
            print(f"{key}: {result[key]}")
        return
    if "verified" in result:
        print(
            f"{result['model']} {result['policy']}: admitted {result['admitted']}, "
            f"verified {result['verified']}; refusal: {result['refusal']}"
        )
        return
    for a in result["admitted"]:
        print(f"stream {a['stream_id']} ({a['candidate']}): {a['placement']}")
    for r in result["refused"]:
        print(f"refused: {r['reason']}")
    sim = result.get("simulation")
    if sim:
        for s in sim["streams"]:
            print(
                f"stream {s['stream_id']}: interval p50 {s['interval_p50_ms']:.2f} ms "
                f"p99 {s['interval_p99_ms']:.2f} ms, latency p50 {s['latency_p50_ms']:.1f} ms, "
                f"misses {s['deadline_misses']}, meets target {s['meets_target']}"
            )


def _device(args: argparse.Namespace):
    """The modelled H200, fitted to ``--calibration`` when given."""
    if not args.calibration:
        return H200
    from physis_ros.engine.pool.calibrate import fit_device, load_calibration

    return fit_device(H200, load_calibration(args.calibration))


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.experiment == "pool24":
            result = pool24(seed=args.seed, device=_device(args))
        elif args.experiment == "depth":
            sampler = SamplerConfig(steps=args.steps, window=args.window)
            result = depth(sampler=sampler, device=_device(args))
        elif args.experiment == "realcheck":
            from physis_ros.tools.realcheck import realcheck

            profile = Profile.load(args.profile) if args.profile else None
            result = realcheck(profile=profile)
        else:
            result = run_pool(args)
        if args.calibration:
            from physis_ros.engine.pool.calibrate import fit_report, load_calibration

            result["calibration"] = fit_report(_device(args), load_calibration(args.calibration))
    except ValueError as err:
        print(f"physis-sim: {err}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        _print_human(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
