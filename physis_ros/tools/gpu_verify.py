"""The short GPU verification of the CUDA-graph block path: one preset's block-task against
its GEMM + attention floor, with a verdict (``target_met``), in one run of well under two
minutes on an H200. ``gpu_check`` is the full measurement (three presets, accuracy against
float32, batching, profiles and the cost-model calibration); this reuses its env and engine
steps and its block measurements, and ``gpu_timing``'s timers. Each step its own process
(``scripts/gpu_verify.sh OUT``):

  gpu_check env            versions, the matmul and copy ceilings           -> env.json
  block --model P          one middle block of P (bf16, 4680 tokens per chunk, window 2):
                           block-task p50 wall time eager, fused and graph (the fused forward
                           replayed by engine/block_graphs.py), 4 tasks graph, the block's
                           GEMMs alone + its attention alone (the floor), the fused forward
                           captured whole (no launch overhead at all), and graph, fused and
                           eager outputs on the same inputs (max abs and relative errors)
                                                                            -> block_P.json
  gpu_check engine         the in-process engine of P on this device, fused and graph, runs
                           of 8 and 16 chunks after a warm-up run: the chunk interval (the
                           runs' difference / 8, and over the last 6 chunks of the longer)
                           against the K*L floors                          -> engine.json
  summary --model P        the verdict and the table                        -> verify.json
Every measurement is written to its JSON as soon as it is taken; one that fails records its
error and the next runs. ``--smoke`` runs the same code on the CPU (tiny preset, seconds).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from physis_ros.engine import fused
from physis_ros.engine.config import get_preset
from physis_ros.engine.pool.costmodel import block_work
from physis_ros.engine.stage import BlockTimer, run_block
from physis_ros.tools.gpu_check import (
    BF16_FUSED_VS_EAGER,
    check_gelu_epilogue,
    floor_times,
    time_graph_impl,
)
from physis_ros.tools.gpu_timing import (
    SAMPLER,
    BlockBench,
    Recorder,
    fmt,
    graph_ms,
    read_json,
    rel,
)

GRAPH_OVER_FLOOR = 1.10
"""The target: a block-task within 10% of its GEMM + attention time."""


# ---- one block -------------------------------------------------------------------------------
def verify_block(out: Path, name: str, dev: torch.device, dtype: torch.dtype, smoke: bool) -> None:
    cfg = get_preset(name)
    work = block_work(cfg, SAMPLER, 2)
    mid = cfg.num_blocks // 2
    reps = 5 if smoke else 20
    rec = Recorder(
        out / f"block_{name}.json",
        model=name,
        block=mid,
        tokens_per_chunk=cfg.tokens_per_chunk,
        window=SAMPLER.window,
        dtype=str(dtype).removeprefix("torch."),
        gemm_flops=work.gemm_flops,
        attn_flops=work.attn_flops,
        reps=reps,
        timing="p50 of reps wall-clock forwards, synchronised before and after each",
    )
    d = rec.data
    bench = BlockBench.build(cfg, dev, dtype, data=d, reps=reps)
    model, one, four = bench.model, bench.one, bench.four
    forward, timed = bench.forward, bench.timed
    with rec.step("eager"):
        timed("eager_ms", one)
    runner = fused.FusedBlocks(model)
    d["kernels"] = runner.kernels.name
    with rec.step("gelu_epilogue"):
        check_gelu_epilogue(d, runner, model, mid)
    model.fused_blocks = runner
    with rec.step("fused"):
        timed("fused_ms", one)
    with rec.step("graph_impl"):
        time_graph_impl(d, runner, one=one, four=four, timed=timed, forward=forward)
    with rec.step("floor"):
        d.update(floor_times(model, mid, runner, dev, dtype, reps=reps))
        d["floor_ms"] = d["gemm_ms"] + d["attn_ms"]
        for impl in ("eager", "fused", "graph_impl"):
            if d.get(f"{impl}_ms"):
                d[f"{impl}_over_floor"] = d[f"{impl}_ms"] / d["floor_ms"]
    with rec.step("errors"):
        d.update(output_errors(model, mid, runner, one))
    if dev.type == "cuda":
        with rec.step("graph_fused"):
            model.fused_blocks = runner
            runner.set_graphs(False)
            d["fused_graph_ms"] = graph_ms(forward(one), dev, reps=reps)


def output_errors(model, mid: int, runner: fused.FusedBlocks, timer: BlockTimer) -> dict:
    """Eager, fused and graph outputs of one block-task on the same inputs (a full ring; the
    timer's task keeps no KV, so every call writes the same slot and attends the same ring).
    The graph output is that of a replay: the 1st call of a composition runs the static path,
    the 2nd captures it and replays."""

    def run() -> torch.Tensor:
        return run_block(model, mid, timer.tasks, timer.caches)[0].float()

    model.fused_blocks = None
    eager = run()
    model.fused_blocks = runner
    runner.set_graphs(False)
    fused_out = run()
    runner.set_graphs(True)
    try:
        graph = [run() for _ in range(3)][-1]
        stats = runner.graphs.stats.to_json()
    finally:
        runner.set_graphs(False)

    def max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a - b).abs().max())

    res = {
        "eager_max_abs": float(eager.abs().max()),
        "graph_vs_eager_max_abs": max_abs(graph, eager),
        "fused_vs_eager_max_abs": max_abs(fused_out, eager),
        "graph_vs_fused_max_abs": max_abs(graph, fused_out),
        "graph_vs_eager_rel": rel(graph, eager),
        "fused_vs_eager_rel": rel(fused_out, eager),
        "graph_stats_errors": stats,
        "finite": bool(torch.isfinite(graph).all()),
    }
    res["graph_replayed"] = stats["replays"] > 0
    res["errors_ok"] = res["finite"] and res["graph_vs_eager_rel"] <= BF16_FUSED_VS_EAGER
    return res


# ---- the verdict -----------------------------------------------------------------------------
BLOCK_KEYS = [
    "eager_ms",
    "graph_impl_ms",
    "fused_ms",
    "graph_impl4_ms",
    "fused_graph_ms",
    "gemm_ms",
    "attn_ms",
    "floor_ms",
    "eager_over_floor",
    "fused_over_floor",
    "graph_impl_over_floor",
    "kernels",
    "gelu_epilogue",
    "graph_impl_stats",
]
ERROR_KEYS = [
    "eager_max_abs",
    "graph_vs_eager_max_abs",
    "fused_vs_eager_max_abs",
    "graph_vs_fused_max_abs",
    "graph_vs_eager_rel",
    "fused_vs_eager_rel",
    "graph_replayed",
    "errors_ok",
]


def summarize(out: Path, name: str) -> dict:
    env, block, engine = (
        read_json(out / f) for f in ("env.json", f"block_{name}.json", "engine.json")
    )
    steps = {"env": env, "block": block, "engine": engine}
    v: dict = {
        "model": name,
        "environment": {k: env.get(k) for k in ("device", "driver", "torch", "cuda", "triton")},
        "matmul_tflops": env.get("matmul_tflops"),
        "block": {k: block.get(k) for k in BLOCK_KEYS},
        "errors_bf16": {k: block.get(k) for k in ERROR_KEYS},
        "engine": {
            k: engine.get(k) for k in ("K", "L", "window", "floor_matmul_ms", "floor_parts_ms")
        },
        "failed_steps": {f: sorted(x["errors"]) for f, x in steps.items() if x.get("errors")},
        "missing": [f for f, x in steps.items() if not x],
    }
    for impl in ("fused", "graph"):
        if impl in engine:
            v["engine"][impl] = engine[impl]
    ratio = block.get("graph_impl_over_floor")
    v["target_graph_over_floor"] = GRAPH_OVER_FLOOR
    v["target_met"] = ratio is not None and ratio <= GRAPH_OVER_FLOOR
    (out / "verify.json").write_text(json.dumps(v, indent=1, default=str) + "\n")
    print(_table(v))
    return v


def _table(v: dict) -> str:
    b, e, x = v["block"], v["engine"], v["errors_bf16"]
    env = v["environment"]
    lines = [
        f"device {env.get('device')} driver {env.get('driver')} torch {env.get('torch')} "
        f"triton {env.get('triton')}; {v['model']}, one block-task, bf16, window 2",
        f"block-task p50 ms: eager {fmt(b.get('eager_ms'))}  fused {fmt(b.get('fused_ms'))}  "
        f"graph {fmt(b.get('graph_impl_ms'))}  (captured whole {fmt(b.get('fused_graph_ms'))}; "
        f"4 tasks graph {fmt(b.get('graph_impl4_ms'))})",
        f"floor (GEMMs {fmt(b.get('gemm_ms'), '.3f')} + attention {fmt(b.get('attn_ms'), '.3f')})"
        f" {fmt(b.get('floor_ms'), '.3f')} ms; over the floor: eager "
        f"{fmt(b.get('eager_over_floor'), '.3f')}, fused {fmt(b.get('fused_over_floor'), '.3f')},"
        f" graph {fmt(b.get('graph_impl_over_floor'), '.3f')} (target <= {GRAPH_OVER_FLOOR}: "
        f"{'met' if v['target_met'] else 'NOT met'})",
        f"bf16 output vs eager: graph max abs {fmt(x.get('graph_vs_eager_max_abs'), '.3e')} "
        f"(rel {fmt(x.get('graph_vs_eager_rel'), '.2e')}), fused max abs "
        f"{fmt(x.get('fused_vs_eager_max_abs'), '.3e')} (rel "
        f"{fmt(x.get('fused_vs_eager_rel'), '.2e')}); graph vs fused max abs "
        f"{fmt(x.get('graph_vs_fused_max_abs'), '.3e')}; |eager| max "
        f"{fmt(x.get('eager_max_abs'), '.3e')}; replayed {x.get('graph_replayed')}, ok "
        f"{x.get('errors_ok')}",
    ]
    for impl in ("fused", "graph"):
        r = e.get(impl)
        if r:
            lines.append(
                f"engine {impl}: interval {fmt(r.get('interval_ms'))} ms (runs of {r.get('chunks')}"
                f" chunks; last {r.get('tail_chunks')} chunks {fmt(r.get('interval_tail_ms'))}, "
                f"gaps p50 {fmt(r.get('interval_gaps_p50_ms'))}), mean batch "
                f"{fmt(r.get('mean_batch'))}; floors: matmul rate {fmt(e.get('floor_matmul_ms'))}"
                f" ms, GEMMs+attention {fmt(e.get('floor_parts_ms'))} ms"
            )
    if v["failed_steps"] or v["missing"]:
        lines.append(f"failed steps {v['failed_steps']}, missing {v['missing']} (see the JSON)")
    return "\n".join(lines)


# ---- command line ----------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="gpu_verify", description=__doc__.split("\n\n")[0])
    p.add_argument("what", choices=("block", "summary"))
    p.add_argument("--model", default="wan2.1-1.3b", help="preset")
    p.add_argument("--out", required=True, help="directory for the JSON results")
    p.add_argument("--smoke", action="store_true", help="on the CPU (the same code path)")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.what == "summary":
        summarize(out, args.model)
        return 0
    if args.smoke:
        dev = torch.device("cpu")
        torch.set_num_threads(1)
    else:
        if not torch.cuda.is_available():
            print("gpu_verify: CUDA is not available (use --smoke on a CPU)", file=sys.stderr)
            return 2
        dev = torch.device("cuda", 0)
        torch.cuda.set_device(dev)
    verify_block(out, args.model, dev, torch.bfloat16, args.smoke)
    return 0


if __name__ == "__main__":
    sys.exit(main())
