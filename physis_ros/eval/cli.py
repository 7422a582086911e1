"""``physis-eval BAG [BAG...]``: replay bags through the engine, write report.json/.md and plots.

The engine is the in-process ``LocalEngine`` on the embedded default weights unless told
otherwise (``--weights``, ``--model``, ``--steps``, ``--window``, ``--shift``, ``--workers``).
Prints one JSON summary line on stdout; progress and skip messages go to stderr.
Exit status: 0 when at least one window was scored, 1 when none could be, 2 on bad usage.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from physis_ros.eval.bag import TopicChoice
from physis_ros.eval.evaluate import EvalConfig, ModelInfo, evaluate


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="physis-eval", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "bags", nargs="+", help="rosbag2 folders (or .mcap/.db3 files), or folders of bags"
    )
    p.add_argument(
        "--out", type=Path, default=Path("eval_report"), help="report folder (default eval_report)"
    )
    g = p.add_argument_group("engine")
    g.add_argument(
        "--weights", default=None, help="safetensors checkpoint (default: the shipped push-wm)"
    )
    g.add_argument(
        "--model", default=None, help="model preset (default: from the checkpoint's metadata)"
    )
    g.add_argument(
        "--random-weights", action="store_true", help="no checkpoint: random init (timing runs)"
    )
    g.add_argument("--steps", type=int, default=None, help="denoising steps K (default 4)")
    g.add_argument(
        "--window", type=int, default=None, help="attention window W (default: as trained)"
    )
    g.add_argument("--shift", type=float, default=None, help="schedule shift (default: as trained)")
    g.add_argument(
        "--workers", type=int, default=1, help="pipeline workers (threads) in the engine"
    )
    g.add_argument(
        "--mode", default="pipelined", help="pipelined | sequential-noisy | sequential-clean"
    )
    w = p.add_argument_group("windows")
    defaults = EvalConfig()
    w.add_argument("--context-chunks", type=int, default=defaults.context_chunks)
    w.add_argument("--horizon-chunks", type=int, default=defaults.horizon_chunks)
    w.add_argument("--stride-chunks", type=int, default=defaults.window_stride_chunks)
    w.add_argument("--max-windows", type=int, default=0, help="per bag; 0: all")
    w.add_argument(
        "--frame-hz", type=float, default=None, help="model frame rate (default: as trained)"
    )
    w.add_argument("--realtime", action="store_true", help="feed context at the recorded timing")
    w.add_argument("--seed", type=int, default=0, help="stream seed of the first window")
    t = p.add_argument_group("topics (default: the first topic of the right type)")
    t.add_argument("--image-topic", default=None)
    t.add_argument("--command-topic", default=None)
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p


def _expand(paths: list[str]) -> list[str]:
    """Bags as given; a folder that is not a bag but holds bags is replaced by them."""
    out: list[str] = []
    for raw in paths:
        p = Path(raw)
        if p.is_dir() and not (p / "metadata.yaml").exists():
            inner = sorted(str(m.parent) for m in p.rglob("metadata.yaml"))
            out.extend(inner or [raw])
        else:
            out.append(raw)
    return out


def engine_from_args(args) -> tuple[object, dict]:
    """A LocalEngine for the arguments, and the settings it runs with."""
    from physis_ros.engine.local import LocalEngine
    from physis_ros.weights import DEFAULT_STEPS, DEFAULT_WEIGHTS, engine_kwargs, read_metadata

    kwargs: dict = {"steps": DEFAULT_STEPS, "window": 2, "shift": 3.0}
    meta: dict[str, str] = {}
    if not args.random_weights:
        weights = Path(args.weights) if args.weights else DEFAULT_WEIGHTS
        if not weights.exists():
            raise FileNotFoundError(
                f"weights {weights} do not exist (use --weights or --random-weights)"
            )
        meta = read_metadata(weights)
        if "model" in meta:
            kwargs = engine_kwargs(weights)
        else:
            kwargs["checkpoint"] = str(weights)
    for key in ("model", "steps", "window", "shift"):
        if getattr(args, key) is not None:
            kwargs[key] = getattr(args, key)
    if "model" not in kwargs:
        raise ValueError("no model preset: the checkpoint has no metadata, pass --model")
    kwargs.update(workers=args.workers, mode=args.mode)
    engine = LocalEngine(**kwargs)
    settings = {**kwargs, "frame_hz": float(meta.get("frame_hz", 10.0))}
    return engine, settings


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        engine, settings = engine_from_args(args)
    except (ValueError, FileNotFoundError) as err:
        parser.error(str(err))
    try:
        cfg = EvalConfig(
            context_chunks=args.context_chunks,
            horizon_chunks=args.horizon_chunks,
            window_stride_chunks=args.stride_chunks,
            max_windows_per_bag=args.max_windows,
            frame_hz=args.frame_hz or settings["frame_hz"],
            realtime=args.realtime,
            seed=args.seed,
        )
    except ValueError as err:
        engine.shutdown()
        parser.error(str(err))
    from physis_ros.eval.report import write_report

    mcfg = engine.cfg
    info = ModelInfo(
        name=mcfg.name,
        frames_per_chunk=mcfg.frames_per_chunk,
        image_height=mcfg.image_size[0],
        image_width=mcfg.image_size[1],
        action_horizon=mcfg.action_horizon,
        action_dim=mcfg.action_dim,
        action_mode=mcfg.action_mode,
    )
    topics = TopicChoice(image=args.image_topic, command=args.command_topic)
    try:
        result = evaluate(
            engine, info, _expand(args.bags), cfg, topics=topics, progress=not args.quiet
        )
    finally:
        engine.shutdown()
    report = write_report(result, args.out)
    report_engine = {k: v for k, v in settings.items() if k != "checkpoint"}
    report_engine["checkpoint"] = settings.get("checkpoint")
    # the engine settings belong in the report too (steps, window, shift, workers, mode)
    full = json.loads((args.out / "report.json").read_text())
    full["engine"] = report_engine
    (args.out / "report.json").write_text(json.dumps(full, indent=2) + "\n")
    for bag in report["skipped_bags"]:
        print(f"physis-eval: skipped bag {bag['path']}: {bag['reason']}", file=sys.stderr)
    for reason, n in report["skipped_windows"].items():
        print(f"physis-eval: skipped {n} window(s): {reason}", file=sys.stderr)
    summary = {
        "windows": report["windows"],
        "bags": len(report["bags"]),
        "skipped_bags": len(report["skipped_bags"]),
        "by_chunk": report["by_chunk"],
        "response_latency_ms_median": report["latency"]["response_latency_ms"]["median"],
        "interval_ms_median": report["latency"]["interval_ms"]["median"],
        "report": str(args.out / "report.md"),
    }
    print(json.dumps(summary))
    return 0 if report["windows"] else 1


if __name__ == "__main__":
    sys.exit(main())
