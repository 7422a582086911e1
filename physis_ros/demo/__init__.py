"""``physis-demo`` (what ``make demo`` runs): the closed loop on this machine.

Starts physis-serve (the embedded default: ``push-wm`` with its shipped trained weights,
CPU, ephemeral port), ``sim_robot`` (a planar arm pushing a box, its camera at the size and
rate the model was trained on: 32x32 at 10 Hz) and the ``bridge`` as child processes on an
isolated ROS domain with real topics and the real link; the sim robot executes the
trajectories the bridge publishes (a world model publishes none: its scripted policy runs).
With a world-action model (``--model push-wam``, ``--model reach-wam``) the model drives:
sim_robot runs episodes of the task its weights were trained on (their metadata ``task``:
its ``scene``; a goal drawn on the table; it holds still when no trajectory comes), the
bridge executes the model's chunks delay-aware (``--execution``, ``--join``), and the
episodes' successes are printed and summarised; the bridge takes the episode's goal on the
task's goal topic (``task_topic``) and sim_robot's tracked object (``object_topics``) where
the model's contract takes them (its task values; its objects' coordinates): ``Drive``.
Prints once a second the achieved interval against the server's promise, the response
latency, the chunk overlap (the share of chunks that entered the server's pipeline before
the previous one left it: the assembly line at work) and drops; stops ``--duration-s``
after the first predicted chunk (start-up, which a busy machine can make long, does not
count; ``--startup-timeout-s`` bounds it) or on Ctrl-C; stops every child; writes
``summary.json`` and ``strip.png`` (observed | predicted, one row per sampled second) under
``--out``.
No torch in this process: the model runs in physis-serve.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
from pathlib import Path

from physis_ros.cli_errors import cli_main, finite_float
from physis_ros.demo.drive import shipped_camera
from physis_ros.demo.run import DemoRun, served_camera
from physis_ros.demo.strip import StripRows, strip, write_png
from physis_ros.nodes.system import LocalSystem

__all__ = ["StripRows", "main", "shipped_camera", "strip", "write_png"]


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="physis-demo", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--duration-s",
        type=finite_float,
        default=20.0,
        help="run the closed loop this long, from the first predicted chunk (Ctrl-C stops early)",
    )
    parser.add_argument(
        "--startup-timeout-s",
        type=finite_float,
        default=180.0,
        help="give up when no chunk was predicted this long after start (default 180)",
    )
    parser.add_argument(
        "--model",
        default="push-wm",
        help="model preset physis-serve runs (push-wm, push-wam, reach-wam: the shipped trained "
        "weights; others: random weights)",
    )
    parser.add_argument(
        "--weights",
        default=None,
        help="a checkpoint physis-serve serves instead of the preset's shipped weights (e.g. "
        "physis-train-wam's OUT/weights.safetensors with --model push-wam)",
    )
    parser.add_argument(
        "--target-interval-ms",
        type=finite_float,
        default=None,
        help="interval asked of the server (default: the video one chunk covers, 200 ms for "
        "push-wm: on the live timeline a stream gets one chunk per observed chunk, so its "
        "camera sets the interval; a model without a shipped camera: 0, the interval "
        "physis-serve planned, the fastest it can promise a stream)",
    )
    add_execution_arguments(parser)
    parser.add_argument(
        "--out", default="out/demo", help="directory for summary.json and strip.png"
    )
    parser.add_argument(
        "--ranks",
        type=int,
        default=0,
        help="run physis-serve under torchrun with this many ranks (0: one process)",
    )
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        help="physis-serve's Prometheus /metrics on 127.0.0.1 at this port (default: none)",
    )
    parser.add_argument(
        "--domain-id",
        type=int,
        default=None,
        help="ROS_DOMAIN_ID (default: $ROS_DOMAIN_ID or a random one in 150..199)",
    )
    args = parser.parse_args(argv)
    check_args(parser, args)
    return args


def add_execution_arguments(parser: argparse.ArgumentParser) -> None:
    """How the bridge takes a model's chunks: previews, and a world-action model's execution."""
    parser.add_argument(
        "--previews",
        action="store_true",
        help="the bridge asks for previews (each chunk's x0 estimate after every denoising step "
        "but the last, on predicted/preview/step_<k>); the summary says how much sooner they came",
    )
    parser.add_argument(
        "--act-on-previews",
        action="store_true",
        help="with a world-action model: the bridge also executes each preview's action rows "
        "when it arrives (its chunk takes over after); implies --previews; the summary says how "
        "many were acted on and how much sooner the robot started on each chunk's rows",
    )
    parser.add_argument(
        "--execution",
        default="delay_aware",
        choices=["delay_aware", "naive"],
        help="a world-action model's chunks: rows at the time they are for (delay_aware) or "
        "row 0 on arrival (naive, the baseline)",
    )
    parser.add_argument(
        "--join", default="crossfade", choices=["crossfade", "replace"], help="chunk joins"
    )


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if not args.duration_s > 0 or not args.startup_timeout_s > 0:
        parser.error(
            f"--duration-s {args.duration_s} and --startup-timeout-s {args.startup_timeout_s} "
            "must be positive"
        )
    if args.ranks < 0:
        parser.error(f"--ranks must be >= 0, got {args.ranks}")
    if args.metrics_port is not None and not 1 <= args.metrics_port <= 65535:
        parser.error(f"--metrics-port must be 1..65535, got {args.metrics_port}")
    if args.target_interval_ms is not None and args.target_interval_ms < 0:
        parser.error(f"--target-interval-ms must be >= 0, got {args.target_interval_ms}")


@cli_main("physis-demo")
def main(argv=None) -> int:
    args = parse_args(argv)
    args.previews = args.previews or args.act_on_previews
    camera, missing = served_camera(args)
    if missing:  # before anything starts: the server would refuse the preset the same way
        print(f"physis-demo: {missing}", file=sys.stderr)
        return 2
    domain_id = args.domain_id
    if domain_id is None:
        domain_id = int(os.environ.get("ROS_DOMAIN_ID") or random.randint(150, 199))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    loop = LocalSystem(
        domain_id=domain_id, model=args.model, weights=args.weights, log_dir=str(out / "logs")
    )
    os.environ.update(
        {k: loop.env[k] for k in ("ROS_AUTOMATIC_DISCOVERY_RANGE", "FASTDDS_DEFAULT_PROFILES_FILE")}
    )
    print(f"physis-demo: ROS_DOMAIN_ID={domain_id}, logs in {loop.log_dir}", flush=True)
    run = DemoRun(args, loop, camera)
    try:
        run.start(domain_id)
        run.watch()
    except KeyboardInterrupt:
        run.interrupted = True
        print("physis-demo: interrupted, stopping", flush=True)
    finally:
        run.stop()
    return run.report(out)
