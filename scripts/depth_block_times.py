"""One block-task of a preset, timed on a real device for several chunk sizes and windows.

The depth experiment's interval is one block-task (one stage per GPU), so what a real GPU
takes for one block at 1, 2 or 3 latent frames per chunk and window W decides whether the
published 4.083 ms is reachable. For each (model, latent frames, W, tasks) this times one
batched forward of a middle block through the worker's hot path (``stage.time_block_forward``,
device synchronised, warm-up excluded), beside the modelled H200's time for the same work,
and prints JSON (docs/pool/h200_block_times.json holds a run on an H200).

    python scripts/depth_block_times.py --device cuda --out h200_block_times.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from physis_ros.engine.build import build_model
from physis_ros.engine.config import SamplerConfig, get_preset
from physis_ros.engine.pool.costmodel import H200, AnalyticCostModel, block_work
from physis_ros.engine.stage import time_block_forward


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",")]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="dit-33b,wan2.1-14b")
    ap.add_argument("--frames", default="1,2,3", help="latent frames per chunk")
    ap.add_argument("--windows", default="1,2,3,6", help="W: previous chunks attended")
    ap.add_argument("--tasks", default="1,2", help="tasks per batched forward")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--out", help="also write the JSON here")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    modelled = AnalyticCostModel(H200)
    rows = []
    started = time.perf_counter()
    for name in args.models.split(","):
        for frames in _ints(args.frames):
            cfg = get_preset(name, latent_frames=frames)
            block = cfg.num_blocks // 2
            t0 = time.perf_counter()
            model = build_model(cfg, device=args.device, dtype=dtype, block_ids={block})
            build_s = time.perf_counter() - t0
            for window in _ints(args.windows):
                sampler = SamplerConfig(steps=4, window=window)
                work = block_work(cfg, sampler, 2)
                for tasks in _ints(args.tasks):
                    ms = time_block_forward(
                        model,
                        [window] * tasks,
                        block=block,
                        repeats=args.repeats,
                        warmup=args.warmup,
                        window=window,
                    )
                    p50 = statistics.median(ms)
                    flop = tasks * (work.gemm_flops + work.attn_flops)
                    rows.append(
                        {
                            "model": name,
                            "latent_frames": frames,
                            "tokens_per_chunk": cfg.tokens_per_chunk,
                            "window": window,
                            "tasks": tasks,
                            "ms_p50": round(p50, 4),
                            "ms_min": round(min(ms), 4),
                            "ms_max": round(max(ms), 4),
                            "tflop_per_s": round(flop / p50 / 1e9, 1),
                            "gemm_tflop": round(tasks * work.gemm_flops / 1e12, 4),
                            "attn_tflop": round(tasks * work.attn_flops / 1e12, 4),
                            "modelled_h200_ms": round(modelled.group_ms(cfg, sampler, tasks), 4),
                            "build_s": round(build_s, 1),
                        }
                    )
                    print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
            del model
            if args.device.startswith("cuda"):
                torch.cuda.empty_cache()
    device_name = (
        torch.cuda.get_device_name(0) if args.device.startswith("cuda") else platform.processor()
    )
    out = {
        "device": device_name,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "dtype": args.dtype,
        "method": "stage.time_block_forward: one batched forward of a middle block through "
        f"run_block, KV rings holding W chunks, {args.warmup} warm-up + {args.repeats} timed, "
        "device synchronised around each",
        "runtime_s": round(time.perf_counter() - started, 1),
        "rows": rows,
    }
    text = json.dumps(out, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
