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

from physis_ros.cli_errors import UsageError, cli_main, finite_float, refuse_unused_flags
from physis_ros.contract.safetensors import read_metadata
from physis_ros.engine.weight_files import (
    FLAGS_BY_MODEL_KIND,
    NOT_A_DIRECTORY,
    is_model_dir,
    model_kind,
)
from physis_ros.eval.bag import TopicChoice
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
    _add_engine_arguments(p)
    _add_window_arguments(p)
    _add_topic_arguments(p)
    link = _add_link_arguments(p)
    _add_closed_loop_arguments(p)
    # after the closed loop's flags, where the usage line has always listed them
    _add_stream_request_arguments(link)
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p


def _add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """The in-process engine and its model (also what --serve-local serves)."""
    group = parser.add_argument_group("engine")
    group.add_argument(
        "--weights", default=None, help="safetensors checkpoint (default: the shipped push-wm)"
    )
    group.add_argument(
        "--model",
        default=None,
        help="model preset (default: from the checkpoint's metadata), or a model directory "
        "(upstream Wan or diffusers; its own weights, no --weights)",
    )
    group.add_argument("--vae", default=None, help="diffusers AutoencoderKLWan dir: the real codec")
    group.add_argument("--resolution", default=None, help="camera HxW of a model directory")
    group.add_argument("--latent-frames", type=int, default=None, help="latent frames per chunk")
    group.add_argument(
        "--prompts", action="append", default=None, help="prompt-embedding file (physis-embed)"
    )
    group.add_argument("--dtype", default=None, choices=("float32", "bfloat16", "float16"))
    group.add_argument(
        "--variant", default=None, help="weights variant of a model directory, e.g. fp16"
    )
    group.add_argument(
        "--random-weights", action="store_true", help="no checkpoint: random init (timing runs)"
    )
    group.add_argument("--steps", type=int, default=None, help="denoising steps K (default 4)")
    group.add_argument(
        "--window", type=int, default=None, help="attention window W (default: as trained)"
    )
    group.add_argument(
        "--shift", type=finite_float, default=None, help="schedule shift (default: as trained)"
    )
    group.add_argument(
        "--workers", type=int, default=1, help="pipeline workers (threads) in the engine"
    )
    group.add_argument(
        "--mode", default="pipelined", help="pipelined | sequential-noisy | sequential-clean"
    )


def _add_window_arguments(parser: argparse.ArgumentParser) -> None:
    """How the bags are cut into windows and replayed."""
    group = parser.add_argument_group("windows")
    defaults = EvalConfig()
    group.add_argument(
        "--context-chunks",
        type=int,
        default=None,
        help="observed chunks per window (default: the model's window W, what a served "
        "stream's chunk reads)",
    )
    group.add_argument("--horizon-chunks", type=int, default=defaults.horizon_chunks)
    group.add_argument("--stride-chunks", type=int, default=defaults.window_stride_chunks)
    group.add_argument(
        "--max-windows",
        type=int,
        default=0,
        help="windows per bag (0: all); in process and over the link alike",
    )
    group.add_argument(
        "--max-seconds",
        type=finite_float,
        default=0.0,
        help="bag seconds used per bag, from its first frame (0: all); in process and over "
        "the link alike",
    )
    group.add_argument(
        "--frame-hz", type=finite_float, default=None, help="model frame rate (default: as trained)"
    )
    group.add_argument(
        "--realtime", action="store_true", help="feed context at the recorded timing"
    )
    group.add_argument(
        "--future-commands",
        action="store_true",
        help="in process: condition predicted chunks on the recorded commands that followed "
        "(no server knows them; default: the last observed command held, as served)",
    )
    group.add_argument("--seed", type=int, default=0, help="stream seed of the first window")


def _add_topic_arguments(parser: argparse.ArgumentParser) -> None:
    """Which topics of a bag hold the images and the commands."""
    group = parser.add_argument_group("topics (default: the first topic of the right type)")
    group.add_argument("--image-topic", default=None)
    group.add_argument("--command-topic", default=None)


def _add_link_arguments(parser: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    """Where the physis-serve is and how to reach it; returns the group."""
    group = parser.add_argument_group("over the link (a physis-serve, live semantics)")
    where = group.add_mutually_exclusive_group()
    where.add_argument("--link", metavar="HOST:PORT", help="a running physis-serve")
    where.add_argument(
        "--serve-local",
        action="store_true",
        help="start a physis-serve child on 127.0.0.1 with the engine settings above",
    )
    group.add_argument("--token-file", default=None, help="bearer token for the server (file)")
    group.add_argument("--tls-ca", default=None, help="CA (PEM) of the server's certificate: TLS")
    group.add_argument("--tls-cert", default=None, help="client certificate (PEM), with --tls-key")
    group.add_argument("--tls-key", default=None, help="client private key (PEM)")
    group.add_argument("--tls-server-name", default=None, help="name the certificate is for")
    group.add_argument(
        "--connect-timeout", type=finite_float, default=5.0, help="seconds (default 5)"
    )
    group.add_argument(
        "--interval-ms",
        type=finite_float,
        default=0.0,
        help="target interval the stream asks for (default 0: as fast as the server can)",
    )
    group.add_argument(
        "--compare-in-process",
        action="store_true",
        help="after the live run, score the same windows in process with the engine settings "
        "above; the report gives live minus in process per horizon with its spread",
    )
    return group


def _add_closed_loop_arguments(parser: argparse.ArgumentParser) -> None:
    """The closed loop: task, episodes, delays and how chunks are executed."""
    group = parser.add_argument_group(
        "closed loop (a world-action model drives the simulated robot)"
    )
    group.add_argument("--closed-loop", action="store_true", help="run episodes instead of bags")
    group.add_argument(
        "--task",
        default=None,
        help="simulated task: push or reach (default: the weights' task, else push)",
    )
    group.add_argument("--episodes", type=int, default=20, help="episodes per run (default 20)")
    group.add_argument(
        "--seed0", type=int, default=10_000, help="task seed of the first episode (held out)"
    )
    group.add_argument(
        "--delay-ms",
        type=finite_float,
        nargs="+",
        default=[0.0],
        help="response latencies to run at (ms; the control period is 50 ms)",
    )
    group.add_argument(
        "--modes",
        nargs="+",
        default=["crossfade", "replace", "naive"],
        choices=["crossfade", "replace", "naive"],
        help="execution: delay-aware with crossfade or replace joins, or naive (no delay handling)",
    )
    group.add_argument("--no-expert", action="store_true", help="skip the scripted expert's run")
    group.add_argument("--fade-rows", type=int, default=4, help="rows a crossfade spans")
    group.add_argument(
        "--known-rows-ahead",
        type=int,
        default=None,
        help="delay-aware runs tell the model at most this many committed rows past the newest "
        "frame (0: none; default: the weights' max_known_rows_ahead, what it was trained with)",
    )
    group.add_argument(
        "--min-committed-ms",
        type=finite_float,
        default=None,
        help="delay-aware runs commit the rows up to at least this long after the newest frame "
        "(told to the model, executed as planned), however soon the answer comes (default: the "
        "weights' min_committed_ms, as physis-serve does)",
    )
    group.add_argument(
        "--time-limit-s",
        type=finite_float,
        default=None,
        help="simulated seconds an episode may take to reach the goal (default: the task's)",
    )


def _add_stream_request_arguments(group: argparse._ArgumentGroup) -> None:
    """What each stream over the link asks the server for."""
    group.add_argument(
        "--horizons",
        default="",
        help="comma-separated horizons (chunks ahead of the newest observation): each bag is "
        "streamed once per horizon, the stream asking for it (default: the model's)",
    )
    group.add_argument(
        "--rollouts",
        choices=("default", "on", "off"),
        default="default",
        help="on: every observation generates the whole horizon again, so one stream scores "
        "every horizon up to its own; off: only the slot h ahead (default: the server's, on "
        "for world models)",
    )
    group.add_argument(
        "--previews",
        action="store_true",
        help="streams ask for previews (x0 estimates after each denoising step): PSNR by step "
        "against the chunk and the recorded frames, and how much sooner they arrive",
    )


IN_PROCESS, LINK = "physis-eval in process", "physis-eval --link"
SERVE_LOCAL, CLOSED_LOOP = "physis-eval --serve-local", "physis-eval --closed-loop"
_ENGINE = {"weights", "steps", "window", "shift", "workers", "mode"}
_MODEL = {"model", "vae", "variant", "resolution", "latent_frames", "prompts", "dtype"}
_MODEL |= {"random_weights"}
_BAGS = {"bags", "context_chunks", "horizon_chunks", "stride_chunks", "max_windows", "frame_hz"}
_BAGS |= {"realtime", "seed", "image_topic", "command_topic"}
_CLIENT = {"token_file", "tls_ca", "tls_cert", "tls_key", "tls_server_name", "connect_timeout"}
_CLIENT |= {"interval_ms", "horizons", "rollouts"}
_CLOSED = {"task", "episodes", "seed0", "delay_ms", "modes", "no_expert", "fade_rows"}
_CLOSED |= {"known_rows_ahead", "min_committed_ms", "time_limit_s"}
FLAGS_USED = {
    IN_PROCESS: _ENGINE | _MODEL | _BAGS | {"future_commands"},
    LINK: _BAGS | _CLIENT | {"link"},
    SERVE_LOCAL: _ENGINE | _MODEL | _BAGS | _CLIENT | {"serve_local"},
    CLOSED_LOOP: _ENGINE | _CLOSED,
}
"""The flags each way of running reads; the others are refused by name (the server's engine
is not ours to set over --link; the closed loop runs the weights' own model)."""


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
    from physis_ros.eval.link_replay import LinkOptions
    from physis_ros.eval.local_server import LocalServer
    from physis_ros.link.options import ROLLOUT_CHOICES

    token = Path(args.token_file).read_text().strip() if args.token_file else None
    options = dict(
        token=token,
        root_cert_path=args.tls_ca,
        client_cert_path=args.tls_cert,
        client_key_path=args.tls_key,
        tls_server_name=args.tls_server_name,
        connect_timeout_s=args.connect_timeout,
        interval_ms=args.interval_ms,
        horizons=horizons,
        previews=args.previews,
        rollouts=ROLLOUT_CHOICES[args.rollouts],
    )
    if args.link:
        opts = LinkOptions(target=args.link, **options)
        result = evaluate_link(
            opts, _expand(args.bags), cfg, topics=topics, progress=not args.quiet
        )
        return result, {"served_by": args.link}
    kwargs = {k: v for k, v in settings.items() if k != "frame_hz"}
    with LocalServer(kwargs, args.out / "serve.log") as server:
        opts = LinkOptions(target=server.target, **options)
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
