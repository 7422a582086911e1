"""``physis-eval BAG [BAG...]``: replay bags through the engine, write report.json/.md and plots.

In process (the default): a ``local_engine`` on the embedded default weights unless told
otherwise (``--weights``, ``--model``, ``--steps``, ``--window``, ``--shift``, ``--workers``),
fed window by window. Over the link: ``--link HOST:PORT`` streams the bags to a running
physis-serve, ``--serve-local`` to a physis-serve child on 127.0.0.1 serving those same engine
settings (see link_eval.py for what is scored there). Both modes score one window set, fixed by
the bags and the window flags (``--context-chunks``, ``--horizon-chunks``, ``--stride-chunks``,
``--max-windows``, ``--max-seconds``); ``--compare-in-process`` scores a live run's windows in
process too and reports live minus in process per horizon with its spread.
Closed loop (``--closed-loop``, no bags): a world-action model (default: the shipped push-wam)
drives a simulated task (``--task``: push, reach) for ``--episodes`` held-out episodes at
each ``--delay-ms``, beside the scripted expert; see closed_loop.py.
Prints one JSON summary line on stdout; progress and skip messages go to stderr.
Exit status: 0 when at least one window was scored, 1 when none could be (or the server could
not be reached), 2 on bad usage.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from physis_ros.cli_errors import UsageError, cli_main, refuse_unused_flags
from physis_ros.contract.safetensors import read_metadata
from physis_ros.engine.weight_files import (
    FLAGS_BY_MODEL_KIND,
    NOT_A_DIRECTORY,
    is_model_dir,
    model_kind,
)
from physis_ros.eval.bag import TopicChoice
from physis_ros.eval.cli_flags import (
    CLOSED_LOOP,
    FLAGS_USED,
    IN_PROCESS,
    LINK,
    SERVE_LOCAL,
    add_closed_loop_arguments,
    add_engine_arguments,
    add_link_arguments,
    add_stream_request_arguments,
    add_topic_arguments,
    add_window_arguments,
)
from physis_ros.eval.closed_loop_cli import run_closed_loop
from physis_ros.eval.evaluate import EvalConfig, ModelInfo, evaluate
from physis_ros.eval.paired import live_vs_in_process
from physis_ros.eval.report import write_report
from physis_ros.weights import DEFAULT_STEPS, DEFAULT_WEIGHTS, engine_kwargs


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="physis-eval", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "bags", nargs="*", help="rosbag2 folders (or .mcap/.db3 files), or folders of bags"
    )
    p.add_argument(
        "--out", type=Path, default=Path("eval_report"), help="report folder (default eval_report)"
    )
    add_engine_arguments(p)
    add_window_arguments(p)
    add_topic_arguments(p)
    link = add_link_arguments(p)
    add_closed_loop_arguments(p)
    # after the closed loop's flags, where the usage line has always listed them
    add_stream_request_arguments(link)
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p


def _mode(args) -> str:
    if args.closed_loop:
        return CLOSED_LOOP
    return LINK if args.link else SERVE_LOCAL if args.serve_local else IN_PROCESS


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


def engine_settings(args) -> tuple[dict, dict]:
    """local_engine keyword arguments for the arguments, and the settings reported (those plus
    the frame rate the weights were trained at)."""
    kwargs: dict = {"steps": DEFAULT_STEPS, "window": 2, "shift": 3.0}
    meta: dict[str, str] = {}
    own_weights = args.model is not None and is_model_dir(args.model)
    if own_weights and args.weights:
        raise ValueError(f"--model {args.model} is a directory with its weights: drop --weights")
    if not args.random_weights and not own_weights:
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
    for key in (
        "model",
        "steps",
        "window",
        "shift",
        "vae",
        "variant",
        "resolution",
        "latent_frames",
    ):
        if getattr(args, key, None) is not None:
            kwargs[key] = getattr(args, key)
    if getattr(args, "prompts", None):
        kwargs["prompts"] = list(args.prompts)
    if getattr(args, "dtype", None):
        kwargs["dtype"] = args.dtype
    if "model" not in kwargs:
        raise ValueError("no model preset: the checkpoint has no metadata, pass --model")
    kwargs.update(workers=args.workers, mode=args.mode)
    return kwargs, {**kwargs, "frame_hz": float(meta.get("frame_hz", 10.0))}


def engine_from_args(args) -> tuple[object, dict]:
    """A local_engine for the arguments, and the settings it runs with."""
    # torch comes with the engine: physis-eval --link runs without it
    from physis_ros.engine.threads import local_engine

    kwargs, settings = engine_settings(args)
    return local_engine(**kwargs), settings


@cli_main("physis-eval")
def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    refuse_unused_flags(parser, args, _mode(args), FLAGS_USED)
    kind = model_kind(args.model) if args.model else NOT_A_DIRECTORY  # else the weights'
    refuse_unused_flags(parser, args, kind, FLAGS_BY_MODEL_KIND)
    if args.closed_loop:
        return run_closed_loop(args, parser, argv)
    if args.out.exists() and not args.out.is_dir():
        # checked before the run: the report is written after it
        raise UsageError(
            f"--out {args.out} exists and is not a folder", "choose another --out or remove it"
        )
    if not args.bags:
        parser.error("give bags to replay, or --closed-loop")
    over_link = bool(args.link or args.serve_local)
    if args.previews and not over_link:
        parser.error("--previews scores what a physis-serve streams: use --link or --serve-local")
    if args.compare_in_process and not over_link:
        parser.error("--compare-in-process compares a live run: use --link or --serve-local")
    engine = None
    try:
        # in process: the engine now; --serve-local (or a comparison): its settings, for the
        # child (and the in-process run after the live one)
        if args.serve_local or args.compare_in_process:
            settings = engine_settings(args)[1]
        elif not over_link:
            engine, settings = engine_from_args(args)
        else:
            settings = {"frame_hz": 10.0}  # the server's weights are not ours to read
        window = settings.get("window", EvalConfig().context_chunks)
        cfg = EvalConfig(
            context_chunks=args.context_chunks or window,
            horizon_chunks=args.horizon_chunks,
            window_stride_chunks=args.stride_chunks,
            max_windows_per_bag=args.max_windows,
            max_seconds=args.max_seconds,
            frame_hz=args.frame_hz or settings["frame_hz"],
            realtime=args.realtime,
            seed=args.seed,
            future_commands=args.future_commands,
        )
        horizons = tuple(int(h) for h in args.horizons.split(",") if h.strip())
    except (ValueError, FileNotFoundError) as err:
        if engine is not None:
            engine.shutdown()
        parser.error(str(err))
    topics = TopicChoice(image=args.image_topic, command=args.command_topic)
    if not over_link:
        return _write(*_evaluate_in_process(args, cfg, topics, engine, settings), args.out)
    # imported here: the in-process path needs neither grpc nor the link client
    from physis_ros.eval.link_replay import LinkUnavailable
    from physis_ros.eval.local_server import LocalServerError

    try:
        result, report_engine = _evaluate_link(args, cfg, topics, settings, horizons)
    except (ValueError, OSError) as err:  # bad options, an unreadable token or key file
        parser.error(str(err))
    except (LinkUnavailable, LocalServerError) as err:
        print(f"physis-eval: error: {err}", file=sys.stderr)
        print(json.dumps({"windows": 0, "mode": "link", "error": str(err)}))
        return 1
    comparison = None
    if args.compare_in_process:
        comparison = _compare_in_process(args, cfg, topics, result)
    return _write(result, report_engine, args.out, comparison)


def _evaluate_in_process(args, cfg: EvalConfig, topics: TopicChoice, engine, settings: dict):
    """EvalResult of ``engine`` window by window (shut down afterwards), and the report's
    ``engine`` entry."""
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
    try:
        result = evaluate(
            engine, info, _expand(args.bags), cfg, topics=topics, progress=not args.quiet
        )
    finally:
        engine.shutdown()
    report_engine = {k: v for k, v in settings.items() if k != "checkpoint"}
    report_engine["checkpoint"] = settings.get("checkpoint")
    return result, report_engine


def _compare_in_process(args, cfg: EvalConfig, topics: TopicChoice, live) -> dict:
    """--compare-in-process: the live run's window set scored in process with the engine
    settings of the arguments (its report in OUT/in_process), and live minus in process."""
    engine, settings = engine_from_args(args)
    in_process, report_engine = _evaluate_in_process(args, cfg, topics, engine, settings)
    write_report(in_process, args.out / "in_process", engine=report_engine)
    return live_vs_in_process(live, in_process, seed=args.seed)


def _evaluate_link(args, cfg: EvalConfig, topics: TopicChoice, settings: dict, horizons):
    """EvalResult over the link, and the report's ``engine`` entry (what served it)."""
    # imported here: the in-process path needs neither grpc nor the link client
    from physis_ros.eval.link_eval import evaluate_link
    from physis_ros.eval.link_replay import ReplayLink
    from physis_ros.eval.local_server import LocalServer
    from physis_ros.link.options import ROLLOUT_CHOICES, LinkOptions

    token = Path(args.token_file).read_text().strip() if args.token_file else None
    link = LinkOptions(
        token=token,
        root_cert_path=args.tls_ca,
        client_cert_path=args.tls_cert,
        client_key_path=args.tls_key,
        tls_server_name=args.tls_server_name,
        connect_timeout_s=args.connect_timeout,
        target_interval_ms=args.interval_ms,
        previews=args.previews,
        rollouts=ROLLOUT_CHOICES[args.rollouts],
    )
    if args.link:
        opts = ReplayLink(target=args.link, link=link, horizons=horizons)
        result = evaluate_link(
            opts, _expand(args.bags), cfg, topics=topics, progress=not args.quiet
        )
        return result, {"served_by": args.link}
    kwargs = {k: v for k, v in settings.items() if k != "frame_hz"}
    with LocalServer(kwargs, args.out / "serve.log") as server:
        opts = ReplayLink(target=server.target, link=link, horizons=horizons)
        result = evaluate_link(
            opts, _expand(args.bags), cfg, topics=topics, progress=not args.quiet
        )
    return result, {**kwargs, "served_by": "physis-serve child (--serve-local)"}


def _write(result, report_engine: dict, out: Path, comparison: dict | None = None) -> int:
    # the engine settings belong in the report too (steps, window, shift, workers, mode)
    report = write_report(result, out, engine=report_engine, live_vs_in_process=comparison)
    for bag in report["skipped_bags"]:
        print(f"physis-eval: skipped bag {bag['path']}: {bag['reason']}", file=sys.stderr)
    for reason, n in report["skipped_windows"].items():
        print(f"physis-eval: skipped {n} window(s): {reason}", file=sys.stderr)
    summary = {
        "mode": report["mode"],
        "windows": report["windows"],
        "bags": len(report["bags"]),
        "skipped_bags": len(report["skipped_bags"]),
        "by_chunk": report["by_chunk"],
        "response_latency_ms_median": report["latency"]["response_latency_ms"]["median"],
        "interval_ms_median": report["latency"]["interval_ms"]["median"],
        "report": str(out / "report.md"),
    }
    if comparison is not None:
        summary["live_minus_in_process_db"] = [
            {
                "chunk": e["chunk"],
                "windows": e["windows"],
                "model": e["model"] and e["model"]["difference"],
                "copy_last": e["copy_last"] and e["copy_last"]["difference"],
            }
            for e in comparison["by_chunk"]
        ]
    print(json.dumps(summary))
    return 0 if report["windows"] else 1


if __name__ == "__main__":
    sys.exit(main())
