"""``physis-bench engine --ranks N``: the engine benchmark over N torch.distributed ranks.

This process becomes rank 0 (controller + a worker); ranks 1..N-1 are child processes started
the way torchrun starts them (``ranks_engine``). The same S streams of C chunks as
the in-process bench (``engine_streams.stream_plans``) run twice in this run: on 1 rank
(the baseline) and on N ranks (stages placed evenly), every rank on ``--threads`` threads.
Reported on top of the in-process keys: ``ranks``, ``backend``, ``comm_ms`` (median of one
activation hop rank 0 -> rank 1, half a measured round trip of x and h through both
transports), ``interval_1_rank_ms`` and ``speedup_vs_1_rank``; the outputs of both runs are
compared with the offline oracle (``oracle_max_abs_diff``). Per rank, over the measured window:
``rank_cpu_share`` (processor seconds the rank's process got per wall second: about 1.0 each
on an otherwise idle machine with one thread per rank; less means other jobs took processor
time and the speedup says little) and ``rank_busy_frac`` (share of the window the rank's
worker spent in block forwards); ``cpu_share_1_rank`` for the baseline.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from physis_ros.bench.engine_streams import steady_state_ms, stream_plans
from physis_ros.engine.api import StreamSpec
from physis_ros.engine.build import build_model
from physis_ros.engine.checkpoints import load_weights, resolve_model_config
from physis_ros.engine.codec import Codec
from physis_ros.engine.core import EngineCore
from physis_ros.engine.forward import make_cond
from physis_ros.engine.oracle import sample_noisy
from physis_ros.engine.ranks.config import RuntimeConfig
from physis_ros.engine.ranks.executor import ranks_engine
from physis_ros.engine.stage import measure_block_ms


def _share(before: dict, after: dict, key: str) -> float:
    """Seconds of ``key`` per wall second between two usage answers of one rank."""
    return round((after[key] - before[key]) / max(after["wall_s"] - before["wall_s"], 1e-9), 3)


def _runtime_config(args: argparse.Namespace) -> RuntimeConfig:
    return RuntimeConfig(
        model=args.model,
        steps=args.steps,
        window=args.window,
        weights_seed=args.seed,
        dtype=args.dtype,
        device="cpu" if args.device == "cpu" else "auto",
        placement="even",
        batching=not args.no_batching,
        threads=args.threads,
    )


def _collect(engine: EngineCore, expected: int, timeout_s: float) -> list:
    out, deadline = [], time.monotonic() + timeout_s
    while len(out) < expected:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{len(out)} of {expected} chunks after {timeout_s} s")
        out += engine.poll_results(0.05)
    return out


def _block_ms(engine: EngineCore, window: int, repeats: int) -> list[float]:
    blocks = sorted(engine.executor.host.blocks)
    block = blocks[len(blocks) // 2]
    return [
        measure_block_ms(engine.model, [window], block=block, repeats=1, warmup=0)
        for _ in range(repeats)
    ]


def measure(args: argparse.Namespace, plans: dict, ranks: int, *, in_flight: int) -> dict:
    """Run ``plans`` on ``ranks`` ranks; timings and the outputs."""
    cfg = _runtime_config(args)
    K = args.steps
    with ranks_engine(cfg, world_size=ranks) as engine:
        hops = engine.executor.measure_hop_ms() if ranks > 1 else []
        # warm-up (excluded): allocator, kernels, caches on every rank
        warm = engine.open_stream(StreamSpec(seed=999), max_in_flight=in_flight).stream_id
        warm_plan = plans[0][: 2 + min(K, args.chunks)]
        for kind, val in warm_plan:
            if kind == "context":
                engine.submit_context_x(warm, val)
            else:
                engine.submit_generate(warm)
        _collect(engine, sum(k == "generate" for k, _ in warm_plan), 600.0)
        engine.close_stream(warm)
        block_before = _block_ms(engine, args.window, 20)
        sids = {}
        for s in plans:
            cond = make_cond(engine.cfg, 100 + s).numpy()
            spec = StreamSpec(seed=args.seed + s, prompt_embedding=cond)
            sids[s] = engine.open_stream(spec, max_in_flight=in_flight).stream_id
        expected = 0
        usage0 = engine.executor.rank_usage()
        t0 = time.monotonic()
        for s, plan in plans.items():
            for kind, val in plan:
                if kind == "context":
                    engine.submit_context_x(sids[s], val)
                else:
                    engine.submit_generate(sids[s])
                    expected += 1
        results = _collect(engine, expected, 600.0)
        wall_s = time.monotonic() - t0
        usage1 = engine.executor.rank_usage()
        entered = {s: dict(engine.controller.streams[sids[s]].context_entered_s) for s in plans}
        block_after = _block_ms(engine, args.window, 20)
        backend = engine.executor.ctx.backend
        drops = sum(engine.executor.host.worker.stats.drops.values())
        batches = engine.executor.host.worker.stats.batches
        tasks = engine.executor.host.worker.stats.tasks
    by_stream = {s: {r.chunk: r for r in results if r.stream_id == sids[s]} for s in plans}
    skip = args.skip if args.skip >= 0 else K
    gaps, fills, responses = steady_state_ms(plans, by_stream, entered, skip)
    if not gaps:
        raise ValueError(f"no steady-state gaps: raise --chunks above --skip ({skip})")
    return {
        "interval_ms": statistics.median(gaps),
        "interval_p99_ms": float(np.percentile(gaps, 99)),
        "interval_samples": len(gaps),
        "fill_latency_ms": statistics.median(fills),
        "response_latency_ms": statistics.median(responses) if responses else None,
        "comm_ms": statistics.median(hops) if hops else None,
        "comm_p99_ms": float(np.percentile(hops, 99)) if hops else None,
        "block_ms": statistics.median(block_before + block_after),
        "backend": backend,
        "wall_s": wall_s,
        "drops_rank0": drops,
        "mean_batch_rank0": tasks / max(batches, 1),
        # Over each rank's own window (its usage answers' timestamps): rank 0's wall window
        # also holds the time the answers took to arrive, which let a share exceed the cores.
        "rank_cpu_share": [_share(usage0[r], usage1[r], "cpu_s") for r in sorted(usage1)],
        "rank_busy_frac": [_share(usage0[r], usage1[r], "busy_s") for r in sorted(usage1)],
        "outputs": {s: {c: r.x.float().cpu() for c, r in by_stream[s].items()} for s in plans},
    }


def run(args: argparse.Namespace) -> dict:
    """The JSON report of ``physis-bench engine --ranks N``."""
    if args.mode not in ("pipelined",):
        raise ValueError("--ranks runs the pipelined mode only")
    torch.set_num_threads(args.threads)
    cfg = resolve_model_config(args.model)
    K, L, N, S = args.steps, cfg.num_blocks, args.ranks, args.streams
    plans = stream_plans(cfg, args, Codec(cfg))
    in_flight = args.max_in_flight if args.max_in_flight >= 0 else K * min(N, L)
    base = measure(args, plans, 1, in_flight=in_flight)
    multi = measure(args, plans, N, in_flight=in_flight)
    block_ms = statistics.median([base["block_ms"], multi["block_ms"]])
    ideal = S * K * L * block_ms / N
    rcfg = _runtime_config(args)
    # The oracle (one masked forward over the whole sequence) is cheap for the pixel-codec
    # presets; for the Wan presets it needs --check-oracle (and the memory of a dense mask).
    check = args.check_oracle or cfg.codec == "pixel"
    model = (
        build_model(cfg, seed=args.seed, device=args.device, dtype=rcfg.torch_dtype)
        if check
        else None
    )
    if model is not None and rcfg.resolved.weights is not None:  # the ranks loaded these too
        load_weights(model, rcfg.resolved.weights)
    diffs = []
    for s, plan in plans.items() if check else ():
        cond = make_cond(cfg, 100 + s)
        ref = sample_noisy(model, rcfg.sampler_config, plan, seed=args.seed + s, cond=cond)
        for run_ in (base, multi):
            diffs += [
                (run_["outputs"][s][c] - ref[c].float().cpu()).abs().max().item() for c in ref
            ]
    report = {
        "model": cfg.name,
        "params": cfg.num_params(),
        "mode": "pipelined",
        "main_mode": "pipelined",
        "K": K,
        "L": L,
        "window": args.window,
        "workers": N,
        "ranks": N,
        "backend": multi["backend"],
        "streams": S,
        "chunks": args.chunks,
        "batching": not args.no_batching,
        "device": args.device,
        "dtype": args.dtype,
        "threads": args.threads,
        "tokens_per_chunk": cfg.tokens_per_chunk,
        "block_ms": block_ms,
        "ideal_interval_ms": ideal,
        "max_in_flight": in_flight,
    }
    for key in ("interval_ms", "interval_p99_ms", "fill_latency_ms", "response_latency_ms"):
        report[key] = multi[key]
    report["efficiency"] = ideal / multi["interval_ms"]
    report["comm_ms"] = multi["comm_ms"]
    report["comm_p99_ms"] = multi["comm_p99_ms"]
    report["interval_1_rank_ms"] = base["interval_ms"]
    report["speedup_vs_1_rank"] = base["interval_ms"] / multi["interval_ms"]
    report["wall_s_1_rank"] = base["wall_s"]
    report["wall_s"] = multi["wall_s"]
    report["rank_cpu_share"] = multi["rank_cpu_share"]
    report["rank_busy_frac"] = multi["rank_busy_frac"]
    report["cpu_share_1_rank"] = base["rank_cpu_share"][0]
    report["oracle_max_abs_diff"] = max(diffs) if diffs else None
    return report
