"""``physis-eval --closed-loop``: the world-action model drives the simulated robot.

Builds the in-process engine on the weights (default: the shipped model of the task), runs
the task's scripted expert and the model at each ``--delay-ms`` in each execution mode on the
same held-out episodes, writes ``report.json``, ``report.md``, the paths of what the task
moves and one episode's strip into ``--out``, and prints one JSON line: each run's success
rate, time to goal, action error and the largest joint-target jump where chunks join. The
task: ``--task``, else the one the weights were trained on (metadata ``task``), else push.
"""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

from physis_ros.contract.model import WamContract
from physis_ros.contract.safetensors import read_metadata
from physis_ros.eval.closed_loop import ClosedLoopConfig, ModelDecider
from physis_ros.eval.closed_loop_report import run_all, run_names, write_report
from physis_ros.sim.base import Task
from physis_ros.sim.tasks import get_task
from physis_ros.weights import (
    SHIPPED,
    engine_kwargs,
    min_committed_ms,
    missing_shipped_weights,
    trained_known_rows_ahead,
)


def run_closed_loop(args, parser, argv) -> int:
    if args.model and not args.weights:  # a preset: its shipped weights, which name its task
        missing = missing_shipped_weights(args.model)
        if missing:
            print(f"physis-eval: {missing}", file=sys.stderr)
            return 2
        if args.model not in SHIPPED:
            parser.error(f"--model {args.model} ships no weights: pass --weights FILE")
        args.weights = str(SHIPPED[args.model])
    try:
        known = args.weights and Path(args.weights).is_file()
        meta = read_metadata(args.weights) if known else {}
        task = get_task(args.task or meta.get("task", "push"))
    except (ValueError, FileNotFoundError) as err:
        parser.error(str(err))
    missing = None if args.weights else missing_shipped_weights(task.default_model)
    if missing:  # not a usage mistake: one line, no usage text
        print(f"physis-eval: {missing}", file=sys.stderr)
        return 2
    try:
        meta, kwargs, base = _configure(args, task)
    except (ValueError, FileNotFoundError) as err:
        parser.error(str(err))
    runs = run_names(args.delay_ms, with_expert=not args.no_expert, modes=args.modes)
    # torch comes with the engine: physis-eval --link runs without it
    from physis_ros.engine.threads import local_engine

    with local_engine(**kwargs, workers=args.workers, mode=args.mode) as engine:
        decider = ModelDecider(engine, meta=meta)
        results = run_all(base, runs, decider, progress=not args.quiet)
    command = "physis-eval " + shlex.join(sys.argv[1:] if argv is None else argv)
    engine_entry = {k: v for k, v in kwargs.items()} | {"workers": args.workers}
    report = write_report(args.out, results, engine=engine_entry, command=command)
    print(json.dumps(_summary(report, args.out)))
    return 0


def _configure(args, task: Task) -> tuple[dict, dict, ClosedLoopConfig]:
    """The weights' metadata, the engine's keyword arguments and the runs' common config;
    ValueError or FileNotFoundError when the weights do not fit the task or the flags."""
    weights = Path(args.weights) if args.weights else SHIPPED.get(task.default_model)
    if weights is None:
        raise ValueError(f"{task.default_model} ships no weights: pass --weights FILE")
    if not weights.exists():
        raise FileNotFoundError(f"weights {weights} do not exist")
    meta = read_metadata(weights)
    if meta.get("format") != "physis_ros world-action model":
        raise ValueError(f"{weights} is not a world-action model (metadata format)")
    task.check_fits(WamContract.from_metadata(meta))
    kwargs = engine_kwargs(weights)
    for key in ("steps", "window", "shift"):
        if getattr(args, key) is not None:
            kwargs[key] = getattr(args, key)
    base = ClosedLoopConfig(
        task=task.name,
        episodes=args.episodes,
        seed0=args.seed0,
        context_chunks=min(3, kwargs["window"]),
        max_known_rows_ahead=(
            trained_known_rows_ahead(meta)
            if args.known_rows_ahead is None
            else args.known_rows_ahead
        ),
        fade_rows=args.fade_rows,
        min_committed_ms=(
            min_committed_ms(meta) if args.min_committed_ms is None else args.min_committed_ms
        ),
        **({"time_limit_s": args.time_limit_s} if args.time_limit_s else {}),
    )
    if any(d < 0 for d in args.delay_ms):
        raise ValueError("--delay-ms must be >= 0")
    return meta, kwargs, base


def _summary(report: dict, out: Path) -> dict:
    """The JSON line printed: per run, its success rate, time to goal, action error and the
    largest joint-target jump where chunks join."""
    summary = {
        name: {
            "success_rate": r["success_rate"],
            "time_to_goal_median_s": r["time_to_goal_s"].get("median"),
            "action_rmse_rad": r["action_rmse_rad"].get("mean"),
            "largest_join_jump_rad": r["boundary_jump_rad"]["largest"],
        }
        for name, r in report["runs"].items()
    }
    return {"mode": "closed-loop", "runs": summary, "report": str(out / "report.md")}
