"""``physis-profile``: measure per-block time vs batch composition on this device -> JSON.

It builds only the block it times (a middle one) and the model's embeddings, with random
weights, directly on ``--device`` in ``--dtype`` (seconds for any preset), and times one
batched forward of that block through the worker's hot path (``stage.time_block_forward``:
device synchronised, warm-up excluded) for batches of 1, 2, 4, ... tasks whose KV windows
are full (W previous chunks), with the block implementation the engine would use
(``--block-impl``; default ``PHYSIS_BLOCK_IMPL``, else fused on CUDA and eager on the CPU).
It also times one activation hop through the engine's in-process transport, and the worker
loop's own cost per task (one-worker runs of the engine, on a copy of the model cut to at
most 4 blocks, without batching, minus the block forward): ``task_overhead_ms``
(``--loop-chunks 0`` skips it: 0, not measured).
With ``--runtime gloo`` (CPU) the loop, controller, message and hop costs are measured on the
torch.distributed runtime instead (a two-rank job on the local host), and the block times are
scaled to the level the worker's own forwards ran at there (see
``physis_ros.tools.gloo_calibration.calibrate_gloo``). The output is the ``Profile`` JSON
that ``ProfileCostModel`` and ``physis-sim --profile`` read, with a ``provenance`` object
beside its fields (device, driver, torch and CUDA versions, block implementation, build
time). The measuring itself is ``block_profile``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from physis_ros.cli_errors import UsageError, cli_main

DTYPES = ("float32", "bfloat16", "float16")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="physis-profile", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--model",
        default="tiny",
        help="model preset, or a model directory (timed with random weights of its shapes)",
    )
    p.add_argument("--resolution", default="", help="camera HxW of a model directory")
    p.add_argument("--latent-frames", type=int, default=0, help="latent frames per chunk")
    p.add_argument("--steps", type=int, default=4, help="K (recorded; the block cost ignores it)")
    p.add_argument("--window", type=int, default=2, help="W: previous chunks in every KV ring")
    p.add_argument("--batches", default="1,2,4,8", help="batch sizes (tasks), comma separated")
    p.add_argument("--device", default="cpu", help="torch device, e.g. cpu or cuda:0")
    p.add_argument("--dtype", choices=DTYPES, default="float32")
    p.add_argument("--repeats", type=int, default=30, help="timed repeats per batch size")
    p.add_argument("--warmup", type=int, default=5, help="untimed repeats per batch size")
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="measure every batch size this many times, round robin; ms_p50 is the smallest "
        "of the rounds' medians (other jobs on a shared host only ever add time)",
    )
    p.add_argument(
        "--block-impl",
        choices=("eager", "fused", "graph"),  # fused.BLOCK_IMPLS (that module imports torch)
        default=None,
        help="how blocks run: eager, fused (engine/fused.py) or graph (fused, replayed as CUDA "
        "graphs: engine/block_graphs.py); default: $PHYSIS_BLOCK_IMPL, else fused on cuda, "
        "eager on cpu",
    )
    p.add_argument(
        "--loop-chunks",
        type=int,
        default=40,
        help="chunks of each worker-loop calibration run (0: skip, loop overheads 0)",
    )
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    p.add_argument(
        "--gloo-repeats",
        type=int,
        default=5,
        help="with --runtime gloo: runs per calibration measurement (see calibrate_gloo)",
    )
    p.add_argument(
        "--runtime",
        choices=("inproc", "gloo"),
        default="inproc",
        help="where loop and hop costs are measured: in-process workers, or the gloo runtime",
    )
    p.add_argument("--out", help="write the JSON here too")
    return p


@cli_main("physis-profile")
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.out and Path(args.out).is_dir():
        raise UsageError(f"--out {args.out} is a folder", "name the JSON file to write")
    # torch and the engine: seconds of start-up that --help and usage errors do without
    from physis_ros.tools.block_profile import measure_with_provenance

    # a bad value raises ValueError: one line and exit 2 (cli_main)
    profile, provenance = measure_with_provenance(args)
    # ``provenance``: beside the profile's fields (Profile.from_json reads only its own)
    text = json.dumps({**profile.to_json(), "provenance": provenance}, indent=1)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
