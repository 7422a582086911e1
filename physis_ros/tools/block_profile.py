"""What ``physis-profile`` measures (its module docstring says how): one middle block's
batched forward per batch size, an activation hop and the worker loop's own costs on a device
(or the loop, controller and message costs on gloo ranks), as a ``Profile`` with its
provenance."""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from dataclasses import replace

import torch

from physis_ros.engine import fused
from physis_ros.engine.build import build_model
from physis_ros.engine.checkpoints import resolve_model_config
from physis_ros.engine.config import SamplerConfig
from physis_ros.engine.placement import layout_single
from physis_ros.engine.pool.costmodel import Profile, ProfileCostModel, ProfileEntry
from physis_ros.engine.sampler import chunk_numel
from physis_ros.engine.stage import time_block_forward
from physis_ros.engine.threads import InProcRuntime
from physis_ros.engine.transport import Activation, InProcTransport
from physis_ros.tools.gloo_calibration import calibrate_gloo


def _p99(values: list[float]) -> float:
    v = sorted(values)
    return v[min(len(v) - 1, int(0.99 * len(v)))]


def block_entries(
    model, batches: list[int], *, window: int, repeats: int, warmup: int = 5, rounds: int = 1
) -> list[ProfileEntry]:
    """One batched forward of a middle block of ``model`` (the worker's hot path, KV windows
    full), timed for every batch size in ``batches``, ``rounds`` times round robin: ms_p50 is
    the smallest of the rounds' medians (other jobs on a shared host only ever add time)."""
    samples: dict[int, list[list[float]]] = {b: [] for b in batches}
    for _ in range(rounds):
        for b in batches:
            samples[b].append(
                time_block_forward(
                    model, [window] * b, repeats=repeats, warmup=warmup, window=window
                )
            )
    return [
        ProfileEntry(
            tasks=b,
            ms_p50=min(statistics.median(r) for r in rounds_ms),
            ms_p99=_p99([t for r in rounds_ms for t in r]),
        )
        for b, rounds_ms in samples.items()
    ]


def measure(args: argparse.Namespace) -> Profile:
    return measure_with_provenance(args)[0]


def measure_with_provenance(args: argparse.Namespace) -> tuple[Profile, dict]:
    """The profile, and where it was measured (device, driver, torch, CUDA, block
    implementation, the block built, seconds to build it and to the first entry)."""
    t_start = time.perf_counter()
    batches = _batch_sizes(args)
    torch.set_num_threads(args.threads)
    cfg = resolve_model_config(
        args.model, resolution=args.resolution, latent_frames=args.latent_frames
    )
    impl = args.block_impl or fused.default_block_impl(args.device)
    dtype = getattr(torch, args.dtype)
    # The block timed is a middle one (``stage.BlockTimer``): build it alone, on the device.
    timed = cfg.num_blocks // 2
    model = build_model(
        cfg, seed=None, device=args.device, dtype=dtype, block_ids={timed}, block_impl=impl
    )
    built_s = time.perf_counter() - t_start
    print(
        f"physis-profile: block {timed} of {cfg.name} built on {args.device} ({args.dtype}, "
        f"{impl}) in {built_s:.1f} s",
        file=sys.stderr,
    )
    entries = block_entries(
        model,
        batches[:1],
        window=args.window,
        repeats=args.repeats,
        warmup=args.warmup,
        rounds=args.rounds,
    )
    first_s = time.perf_counter() - t_start
    if len(batches) > 1:
        entries += block_entries(
            model,
            batches[1:],
            window=args.window,
            repeats=args.repeats,
            warmup=args.warmup,
            rounds=args.rounds,
        )
    costs, entries = _costs(cfg, args, entries, dtype=dtype, impl=impl)
    runner = fused.fused_blocks(model)
    provenance = {
        **environment(args.device),
        "block_impl": impl,
        "kernels": runner.kernels.name if runner is not None else "eager",
        "block_built": timed,
        "build_s": built_s,
        "first_entry_s": first_s,
        "tokens_per_chunk": cfg.tokens_per_chunk,
    }
    profile = Profile(
        device=_device_name(args.device),
        model=cfg.name,
        steps=args.steps,
        window=args.window,
        dtype=args.dtype,
        entries=tuple(entries),
        **costs,
        comm_overlaps_compute=False,
        comm_threads=args.runtime == "gloo",
        host_cores=len(os.sched_getaffinity(0)) if args.device == "cpu" else 0,
        calibrated_on=args.runtime,
    )
    return profile, provenance


def _batch_sizes(args: argparse.Namespace) -> list[int]:
    """``--batches`` as sorted sizes; a ValueError for any setting out of range."""
    try:
        batches = sorted({int(b) for b in args.batches.split(",")})
    except ValueError:
        raise ValueError(f"--batches must be integers, got {args.batches!r}") from None
    if not batches or batches[0] < 1:
        raise ValueError(f"--batches must be >= 1, got {args.batches!r}")
    if args.repeats < 3 or args.warmup < 0 or args.rounds < 1 or args.gloo_repeats < 1:
        raise ValueError(
            "--repeats must be >= 3, --warmup >= 0, --rounds >= 1 and --gloo-repeats >= 1"
        )
    if args.runtime == "gloo" and args.device != "cpu":
        raise ValueError("--runtime gloo calibrates CPU ranks: use --device cpu")
    if args.loop_chunks < 0:
        raise ValueError("--loop-chunks must be >= 0")
    return batches


def _costs(
    cfg, args: argparse.Namespace, entries: list, *, dtype: torch.dtype, impl: str
) -> tuple[dict, list]:
    """The profile's costs beside the block times, and the block times to keep: on gloo
    ranks (``calibrate_gloo``, which rescales them), or in process (a hop through the
    in-process transport and, unless ``--loop-chunks 0``, the worker loop's overheads)."""
    if args.runtime == "gloo":
        return calibrate_gloo(cfg.name, args.steps, args.window, entries, repeats=args.gloo_repeats)
    costs = {"hop_ms": _inproc_hop_ms(cfg, args.device)}
    if args.loop_chunks:
        loop_cfg = replace(cfg, num_blocks=min(cfg.num_blocks, 4))
        loop_model = build_model(
            loop_cfg, seed=None, device=args.device, dtype=dtype, block_impl=impl
        )
        costs.update(_loop_overheads(loop_model, args, entries, chunks=args.loop_chunks))
    return costs, entries


def environment(device: str) -> dict:
    """Device, driver, torch and CUDA versions (what a profile was measured with)."""
    env = {"device": _device_name(device), "torch": torch.__version__, "cuda": torch.version.cuda}
    if device.startswith("cuda"):
        try:
            smi = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=20,
                check=True,
            )
            env["driver"] = smi.stdout.strip().splitlines()[0]
        except (OSError, subprocess.SubprocessError, IndexError) as err:
            env["driver"] = f"unknown ({err})"
    return env


def _loop_overheads(model, args: argparse.Namespace, entries, chunks: int = 40) -> dict:
    """Calibrate the worker loop's cost outside the block forward from two one-worker runs
    of the engine (every chunk queued at once): without batching (one task per forward)
    wall/task = block(1) + batch_oh + task_oh; with batching (batch sizes recorded)
    wall = sum over forwards of (block(b) + batch_oh) + tasks * task_oh. Medians of 3 runs."""
    sampler = SamplerConfig(steps=args.steps, window=args.window)
    L = model.cfg.num_blocks
    tasks = chunks * args.steps * L  # a per-task cost: the model may be cut to a few blocks
    probe = Profile(
        device="-", model="-", steps=1, window=0, dtype="-", entries=tuple(entries), hop_ms=0.0
    )
    block = ProfileCostModel(probe).block_ms
    solo, batched = [], []
    for run in range(3):
        for batching, out in ((False, solo), (True, batched)):
            rt = InProcRuntime(model, sampler, layout_single(args.steps, L), batching=batching)
            rt.workers[0].record_block_times()
            rt.open_stream(run, seed=run)
            for _ in range(chunks):
                rt.controller.submit_generate(run)
            t0 = time.perf_counter()
            with rt:
                done = rt.run_inline()
                wall_ms = (time.perf_counter() - t0) * 1e3
            if len(done) != chunks:
                raise RuntimeError(f"calibration run finished {len(done)} of {chunks} chunks")
            sizes = [b for _, b, _, _ in rt.workers[0].stats.block_times]
            out.append((wall_ms, sizes))
    a = statistics.median(w / tasks for w, _ in solo) - block(1)
    wall_b, sizes = sorted(batched, key=lambda ws: ws[0])[1]
    rest = wall_b - sum(block(b) for b in sizes)
    batch_oh = (a * tasks - rest) / (tasks - len(sizes)) if len(sizes) < tasks else a
    batch_oh = min(max(batch_oh, 0.0), max(a, 0.0))
    return {"batch_overhead_ms": batch_oh, "task_overhead_ms": max(a - batch_oh, 0.0)}


def _device_name(device: str) -> str:
    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    return f"cpu x{torch.get_num_threads()} threads"


def _inproc_hop_ms(cfg, device: str, repeats: int = 200) -> float:
    """Median time of one Activation through InProcTransport (send -> recv)."""
    a, b = InProcTransport.group(2)
    x = torch.zeros(chunk_numel(cfg), device=device)
    h = torch.zeros(cfg.tokens_per_chunk, cfg.dim, device=device)
    times = []
    for i in range(repeats):
        t0 = time.perf_counter()
        a.send(1, Activation(0, i, 0, 1, 0, x, h))
        got = b.recv(1.0)
        times.append((time.perf_counter() - t0) * 1e3)
        if len(got) != 1:
            raise RuntimeError("in-process hop lost an activation")
    return statistics.median(times)
