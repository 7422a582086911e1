"""``physis-sim``: the pool simulator from the command line.

Experiments: ``--experiment pool24`` (static vs shared max verified concurrency on 24 modelled
H200s, and the bound on sharing), ``--experiment depth`` (one dit-33b stream, one stage per
GPU on 200 GPUs; interval and response latency against chunk size and window, with
``--measured`` block-task times of a real GPU) and ``--experiment frontier`` (the (interval,
response latency, devices per stream) front of ``--model`` on ``--devices`` modelled H200s,
every point simulated; ``--plot PNG`` draws it). Otherwise it admits ``--streams`` streams of
``--model`` on ``--devices`` devices under ``--policy`` (cost from ``--profile`` JSON of
``physis-profile``, or the modelled H200), each asking ``--target-ms`` and
``--latency-budget-ms``, and prints the admissions and the simulation report. ``--json``
prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys

from physis_ros.cli_errors import cli_main, finite_float, refuse_unused_flags
from physis_ros.engine.api import AdmissionRefused
from physis_ros.engine.checkpoints import add_layout_arguments, resolve_model_config
from physis_ros.engine.config import SamplerConfig
from physis_ros.engine.pool.admission import AdmissionController
from physis_ros.engine.pool.calibrate import fit_device, fit_report, load_calibration
from physis_ros.engine.pool.costmodel import H200, AnalyticCostModel, Profile, ProfileCostModel
from physis_ros.engine.pool.memory import MemoryModel
from physis_ros.engine.pool.simulator import SimConfig, simulate
from physis_ros.engine.pool.terms import PoolConfig, StreamRequest
from physis_ros.tools.experiments.depth import depth, load_measured
from physis_ros.tools.experiments.frontier import frontier
from physis_ros.tools.experiments.latencycheck import latencycheck
from physis_ros.tools.experiments.pool24 import max_verified_concurrency, pool24, sim_streams
from physis_ros.tools.experiments.realcheck import realcheck


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="physis-sim", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--experiment",
        choices=("pool24", "depth", "frontier", "realcheck", "latencycheck"),
        help="run a fixed experiment (realcheck: the simulator against gloo ranks on this "
        "host; latencycheck: a latency budget admitted and measured on gloo ranks)",
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
    p.add_argument(
        "--target-ms",
        type=finite_float,
        default=1600.0,
        help="target interval per stream (0: as fast as free devices allow)",
    )
    p.add_argument(
        "--latency-budget-ms",
        type=finite_float,
        default=0.0,
        help="response-latency budget per stream (0: none)",
    )
    p.add_argument("--plot", help="frontier: also draw the front into this PNG")
    p.add_argument(
        "--measured",
        help="depth: block-task times measured on a real GPU (scripts/depth_block_times.py JSON)",
    )
    p.add_argument("--policy", choices=("shared", "static"), default="shared")
    p.add_argument("--max-utilization", type=finite_float, default=0.9)
    p.add_argument("--profile", help="physis-profile JSON (else the modelled H200)")
    p.add_argument(
        "--calibration",
        help="calibration JSON measured on an H200 (scripts/gpu_check.sh): the modelled H200 "
        "of pool24, depth and the pool is fitted to it (engine/pool/calibrate.py)",
    )
    p.add_argument(
        "--memory-gib",
        type=finite_float,
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


POOL_RUN = "the pool run (no --experiment)"
_POOL_FLAGS = {
    "model",
    "resolution",
    "latent_frames",
    "steps",
    "window",
    "devices",
    "streams",
    "target_ms",
    "latency_budget_ms",
    "policy",
    "max_utilization",
    "profile",
    "memory_gib",
    "chunks",
    "no_batching",
    "verify",
    "seed",
    "calibration",
}
FLAGS_USED = {
    POOL_RUN: _POOL_FLAGS,
    "--experiment pool24": {"seed", "calibration"},
    "--experiment depth": {"steps", "window", "measured", "calibration"},
    "--experiment frontier": {
        "model",
        "resolution",
        "latent_frames",
        "devices",
        "steps",
        "window",
        "calibration",
        "plot",
    },
    "--experiment realcheck": {"profile"},
    "--experiment latencycheck": set(),
}
"""The flags each mode reads (the others are refused by name); --json: every mode."""


def _mode(args: argparse.Namespace) -> str:
    return f"--experiment {args.experiment}" if args.experiment else POOL_RUN


def _model(args: argparse.Namespace):
    return resolve_model_config(
        args.model, resolution=args.resolution, latent_frames=args.latent_frames
    )


def run_pool(args: argparse.Namespace) -> dict:
    sampler = SamplerConfig(steps=args.steps, window=args.window)
    cfg = _model(args)
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
    request = StreamRequest(
        model=cfg,
        sampler=sampler,
        target_interval_ms=args.target_ms,
        latency_budget_ms=args.latency_budget_ms,
    )
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
                "devices": len(a.plan.devices()),
                "expected_interval_ms": round(a.expected_interval_ms, 3),
                "expected_response_latency_ms": round(a.expected_response_latency_ms, 3),
                "latency_budget_ms": a.latency_budget_ms,
            }
            for a in admitted
        ],
        "refused": refusals,
    }
    if admitted:
        report = simulate(sim_streams(admitted, args.seed, controller), cost, sim, pool.memory)
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
    if result.get("experiment") == "latencycheck":
        for name in ("without_budget", "with_budget"):
            r = result[name]
            error = r["error"]["response_latency_ms"]
            print(
                f"C {name.replace('_', ' ')}: ranks {r['ranks']} ({r['candidate']}); promised "
                f"{r['promise']['response_latency_ms']} ms response, measured "
                f"{r['measured']['response_latency_ms']} ms (error {error:+.1%})"
            )
        return
    if result.get("experiment") == "depth":
        for key in ("model", "gpus", "interval_ms", "response_latency_ms", "published_interval_ms"):
            print(f"{key}: {result[key]}")
        print(f"{'frames':>6}{'W':>3}{'interval ms':>13}{'response ms':>13}{'measured':>10}")
        for r in result["by_chunk_size_and_window"]:
            measured = r.get("measured_interval_ms")
            print(
                f"{r['latent_frames']:>6}{r['window']:>3}{r['modelled_interval_ms']:>13}"
                f"{r['modelled_response_latency_ms']:>13}{measured if measured else '-':>10}"
            )
        return
    if result.get("experiment") == "frontier":
        print(f"{result['model']} on {result['devices']} GPUs: {len(result['frontier'])} points")
        print(f"{'depth':>6}{'streams':>8}{'dev/stream':>11}{'interval ms':>13}{'response ms':>13}")
        for p in result["frontier"]:
            print(
                f"{p['depth']:>6}{p['streams_per_group']:>8}{p['devices_per_stream']:>11}"
                f"{p['interval_ms']:>13}{p['response_latency_ms']:>13}"
            )
        for p in result["published"]:
            print(f"{p['label']}: reached {p['reached']}")
        return
    if "verified" in result:
        print(
            f"{result['model']} {result['policy']}: admitted {result['admitted']}, "
            f"verified {result['verified']}; refusal: {result['refusal']}"
        )
        return
    for a in result["admitted"]:
        print(
            f"stream {a['stream_id']} ({a['candidate']}, {a['devices']} devices): interval "
            f"{a['expected_interval_ms']} ms, response latency "
            f"{a['expected_response_latency_ms']} ms; {a['placement']}"
        )
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
    return fit_device(H200, load_calibration(args.calibration))


@cli_main("physis-sim")
def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    refuse_unused_flags(parser, args, _mode(args), FLAGS_USED)
    # a bad value raises ValueError: one line and exit 2 (cli_main)
    if args.experiment == "pool24":
        result = pool24(seed=args.seed, device=_device(args))
    elif args.experiment == "depth":
        measured = load_measured(args.measured) if args.measured else None
        result = depth(
            sampler=SamplerConfig(steps=args.steps, window=args.window),
            measured=measured,
            device=_device(args),
        )
    elif args.experiment == "frontier":
        result = frontier(
            _model(args),
            args.devices,
            sampler=SamplerConfig(steps=args.steps, window=args.window),
            device=_device(args),
        )
        if args.plot:
            # Pillow: an optional dependency (the ``eval`` extra), only for --plot
            from physis_ros.tools.experiments.frontier_plot import frontier_chart

            frontier_chart(result, args.plot)
    elif args.experiment == "latencycheck":
        result = latencycheck()
    elif args.experiment == "realcheck":
        profile = Profile.load(args.profile) if args.profile else None
        result = realcheck(profile=profile)
    else:
        result = run_pool(args)
    if args.calibration:
        result["calibration"] = fit_report(_device(args), load_calibration(args.calibration))
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        _print_human(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
