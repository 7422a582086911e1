"""The full GPU measurement of the block path, one measurement group per process.

``scripts/gpu_check.sh OUT`` runs it (about 2.5 minutes on an H200): three presets' blocks
eager, fused and graph, their floors, bf16 accuracy against float32, batching, the engine's
interval per block implementation, and the profiles and fit that calibrate the cost model.
Its short sibling, ``gpu_verify`` (``scripts/gpu_verify.sh``), checks one preset against the
target with a verdict, reusing this module's block measurements; both time with
``gpu_timing``. Each step of ``scripts/gpu_check.sh``, its own process with its own timeout:
  env              device, driver, torch, CUDA, Triton; the two ceilings (8192^3 bf16 matmul,
                   device-to-device copy)                                    -> env.json
  block --model P  one middle block of preset P, bf16, 4680 tokens per chunk, window 2:
                   block-task time eager, fused and graph (the fused forward replayed by
                   engine/block_graphs.py; wall clock, synchronised, as physis-profile times
                   it), the block's GEMMs alone and its attention alone (CUDA events: the
                   floor), the fused forward captured whole as a CUDA graph, 1 vs 4 tasks per
                   forward, bf16 error of eager and fused against a float32 reference and of
                   graph against fused, and the physis-profile JSON of the fused path
                   (cost-model calibration)           -> block_P.json, profile_P.json
  engine --model P the in-process engine on this device (one worker, K=4, W=2): interval of
                   the fused, graph and eager paths (--impls) against the K*L block-task
                   floors                                                  -> engine.json
  summary          the table, calibration.json (engine/pool/calibrate.py's input) and its fit
                                                      -> summary.json, calibration.json
Every measurement is written to its JSON as soon as it is taken; one that fails records its
error and the next runs. ``--smoke`` runs the same code on the CPU (tiny presets, seconds).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import itertools
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from physis_ros.engine import fused
from physis_ros.engine.build import build_model
from physis_ros.engine.config import get_preset
from physis_ros.engine.pipeline import run_plan
from physis_ros.engine.placement import layout_single
from physis_ros.engine.pool.calibrate import fit_device, fit_report
from physis_ros.engine.pool.costmodel import H200, block_work
from physis_ros.engine.stage import BlockTimer, StageCaches, run_block
from physis_ros.engine.threads import InProcRuntime
from physis_ros.tools.block_profile import environment, measure_with_provenance
from physis_ros.tools.gpu_timing import (
    SAMPLER,
    BlockBench,
    Recorder,
    device_ms,
    fmt,
    graph_ms,
    read_json,
    rel,
    sync,
)
from physis_ros.tools.profile_cli import build_parser

DATASHEET_TFLOPS = 989.0
"""H200 dense bf16 peak (datasheet)."""
BF16_FUSED_VS_EAGER = 2e-2
"""Stated bf16 tolerance: ||fused - eager|| / ||eager|| of one block output."""
TAIL_CHUNKS = 6
"""The engine's interval is also taken over the last this many chunks of its longer run: the
steady state (in the graph path every composition captured by then)."""


# ---- env -------------------------------------------------------------------------------------
def check_env(out: Path, dev: torch.device, dtype: torch.dtype, smoke: bool) -> None:
    rec = Recorder(out / "env.json", smoke=smoke)
    with rec.step("versions") as d:
        d.update(environment(str(dev)), python=platform.python_version())
        d["triton"] = _version("triton")
        if dev.type == "cuda":
            props = torch.cuda.get_device_properties(dev)
            d.update(sm_count=props.multi_processor_count, memory_gib=props.total_memory / 2**30)
            d["capability"] = list(torch.cuda.get_device_capability(dev))
    with rec.step("matmul") as d:
        n = 512 if smoke else 8192
        a, b = (torch.randn(n, n, device=dev, dtype=dtype) for _ in range(2))
        ms = device_ms(lambda: a @ b, dev, warmup=3, reps=10)
        d["matmul_tflops"] = 2 * n**3 / ms / 1e9
        d["matmul_shape"] = n
    with rec.step("copy") as d:
        x = torch.randn(2**20 if smoke else 2**30, device=dev, dtype=dtype)  # 2 GiB bf16
        y = torch.empty_like(x)
        ms = device_ms(lambda: y.copy_(x), dev, warmup=2, reps=10)
        d["copy_TBps"] = 2 * x.numel() * x.element_size() / ms / 1e9


def _version(name: str) -> str | None:
    try:
        return __import__(name).__version__
    except ImportError:
        return None


def check_block(out: Path, name: str, dev: torch.device, dtype: torch.dtype, smoke: bool) -> None:
    cfg = get_preset(name)
    work = block_work(cfg, SAMPLER, 2)
    flops = work.gemm_flops + work.attn_flops
    mid = cfg.num_blocks // 2
    reps = 5 if smoke else (20 if cfg.dim < 4096 else 10)
    rec = Recorder(
        out / f"block_{name}.json",
        model=name,
        block=mid,
        tokens_per_chunk=cfg.tokens_per_chunk,
        dtype=str(dtype).removeprefix("torch."),
        gemm_flops=work.gemm_flops,
        attn_flops=work.attn_flops,
    )
    d = rec.data
    bench = BlockBench.build(cfg, dev, dtype, data=d, reps=reps)
    model, one, four = bench.model, bench.one, bench.four
    forward, timed = bench.forward, bench.timed
    with rec.step("eager_1"):
        timed("eager_ms", one)
        d["eager_tflops"] = flops / d["eager_ms"] / 1e9
    runner = fused.FusedBlocks(model)
    d["kernels"] = runner.kernels.name
    with rec.step("gelu_epilogue"):
        check_gelu_epilogue(d, runner, model, mid)
    model.fused_blocks = runner
    with rec.step("fused_1"):
        try:
            timed("fused_ms", one)
        except Exception as err:  # noqa: BLE001 - the torch kernels are the fallback, said so
            d["errors"]["fused_triton"] = repr(err)
            model.fused_blocks = runner = fused.FusedBlocks(model, kernels="torch")
            d["kernels"] = "torch (triton failed)"
            timed("fused_ms", one)
        d["fused_tflops"] = flops / d["fused_ms"] / 1e9
    with rec.step("graph_impl"):
        time_graph_impl(d, runner, one=one, four=four, timed=timed, forward=forward)
    with rec.step("floor"):
        d.update(floor_times(model, mid, runner, dev, dtype, reps=reps))
        d["floor_ms"] = d["gemm_ms"] + d["attn_ms"]
    with rec.step("accuracy"):
        d.update(_accuracy(model, mid, runner, dev))
    with rec.step("batch4"):
        model.fused_blocks = None
        timed("eager4_ms", four)
        model.fused_blocks = runner
        timed("fused4_ms", four)
        d["eager_batch_gain"] = 4 * d["eager_ms"] / d["eager4_ms"]
        d["fused_batch_gain"] = 4 * d["fused_ms"] / d["fused4_ms"]
    with rec.step("profile"):
        argv = ["--model", name, "--device", str(dev), "--dtype", d["dtype"]]
        argv += ["--block-impl", "fused", "--batches", "1,2,4", "--repeats", str(reps)]
        argv += ["--warmup", "2", "--loop-chunks", "8" if cfg.dim < 4096 else "0"]
        profile, provenance = measure_with_provenance(build_parser().parse_args(argv))
        text = json.dumps({**profile.to_json(), "provenance": provenance}, indent=1)
        (out / f"profile_{name}.json").write_text(text + "\n")
        d["profile_ms"] = {e.tasks: e.ms_p50 for e in profile.entries}
    if dev.type == "cuda":
        with rec.step("graph_fused"):
            d["fused_graph_ms"] = graph_ms(forward(one), dev, reps=reps)
        with rec.step("graph_eager"):
            model.fused_blocks = None
            d["eager_graph_ms"] = graph_ms(forward(one), dev, reps=reps)


def check_gelu_epilogue(d: dict, runner, model, mid: int) -> None:
    """The cuBLASLt GELU epilogue against float32 GELU(GEMM); off (said so) if it is wrong."""
    if runner.gelu_epilogue:
        cfg, dev, dtype = model.cfg, model.device, model.dtype
        up = model.blocks[mid].ffn[0]
        y = torch.randn(cfg.tokens_per_chunk, cfg.dim, device=dev, dtype=dtype)
        ref = F.gelu(F.linear(y.float(), up.weight.float(), up.bias.float()), approximate="tanh")
        got = torch._addmm_activation(up.bias, y, up.weight.t(), use_gelu=True)
        d["gelu_epilogue_rel_err"] = rel(got, ref)
        if not d["gelu_epilogue_rel_err"] < 1e-2:  # NaN too
            runner.gelu_epilogue = False
    d["gelu_epilogue"] = runner.gelu_epilogue


def time_graph_impl(d: dict, runner, *, one, four, timed, forward) -> None:
    """Block impl ``graph`` (engine/block_graphs.py): 1 and 4 tasks, its capture counts,
    and its output against the fused forward's on the same inputs (bf16)."""
    runner.set_graphs(True)
    try:
        timed("graph_impl_ms", one)
        timed("graph_impl4_ms", four)
        d["graph_impl_tflops"] = (d["gemm_flops"] + d["attn_flops"]) / d["graph_impl_ms"] / 1e9
        got = forward(one)()[0]
        d["graph_impl_stats"] = runner.graphs.stats.to_json()
        runner.set_graphs(False)
        ref = forward(one)()[0]  # the same inputs and ring slot (the timer's tasks keep no KV)
        d["graph_impl_vs_fused"] = rel(got, ref)
    finally:
        if runner.graphs is not None:
            d["graph_impl_stats"] = runner.graphs.stats.to_json()
        runner.set_graphs(False)


def floor_times(model, mid: int, runner, dev, dtype, *, reps: int) -> dict:
    """The block's weight GEMMs alone and its attention alone, one task, device time."""
    cfg = model.cfg
    blk = model.blocks[mid]
    n, dim, heads, hd = cfg.tokens_per_chunk, cfg.dim, cfg.num_heads, cfg.head_dim
    w = runner.weights(mid)
    y = torch.randn(n, dim, device=dev, dtype=dtype)
    f = torch.randn(n, cfg.ffn_dim, device=dev, dtype=dtype)
    sa, ca, up, down = blk.self_attn, blk.cross_attn, blk.ffn[0], blk.ffn[2]
    gemms = {
        "qkv": (y, w.qkv_w, w.qkv_b),
        "o": (y, sa.o.weight, sa.o.bias),
        "cross_q": (y, ca.q.weight, ca.q.bias),
        "cross_o": (y, ca.o.weight, ca.o.bias),
        "ffn_up": (y, up.weight, up.bias),
        "ffn_down": (f, down.weight, down.bias),
    }
    res = {"gemms_ms": {}}
    for key, (x, wt, b) in gemms.items():
        res["gemms_ms"][key] = device_ms(lambda x=x, wt=wt, b=b: F.linear(x, wt, b), dev,
                                         warmup=3, reps=reps)  # fmt: skip
    if runner.gelu_epilogue:
        res["gemms_ms"]["ffn_up_gelu_epilogue"] = device_ms(
            lambda: torch._addmm_activation(up.bias, y, up.weight.t(), use_gelu=True),
            dev, warmup=3, reps=reps,
        )  # fmt: skip
    res["gemms_ms"]["gelu_alone"] = device_ms(
        lambda: F.gelu(f, approximate="tanh"), dev, warmup=3, reps=reps
    )
    res["gemm_ms"] = sum(res["gemms_ms"][k] for k in gemms)
    keys = (SAMPLER.window + 1) * n
    q = torch.randn(n, heads, hd, device=dev, dtype=dtype).transpose(0, 1)[None]
    k, v = (torch.randn(1, heads, keys, hd, device=dev, dtype=dtype) for _ in range(2))
    ck, cv = (torch.randn(1, heads, cfg.text_len, hd, device=dev, dtype=dtype) for _ in range(2))
    res["self_attn_ms"] = device_ms(
        lambda: F.scaled_dot_product_attention(q, k, v), dev, warmup=3, reps=reps
    )
    res["cross_attn_ms"] = device_ms(
        lambda: F.scaled_dot_product_attention(q, ck, cv), dev, warmup=3, reps=reps
    )
    res["attn_ms"] = res["self_attn_ms"] + res["cross_attn_ms"]
    work = block_work(cfg, SAMPLER, 2)
    res["gemm_tflops"] = work.gemm_flops / res["gemm_ms"] / 1e9
    res["attn_tflops"] = work.attn_flops / res["attn_ms"] / 1e9
    return res


def _accuracy(model, mid: int, runner, dev) -> dict:
    """One block on fresh random inputs: eager and fused (model dtype) against float32."""
    timer = BlockTimer(model, [SAMPLER.window, 1], block=mid, window=SAMPLER.window)
    gen = torch.Generator(device=dev).manual_seed(1234)
    for t in timer.tasks:
        t.h.normal_(generator=gen)
    model.fused_blocks = None  # the float32 copy runs eager (and copies no fused weights)
    ref_model = copy.deepcopy(model).float()
    ref_tasks = []
    for t in timer.tasks:
        ring = copy.copy(t.ring)
        ring.k, ring.v = t.ring.k.float(), t.ring.v.float()
        ref_tasks.append(
            dataclasses.replace(
                t, h=t.h.float(), ring=ring, cross_k=t.cross_k.float(), cross_v=t.cross_v.float()
            )
        )
    ref = run_block(ref_model, mid, ref_tasks, StageCaches(ref_model, [1.0, 0.5, 0.0]))[0]
    model.fused_blocks = None
    eager = run_block(model, mid, timer.tasks, timer.caches)[0]
    model.fused_blocks = runner
    got = run_block(model, mid, timer.tasks, timer.caches)[0]
    res = {
        "eager_vs_fp32": rel(eager, ref),
        "fused_vs_fp32": rel(got, ref),
        "fused_vs_eager": rel(got, eager),
        "finite": bool(torch.isfinite(got).all()),
    }
    res["accuracy_ok"] = (
        res["finite"]
        and res["fused_vs_eager"] <= BF16_FUSED_VS_EAGER
        and res["fused_vs_fp32"] <= 1.5 * res["eager_vs_fp32"] + 1e-3
    )
    return res


# ---- the engine ------------------------------------------------------------------------------
def check_engine(  # noqa: PLR0917
    out: Path,
    name: str,
    dev: torch.device,
    dtype: torch.dtype,
    smoke: bool,
    impls: list[str],
    chunks: tuple[int, int] | None = None,
) -> None:
    """The engine's chunk interval per block implementation: (wall(big) - wall(small)) /
    (big - small) for runs of ``chunks`` = (small, big) chunks after a warm-up run."""
    cfg = get_preset(name)
    K, L = SAMPLER.steps, cfg.num_blocks
    work = block_work(cfg, SAMPLER, 2)
    rec = Recorder(out / "engine.json", model=name, K=K, L=L, window=SAMPLER.window)
    d = rec.data
    env = read_json(out / "env.json")
    block = read_json(out / f"block_{name}.json")
    matmul = env.get("matmul_tflops") or 788.0
    d["matmul_tflops"] = matmul
    d["floor_matmul_ms"] = K * L * (work.gemm_flops + work.attn_flops) / matmul / 1e9
    if block.get("floor_ms"):
        d["floor_parts_ms"] = K * L * block["floor_ms"]
    model = build_model(cfg, seed=None, device=dev, dtype=dtype, block_impl="eager")
    runner = fused.FusedBlocks(model)
    # graph: every run's rings are new, so each run captures its compositions anew (the
    # steady-state ones early in the run, then one replay per block and chunk): the small and
    # big runs hold the same captures, which the difference cancels
    small, big = chunks or ((3, 6) if smoke else (12, 24))

    def run(chunks: int, impl: str) -> tuple[float, list[float], float]:
        """(wall s, when each chunk left (s, sorted), mean tasks per forward)."""
        model.fused_blocks = None if impl == "eager" else runner
        runner.set_graphs(impl == "graph")
        rt = InProcRuntime(model, SAMPLER, layout_single(K, L), batching=True)
        plan = {0: [("generate", None)] * chunks}
        sync(dev)
        t0 = time.perf_counter()
        with rt:
            res = run_plan(rt, plan, mode="pipelined", max_in_flight=K, seeds={0: 0},
                           conds={0: torch.zeros(0, cfg.text_dim)})  # fmt: skip
            sync(dev)
            wall = time.perf_counter() - t0
        left = sorted(r.left_s for r in res[0].values())
        stats = rt.workers[0].stats
        return wall, left, stats.tasks / max(stats.batches, 1)

    for impl in impls:
        with rec.step(f"engine_{impl}"):
            run(4, impl)  # warm-up: kernels, allocator, caches (and a capture or two)
            w_small, _, _ = run(small, impl)
            w_big, left, batch = run(big, impl)
            interval = (w_big - w_small) / (big - small) * 1e3
            gaps = [(b - a) * 1e3 for a, b in itertools.pairwise(left[K:])]
            tail = min(TAIL_CHUNKS, len(left) - 1 - K)  # the last chunks of the longer run
            d[impl] = {
                "interval_ms": interval,
                "interval_tail_ms": (left[-1] - left[-1 - tail]) / tail * 1e3 if tail > 0 else None,
                "tail_chunks": tail,
                "interval_gaps_p50_ms": statistics.median(gaps) if gaps else None,
                "mean_batch": batch,
                "chunks": [small, big],
                "of_matmul_floor": d["floor_matmul_ms"] / interval,
            }
            if impl == "graph":
                d[impl]["graph_stats"] = runner.graphs.stats.to_json()  # all three runs


# ---- summary ---------------------------------------------------------------------------------
def summarize(out: Path, presets: list[str]) -> int:
    env = read_json(out / "env.json")
    blocks = {p: read_json(out / f"block_{p}.json") for p in presets}
    engine = read_json(out / "engine.json")
    cal = {"environment": {k: env.get(k) for k in ("device", "driver", "torch", "cuda")}}
    cal.update(dtype="bfloat16", steps=SAMPLER.steps, window=SAMPLER.window, presets={})
    for p, b in blocks.items():
        prof = read_json(out / f"profile_{p}.json")
        if prof.get("entries") and b.get("gemm_ms") and b.get("attn_ms"):
            cal["presets"][p] = {
                "tokens_per_chunk": b["tokens_per_chunk"],
                "gemm_ms": b["gemm_ms"],
                "attn_ms": b["attn_ms"],
                "entries": prof["entries"],
                "provenance": prof.get("provenance", {}),
            }
    summary: dict = {"environment": env, "blocks": blocks, "engine": engine}
    if cal["presets"]:
        (out / "calibration.json").write_text(json.dumps(cal, indent=1) + "\n")
        try:
            summary["fit"] = fit_report(fit_device(H200, cal), cal)
        except ValueError as err:
            summary["fit"] = {"error": str(err)}
    (out / "summary.json").write_text(json.dumps(summary, indent=1, default=str) + "\n")
    print(_table(env, blocks, engine, summary.get("fit", {})))
    errors = {f"block_{p}": list(b.get("errors", {})) for p, b in blocks.items() if b.get("errors")}
    if engine.get("errors"):
        errors["engine"] = list(engine["errors"])
    if errors:
        print(f"errors (details in the JSON files): {errors}")
    return 0


def _table(env: dict, blocks: dict, engine: dict, fit: dict) -> str:
    mm = env.get("matmul_tflops")
    lines = [
        f"device {env.get('device')} driver {env.get('driver')} torch {env.get('torch')} "
        f"cuda {env.get('cuda')} triton {env.get('triton')}; matmul {fmt(mm, '.0f')} TFLOP/s, "
        f"copy {fmt(env.get('copy_TBps'))} TB/s",
        "preset        eager ms  fused ms  graph-impl ms  captured ms  floor ms  fused/floor  "
        "graph-impl/floor  TFLOP/s f/g  %989 f/g  x4 gain e/f/g  bf16 f-vs-e  g-vs-f  "
        "f/e vs fp32",
    ]
    for p, b in blocks.items():
        flops = (b.get("gemm_flops") or 0) + (b.get("attn_flops") or 0)
        t, g, floor = b.get("fused_ms"), b.get("graph_impl_ms"), b.get("floor_ms")
        tf = flops / t / 1e9 if t else None
        tg = flops / g / 1e9 if g else None
        g4 = 4 * g / b["graph_impl4_ms"] if g and b.get("graph_impl4_ms") else None
        lines.append(
            f"{p:13s} {fmt(b.get('eager_ms')):>8s}  {fmt(t):>8s}  {fmt(g):>13s}  "
            f"{fmt(b.get('fused_graph_ms')):>11s}  {fmt(floor):>8s}  "
            f"{fmt(t / floor if t and floor else None, '.3f'):>11s}  "
            f"{fmt(g / floor if g and floor else None, '.3f'):>16s}  "
            f"{fmt(tf, '.0f'):>5s}/{fmt(tg, '.0f'):<5s} "
            f"{fmt(tf / DATASHEET_TFLOPS * 100 if tf else None, '.0f'):>4s}/"
            f"{fmt(tg / DATASHEET_TFLOPS * 100 if tg else None, '.0f'):<4s} "
            f"{fmt(b.get('eager_batch_gain'))}/{fmt(b.get('fused_batch_gain'))}/{fmt(g4)}  "
            f"{fmt(b.get('fused_vs_eager'), '.1e'):>11s}  "
            f"{fmt(b.get('graph_impl_vs_fused'), '.1e')}  "
            f"{fmt(b.get('fused_vs_fp32'), '.1e')}/{fmt(b.get('eager_vs_fp32'), '.1e')}"
        )
    if engine:
        for impl in [i for i in ("fused", "graph", "eager") if i in engine]:
            e = engine[impl]
            lines.append(
                f"engine {engine.get('model')} {impl}: interval {fmt(e.get('interval_ms'))} ms "
                f"(gaps p50 {fmt(e.get('interval_gaps_p50_ms'))}), mean batch "
                f"{fmt(e.get('mean_batch'))}; floors: matmul rate "
                f"{fmt(engine.get('floor_matmul_ms'))} ms, GEMMs+attention alone "
                f"{fmt(engine.get('floor_parts_ms'))} ms"
            )
    for p, r in fit.get("presets", {}).items():
        lines.append(f"calibrated model {p}: one-task error {fmt(r['one_task_error'] * 100)}%")
    return "\n".join(lines)


# ---- command line ----------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="gpu_check", description=__doc__.split("\n\n")[0])
    p.add_argument("what", choices=("env", "block", "engine", "summary"))
    p.add_argument("--model", default="tiny", help="preset (block, engine)")
    p.add_argument("--presets", default="", help="summary: the block presets, comma separated")
    p.add_argument(
        "--impls", default="fused,graph,eager", help="engine: block implementations to run"
    )
    p.add_argument(
        "--chunks", default="", help="engine: SMALL,BIG chunks of the two timed runs (12,24)"
    )
    p.add_argument("--out", required=True, help="directory for the JSON results")
    p.add_argument("--smoke", action="store_true", help="on the CPU (the same code path)")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.smoke:
        dev = torch.device("cpu")
        torch.set_num_threads(1)
    else:
        if not torch.cuda.is_available():
            print("gpu_check: CUDA is not available (use --smoke on a CPU)", file=sys.stderr)
            return 2
        dev = torch.device("cuda", 0)
        torch.cuda.set_device(dev)
    dtype = torch.bfloat16
    if args.what == "env":
        check_env(out, dev, dtype, args.smoke)
    elif args.what == "block":
        check_block(out, args.model, dev, dtype, args.smoke)
    elif args.what == "engine":
        impls = [x for x in args.impls.split(",") if x]
        bad = set(impls) - set(fused.BLOCK_IMPLS)
        if bad or not impls:
            print(f"gpu_check: --impls {args.impls!r}: not in {fused.BLOCK_IMPLS}", file=sys.stderr)
            return 2
        chunks = tuple(int(x) for x in args.chunks.split(",")) if args.chunks else None
        if chunks is not None and not (len(chunks) == 2 and 0 < chunks[0] < chunks[1]):
            print(f"gpu_check: --chunks {args.chunks!r}: want SMALL,BIG", file=sys.stderr)
            return 2
        check_engine(out, args.model, dev, dtype, args.smoke, impls, chunks)
    else:
        return summarize(out, [x for x in args.presets.split(",") if x])
    return 0


if __name__ == "__main__":
    sys.exit(main())
