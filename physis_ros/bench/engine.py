"""``physis-bench engine``: interval, latency and scheduler efficiency of the in-process engine.

Each mode runs S streams of C generated chunks (plus an observation at chunk 0 and one in the
middle) through the same workers. The interval is the median gap between consecutive outputs
of a stream in steady state (the first ``--skip`` outputs and any gap spanning an observation
excluded); ``block_ms`` is the median of one block forward of one task with a full window,
measured in the same run through the same code (``stage.measure_block_ms``);
``ideal_interval_ms = streams * K * L * block_ms / workers``; ``efficiency = ideal / interval``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np
import torch

from physis_ros.bench import engine_dist
from physis_ros.bench.engine_streams import steady_state_ms, stream_plans
from physis_ros.cli_errors import UsageError, describe, refuse_unused_flags
from physis_ros.engine import fused
from physis_ros.engine.build import build_model
from physis_ros.engine.checkpoints import add_layout_arguments, resolve_model_config
from physis_ros.engine.codec import Codec
from physis_ros.engine.config import PRESETS, SamplerConfig
from physis_ros.engine.controller import MODES
from physis_ros.engine.forward import make_cond
from physis_ros.engine.model import param_count
from physis_ros.engine.oracle import sample as oracle_sample
from physis_ros.engine.pipeline import run_plan
from physis_ros.engine.placement import layout_by_block_even, layout_even
from physis_ros.engine.stage import BlockTimer
from physis_ros.engine.threads import InProcRuntime

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="physis-bench engine",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--model",
        default="tiny",
        help=f"model preset {sorted(PRESETS)} or a model directory (its shapes, random weights)",
    )
    add_layout_arguments(p)
    p.add_argument("--steps", "-K", type=int, default=4, help="denoising steps K")
    p.add_argument("--window", "-W", type=int, default=2, help="history window W (chunks)")
    # 60: a steady state many times the pipeline depth; with a few tens of measured gaps the
    # speedup of a 2-rank run swings by a fifth from run to run.
    p.add_argument("--chunks", "-C", type=int, default=60, help="generated chunks per stream")
    p.add_argument("--streams", "-S", type=int, default=1)
    p.add_argument("--workers", "-N", type=int, default=1)
    p.add_argument("--mode", default="pipelined", choices=[*MODES, "all"])
    p.add_argument("--no-batching", action="store_true", help="one task per forward")
    p.add_argument(
        "--compare-batching",
        action="store_true",
        help="also run pipelined with and without batching in alternating A/B rounds",
    )
    p.add_argument("--ab-rounds", type=int, default=3, help="A/B rounds of --compare-batching")
    p.add_argument(
        "--max-in-flight",
        type=int,
        default=-1,
        help="chunks of a stream in flight in pipelined mode (-1: K*min(N, L))",
    )
    p.add_argument("--skip", type=int, default=-1, help="outputs excluded as fill (-1: K)")
    p.add_argument("--check-oracle", action="store_true", help="compare with the offline sampler")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    p.add_argument(
        "--block-impl",
        choices=("eager", "fused", "graph"),
        default=None,
        help="how blocks run (engine/fused.py; graph: fused, replayed as CUDA graphs, "
        "engine/block_graphs.py); default: $PHYSIS_BLOCK_IMPL, else fused on cuda, eager on cpu",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--ranks",
        type=int,
        default=0,
        help="run over N torch.distributed ranks (physis_ros.bench.engine_dist); 0: in-process",
    )
    return p


def _run_mode(
    model, sampler, args, plans, *, mode: str, batching: bool, timer: BlockTimer | None
) -> dict:
    cfg = model.cfg
    K, L, N = sampler.steps, cfg.num_blocks, args.workers
    if mode == "sequential-clean" and N > 1:
        if N > L:
            return {
                "error": f"sequential-clean needs every block on one worker; {N} workers > L={L}"
            }
        layout = layout_by_block_even(K, L, N)
    else:
        layout = layout_even(K, L, N)
    in_flight = args.max_in_flight if args.max_in_flight >= 0 else K * min(N, L)
    rt = InProcRuntime(model, sampler, layout, batching=batching)
    for w in rt.workers:
        w.record_block_times()
    # With a timer (one worker, inline) a block-time sample is taken after every output, so
    # that it sees the same machine load as the run; the sampling time is cut out of every
    # measured span (``pauses``).
    samples: list[float] = []
    pauses: list[tuple[float, float]] = []

    def sample(_res) -> None:
        t = time.monotonic()
        samples.append(timer.sample())
        pauses.append((t, time.monotonic() - t))

    def span_ms(t0: float, t1: float) -> float:
        return (t1 - t0 - sum(d for s, d in pauses if t0 <= s < t1)) * 1e3

    t0, cpu0 = time.monotonic(), time.process_time()
    with rt:  # its threads (worker loops, host copiers) joined when the run is done
        out = run_plan(
            rt,
            plans,
            mode=mode,
            max_in_flight=in_flight,
            threads=N > 1,
            seeds={s: args.seed + s for s in plans},
            conds={s: make_cond(model.cfg, 100 + s) for s in plans},
            on_output=None if N > 1 or timer is None else sample,
        )
    wall_s = time.monotonic() - t0
    # CPU time is far less sensitive than wall time to other jobs taking the cores
    cpu_ms = (time.process_time() - cpu0 - sum(d for _, d in pauses)) * 1e3
    generated = sum(kind == "generate" for plan in plans.values() for kind, _ in plan)
    skip = args.skip if args.skip >= 0 else K
    entered = {sid: rt.controller.streams[sid].context_entered_s for sid in plans}
    gaps, fills, responses = steady_state_ms(plans, out, entered, skip, span_ms)
    if not gaps:
        return {"error": f"no steady-state gaps: raise --chunks above --skip ({skip})"}
    tasks = sum(w.stats.tasks for w in rt.workers)
    batches = sum(w.stats.batches for w in rt.workers)
    drops = sum(sum(w.stats.drops.values()) for w in rt.workers)
    return {
        "interval_ms": statistics.median(gaps),
        "interval_p99_ms": float(np.percentile(gaps, 99)),
        "interval_samples": len(gaps),
        "fill_latency_ms": statistics.median(fills),
        "response_latency_ms": statistics.median(responses) if responses else None,
        "mean_batch": tasks / max(batches, 1),
        "tasks": tasks,
        "drops": drops,
        "wall_s": wall_s,
        "cpu_ms_per_chunk": cpu_ms / generated,
        "cpu_ms_per_any_chunk": cpu_ms / sum(len(plan) for plan in plans.values()),
        "max_in_flight": in_flight,
        "outputs": out,
        "block_samples": samples,
        "inrun_block_samples": _inrun_block_ms(rt, sampler.window, L),
        "inrun_block_cpu_samples": _inrun_block_ms(rt, sampler.window, L, cpu=True),
        "gaps": gaps,
    }


def _inrun_block_ms(
    rt: InProcRuntime, window: int, blocks: int, *, cpu: bool = False
) -> list[float]:
    """Wall (or thread CPU) times of one-task forwards of middle blocks (no embedding, no
    head; with L < 3 every block) whose chunk had a full window, recorded during the run."""
    middle = set(range(1, blocks - 1)) if blocks >= 3 else set(range(blocks))
    out = []
    for w in rt.workers:
        times = w.stats.block_times or []
        cpus = w.stats.block_cpu_ms or []
        for (blk, b, chunk, ms), cpu_ms in zip(times, cpus, strict=True):
            if b == 1 and blk in middle and chunk >= window:
                out.append(cpu_ms if cpu else ms)
    return out


def _run_block_ms(res: dict) -> float | None:
    """Median block forward measured within one mode's run (None if it has none)."""
    inrun, interleaved = res.get("inrun_block_samples", []), res.get("block_samples", [])
    if len(inrun) >= 5:
        return statistics.median(inrun)
    return statistics.median(interleaved) if interleaved else None


def run(args: argparse.Namespace) -> dict:
    torch.set_num_threads(args.threads)
    cfg = resolve_model_config(
        args.model, resolution=args.resolution, latent_frames=args.latent_frames
    )
    sampler = SamplerConfig(steps=args.steps, window=args.window)
    dtype = DTYPES[args.dtype]
    model = build_model(
        cfg, seed=args.seed, device=args.device, dtype=dtype, block_impl=args.block_impl
    )
    codec = Codec(cfg, device=args.device)
    K, L, N, S = sampler.steps, cfg.num_blocks, args.workers, args.streams
    plans = stream_plans(cfg, args, codec)
    batching = not args.no_batching
    modes = list(MODES) if args.mode == "all" else [args.mode]
    # warm-up (excluded): allocator, kernels, caches
    warm = {0: plans[0][: 2 + min(K, args.chunks)]}
    with InProcRuntime(model, sampler, layout_even(K, L, 1), batching=batching) as rt:
        run_plan(rt, warm, mode="pipelined")
    timer = BlockTimer(model, [args.window])
    block_before = [timer.sample() for _ in range(25)][5:]
    main_mode = "pipelined" if "pipelined" in modes else modes[0]
    results = {}
    for m in modes:
        # interleaved timer samples only where the run itself has no one-task forwards
        use_timer = timer if (m == main_mode and batching) else None
        results[m] = _run_mode(
            model, sampler, args, plans, mode=m, batching=batching, timer=use_timer
        )
    block_after = [timer.sample() for _ in range(20)]
    main = results[main_mode]
    block_ms, block_source = _main_block_ms(main, block_before + block_after)
    ideal = S * K * L * block_ms / N
    report = {
        "model": cfg.name,
        "params": param_count(model),
        "mode": args.mode,
        "main_mode": main_mode,
        "K": K,
        "L": L,
        "window": args.window,
        "workers": N,
        "streams": S,
        "chunks": args.chunks,
        "batching": batching,
        "device": args.device,
        "dtype": args.dtype,
        "block_impl": fused.block_impl(model),
        "threads": args.threads,
        "tokens_per_chunk": cfg.tokens_per_chunk,
        "block_ms": block_ms,
        "block_ms_before": statistics.median(block_before),
        "block_ms_after": statistics.median(block_after),
        "block_ms_source": block_source,
        "block_ms_timer": statistics.median(block_before + block_after),
        "ideal_interval_ms": ideal,
    }
    _add_main_figures(report, main, ideal, K * L, one_worker=N == 1)
    _add_mode_figures(report, results, main, block_ms)
    if args.compare_batching:
        report.update(_compare_batching(model, sampler, args, plans))
    report.update(_codec_ms(cfg, codec))
    if args.check_oracle:
        report["oracle_max_abs_diff"] = _oracle_diff(model, sampler, args, plans, results)
    return report


def _main_block_ms(main: dict, timer_samples: list[float]) -> tuple[float, str]:
    """block_ms, best source first: one-task forwards of middle blocks with a full window
    inside the main run itself; timer samples interleaved with it; samples before/after."""
    inrun, interleaved = main.get("inrun_block_samples", []), main.get("block_samples", [])
    if len(inrun) >= 5:
        return statistics.median(inrun), "in-run one-task forwards"
    if interleaved:
        return statistics.median(interleaved), "timer interleaved with run"
    return statistics.median(timer_samples), "timer before/after"


def _add_main_figures(
    report: dict, main: dict, ideal: float, stages: int, *, one_worker: bool
) -> None:
    """The main mode's interval, latency and efficiency (``stages``: K * L)."""
    for key in (
        "interval_ms",
        "interval_p99_ms",
        "fill_latency_ms",
        "response_latency_ms",
        "mean_batch",
        "max_in_flight",
        "drops",
        "error",
    ):
        if key in main:
            report[key] = main[key]
    if "interval_ms" in main:
        report["efficiency"] = ideal / main["interval_ms"]
    cpu_blocks = main.get("inrun_block_cpu_samples", [])
    if one_worker and len(cpu_blocks) >= 5:
        # the same ratio in CPU time: insensitive to other jobs taking the core
        report["block_cpu_ms"] = statistics.median(cpu_blocks)
        # every chunk of the main (noisy) mode, observations too, passes all K*L stages
        report["efficiency_cpu"] = stages * report["block_cpu_ms"] / main["cpu_ms_per_any_chunk"]


def _add_mode_figures(report: dict, results: dict, main: dict, block_ms: float) -> None:
    """Every mode's interval (or error), and the speedup over sequential-clean."""
    for m, r in results.items():
        report[m.replace("-", "_") + "_interval_ms"] = r.get("interval_ms")
        if "error" in r:
            report[m.replace("-", "_") + "_error"] = r["error"]
    if "sequential-clean" in results and results["sequential-clean"].get("interval_ms"):
        clean = results["sequential-clean"]
        report["speedup_vs_clean"] = clean["interval_ms"] / main["interval_ms"]
        # Modes run one after another; on a shared machine the load drifts between them.
        # Each run's interval in units of a block forward timed within that run cancels it.
        clean_blocks = _run_block_ms(clean)
        if clean_blocks:
            report["speedup_vs_clean_load_normalized"] = (
                clean["interval_ms"] / clean_blocks / (main["interval_ms"] / block_ms)
            )


def _compare_batching(model, sampler, args: argparse.Namespace, plans: dict) -> dict:
    """Pipelined with and without batching in ``args.ab_rounds`` A/B rounds; {} when either
    side measured no gap."""
    # A/B rounds alternate the order, so that drift in the machine's load hits both
    gaps: dict[bool, list[float]] = {True: [], False: []}
    batch_sizes = []
    cpu: dict[bool, list[float]] = {True: [], False: []}
    for r in range(args.ab_rounds):
        for setting in (True, False) if r % 2 == 0 else (False, True):
            res = _run_mode(
                model, sampler, args, plans, mode="pipelined", batching=setting, timer=None
            )
            gaps[setting] += res.get("gaps", [])
            cpu[setting].append(res["cpu_ms_per_chunk"])
            if setting:
                batch_sizes.append(res.get("mean_batch", 0.0))
    if not (gaps[True] and gaps[False]):
        return {}
    on, off = statistics.median(gaps[True]), statistics.median(gaps[False])
    return {
        "interval_batched_ms": on,
        "interval_unbatched_ms": off,
        "batching_speedup": off / on,
        "cpu_ms_per_chunk_batched": statistics.median(cpu[True]),
        "cpu_ms_per_chunk_unbatched": statistics.median(cpu[False]),
        "batching_cpu_speedup": statistics.median(cpu[False]) / statistics.median(cpu[True]),
        "mean_batch_batched": statistics.mean(batch_sizes),
        "ab_rounds": args.ab_rounds,
    }


def _codec_ms(cfg, codec: Codec) -> dict:
    """The codec, timed apart from the DiT (as published DiT numbers are)."""
    frames = np.zeros((cfg.frames_per_chunk, *cfg.image_size, 3), np.uint8)
    enc, dec = [], []
    for _ in range(5):
        t0 = time.perf_counter()
        lat = codec.encode(frames)
        t1 = time.perf_counter()
        codec.decode(lat)
        dec.append((time.perf_counter() - t1) * 1e3)
        enc.append((t1 - t0) * 1e3)
    return {
        "codec": cfg.codec,
        "codec_encode_ms": statistics.median(enc),
        "codec_decode_ms": statistics.median(dec),
    }


def _oracle_diff(model, sampler, args: argparse.Namespace, plans: dict, results: dict) -> float:
    """Largest difference of any mode's outputs from the offline sampler's."""
    diffs = []
    for m, r in results.items():
        if "outputs" not in r:
            continue
        for sid, plan in plans.items():
            cond = make_cond(model.cfg, 100 + sid)
            ref = oracle_sample(model, sampler, plan, mode=m, seed=args.seed + sid, cond=cond)
            diffs += [
                (r["outputs"][sid][c].x.float().cpu() - ref[c].float().cpu()).abs().max().item()
                for c in ref
            ]
    return max(diffs)


def _table(rep: dict) -> str:
    rows = [
        ("model", rep["model"]),
        ("K x L", f"{rep['K']} x {rep['L']}"),
        ("workers / streams", f"{rep['workers']} / {rep['streams']}"),
        ("batching", rep["batching"]),
        ("block_ms", f"{rep['block_ms']:.3f}"),
        ("ideal_interval_ms", f"{rep['ideal_interval_ms']:.2f}"),
    ]
    for key in (
        "interval_ms",
        "interval_p99_ms",
        "efficiency",
        "fill_latency_ms",
        "response_latency_ms",
        "sequential_noisy_interval_ms",
        "sequential_clean_interval_ms",
        "speedup_vs_clean",
        "interval_batched_ms",
        "interval_unbatched_ms",
        "batching_speedup",
        "oracle_max_abs_diff",
    ):
        if rep.get(key) is not None:
            val = rep[key]
            rows.append((key, f"{val:.4g}" if isinstance(val, float) else str(val)))
    return "\n".join(f"{k:32s} {v}" for k, v in rows)


IN_PROCESS, RANKS = "physis-bench engine in process", "physis-bench engine --ranks"
FLAGS_USED = {
    IN_PROCESS: {"workers", "compare_batching", "resolution", "latent_frames"},
    RANKS: {"ranks"},
}
"""The flags only one way of running reads (the ranks' placement is even over --ranks; their
model is the preset's own shape)."""
AB_FLAGS_USED = {"--compare-batching": {"ab_rounds"}, "a run without --compare-batching": set()}


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        refuse_unused_flags(parser, args, RANKS if args.ranks else IN_PROCESS, FLAGS_USED)
        compare = (
            "--compare-batching" if args.compare_batching else "a run without --compare-batching"
        )
        refuse_unused_flags(parser, args, compare, AB_FLAGS_USED)
    except UsageError as err:
        code, line = describe(err, "physis-bench engine")
        print(line, file=sys.stderr)
        return code
    if args.streams < 1 or args.workers < 1 or args.chunks < 2 or args.threads < 1:
        print(
            "physis-bench engine: --streams, --workers, --threads must be >= 1 and --chunks >= 2",
            file=sys.stderr,
        )
        return 2
    if args.block_impl:  # the ranks of --ranks build their models from the environment
        os.environ["PHYSIS_BLOCK_IMPL"] = args.block_impl
    try:
        rep = engine_dist.run(args) if args.ranks else run(args)
    except ValueError as err:
        print(f"physis-bench engine: {err}", file=sys.stderr)
        return 2
    print(json.dumps(rep) if args.json else _table(rep))
    return 0
