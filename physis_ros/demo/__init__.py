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
import json
import os
import random
import sys
import time
from pathlib import Path

from physis_ros.cli_errors import cli_main, finite_float
from physis_ros.demo.drive import episodes_line, episodes_progress, shipped_camera
from physis_ros.demo.strip import StripRows, image_to_rgb, strip, write_png

__all__ = ["StripRows", "main", "shipped_camera", "strip", "write_png"]

DIAGNOSTICS_KEPT = 100
"""/diagnostics messages kept (the newest: the bridge's and sim_robot's statuses are read)."""


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
        help="model preset physis-serve runs (push-wm, push-wam: the shipped trained weights; "
        "others: random weights)",
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
        "--out", default="out/demo", help="directory for summary.json and strip.png"
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
    return args


def bridge_status(monitor, name: str) -> tuple[int, str, dict[str, str]] | None:
    """The bridge's newest ``bridge: <name>`` status on /diagnostics (kept messages;
    sim_robot publishes there too): (level, message, values), None before one."""
    from physis_ros.nodes.monitor import diagnostics_by_name

    for _, array in reversed(monitor.messages("/diagnostics")):
        status = diagnostics_by_name(array).get(f"bridge: {name}")
        if status is not None:
            return status
    return None


def bridge_output(monitor) -> dict[str, str]:
    """The bridge's newest output status values, {} before one."""
    status = bridge_status(monitor, "output")
    return status[2] if status is not None else {}


def refusal(monitor) -> str:
    """The server's refusal of the bridge's stream (its link's last error), '' if none: one
    demo stream refused at start is refused for good (the server plans once, at start-up)."""
    link = bridge_status(monitor, "link")
    error = link[2].get("last_error", "") if link is not None else ""
    return error if "RESOURCE_EXHAUSTED" in error else ""


EXECUTION_KEYS = (
    "timed_chunks_executed", "timed_chunks_refused", "timed_rows_skipped", "join_max_step",
    "join_step_median", "join_step_p99", "chunk_max_step", "plan_resyncs", "previews_acted",
    "previews_ignored", "preview_action_sooner_median_ms", "preview_action_sooner_slots",
)  # fmt: skip
"""How the bridge executed a world-action model's chunks (and previews), for the summary."""


def execution_summary(monitor) -> dict[str, float]:
    values = bridge_output(monitor)
    out = {k: round(float(values[k]), 4) for k in EXECUTION_KEYS if k in values}
    out.update({k: int(v) for k, v in values.items() if k.startswith("previews_ignored_")})
    return out


def preview_sooner_ms(monitor) -> dict[str, float]:
    """step k -> median ms its previews came before their chunks (the bridge's /diagnostics)."""
    values = bridge_output(monitor)
    prefix, suffix = "preview_step_", "_sooner_median_ms"
    return {
        key[len(prefix) : -len(suffix)]: round(float(v), 2)
        for key, v in values.items()
        if key.startswith(prefix) and key.endswith(suffix)
    }


@cli_main("physis-demo")
def main(argv=None) -> int:
    args = parse_args(argv)
    args.previews = args.previews or args.act_on_previews
    from physis_ros.weights import missing_shipped_weights

    missing = None if args.weights else missing_shipped_weights(args.model)
    if args.weights and not Path(args.weights).is_file():
        missing = f"--weights {args.weights}: no such file"
    try:
        camera = None if missing else shipped_camera(args.model, args.weights)
    except ValueError as err:  # a world-action model that drives no simulated robot
        camera, missing = None, f"{args.weights or args.model}: {err}"
    if camera is not None and camera["drives"] and camera["lacks"]:
        missing = (
            f"{args.weights or args.model}: its metadata lacks {camera['lacks']}, which "
            "physis-serve needs to serve a world-action model; use a checkpoint physis-train-wam "
            "wrote"
        )
    if missing:  # before anything starts: the server would refuse the preset the same way
        print(f"physis-demo: {missing}", file=sys.stderr)
        return 2
    from physis_ros.nodes.monitor import Monitor
    from physis_ros.nodes.system import LocalSystem

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
    monitor = None
    strip_rows = StripRows()
    stats = None
    started_s = time.monotonic()
    interrupted = False
    drive = camera["drive"] if camera is not None else None
    try:
        # The robot first: physis-serve measures this machine at start-up, with the load the
        # simulated robot puts on it.
        sim_params, bridge_params = {}, {}
        if camera is not None:
            sim_params = {k: camera[k] for k in ("image_height", "image_width", "camera_rate_hz")}
        if drive is not None:  # the model's actions drive the episodes of its task
            sim_params.update(drive.sim_params())
            bridge_params.update(
                drive.bridge_params(),
                execution=args.execution,
                join=args.join,
                act_on_previews=args.act_on_previews,
            )
        elif args.act_on_previews:  # a world model's previews are for looking at only
            print(
                "physis-demo: --act-on-previews: the model commands nothing (a world model); "
                "its previews are only published",
                file=sys.stderr,
            )
        loop.start_sim_robot(**sim_params)
        metrics = [] if args.metrics_port is None else ["--metrics-port", str(args.metrics_port)]
        port = loop.start_server(timeout_s=300.0, ranks=args.ranks, server_args=metrics)
        print(f"physis-demo: physis-serve ({args.model}) on 127.0.0.1:{port}", flush=True)
        if metrics:
            print(f"physis-demo: metrics on http://127.0.0.1:{args.metrics_port}/metrics")
        monitor = Monitor(domain_id=domain_id, keep=("/diagnostics",), keep_last=DIAGNOSTICS_KEPT)
        target_ms = args.target_interval_ms
        if target_ms is None:  # what the camera fills: one observed chunk per chunk_ms
            target_ms = camera["chunk_ms"] if camera is not None else 0.0
        loop.start_bridge(target_interval_ms=target_ms, previews=args.previews, **bridge_params)
        started_s = time.monotonic()
        live_s = None  # when the first chunk was predicted: the duration counts from there
        while live_s is None or time.monotonic() - live_s < args.duration_s:
            if live_s is None and time.monotonic() - started_s > args.startup_timeout_s:
                print(
                    f"physis-demo: no chunk predicted within --startup-timeout-s "
                    f"{args.startup_timeout_s:g}; see {loop.log_dir}",
                    file=sys.stderr,
                )
                break
            time.sleep(1.0)
            dead = [name for name, ok in loop.alive().items() if not ok]
            if dead:
                print(f"physis-demo: {dead} exited; see {loop.log_dir}", file=sys.stderr)
                break
            stats = monitor.get("pipeline_stats")
            view = monitor.get("predicted/side_by_side")
            if view is not None:
                strip_rows.offer(image_to_rgb(view))
            t = time.monotonic() - started_s
            if live_s is None and (refused := refusal(monitor)):
                print(
                    f"physis-demo: the server refused the stream ({refused}); it measured "
                    "this host too slow for that interval at start-up (a busy host: run "
                    f"again when it is idle); see {loop.log_dir}",
                    file=sys.stderr,
                )
                break
            if stats is None:
                frames = monitor.count("camera/image")
                print(f"[{t:5.1f} s] waiting for the bridge ({frames} camera frames)", flush=True)
                continue
            if live_s is None and stats.chunks_received > 0:
                live_s = time.monotonic()
            drops = dict(zip(stats.drop_reasons, stats.drop_counts, strict=True))
            episodes = episodes_progress(monitor, drive.label) if drive is not None else None
            if episodes is not None:
                print(f"[{t:5.1f} s] {episodes_line(drive, episodes)}", flush=True)
            if drive is not None and args.act_on_previews:
                done = execution_summary(monitor)
                print(
                    f"[{t:5.1f} s] previews acted on {done.get('previews_acted', 0):.0f} "
                    f"(ignored {done.get('previews_ignored', 0):.0f}); each chunk's rows started "
                    f"{done.get('preview_action_sooner_median_ms', 0):.1f} ms sooner (median)",
                    flush=True,
                )
            print(
                f"[{t:5.1f} s] interval {stats.interval_median_ms:6.1f} ms "
                f"(p99 {stats.interval_p99_ms:6.1f}, promised {stats.promised_interval_ms:.1f})  "
                f"overlap {stats.chunk_overlap:4.0%}  "
                f"response {stats.response_latency_ms:6.1f} ms  "
                f"chunks {stats.chunks_published:4d}  sent {stats.observations_sent:4d}  "
                f"dropped {stats.observations_dropped} {drops or ''}",
                flush=True,
            )
    except KeyboardInterrupt:
        interrupted = True
        print("physis-demo: interrupted, stopping", flush=True)
    finally:
        elapsed_s = time.monotonic() - started_s
        counts, sooner, execution = {}, {}, {}
        episodes = None
        if monitor is not None:
            episodes = episodes_progress(monitor, drive.label) if drive is not None else None
            counts = {
                t: monitor.count(t) for t in ("camera/image", "action_chunk", "predicted/image")
            }
            if args.previews:
                sooner = preview_sooner_ms(monitor)
            execution = execution_summary(monitor)
            monitor.close()
        exit_codes = loop.stop()
    summary = {
        "model": args.model,
        "server": f"torchrun, {args.ranks} ranks" if args.ranks else "one process",
        "duration_s": round(elapsed_s, 2),
        "interrupted": interrupted,
        "children_exit_codes": exit_codes,
        "topic_messages_seen": counts,
    }
    if episodes is not None:  # sim_robot's goal_push episodes, of the scene named in it
        summary["goal_push"] = {"scene": drive.scene, **episodes}
    if stats is not None:
        summary.update(
            interval_median_ms=round(stats.interval_median_ms, 2),
            interval_p99_ms=round(stats.interval_p99_ms, 2),
            interval_jitter_ms=round(stats.interval_jitter_ms, 2),
            promised_interval_ms=round(stats.promised_interval_ms, 2),
            promised_response_latency_ms=round(stats.promised_response_latency_ms, 2),
            promise_revision=stats.promise_revision,
            horizon=stats.horizon,
            rollouts=stats.rollouts,
            chunk_overlap=round(stats.chunk_overlap, 3),
            response_latency_median_ms=round(stats.response_latency_ms, 2),
            response_latency_p99_ms=round(stats.response_latency_p99_ms, 2),
            hop_median_ms=dict(
                zip(stats.hop_names, [round(v, 2) for v in stats.hop_median_ms], strict=True)
            ),
            obs_to_send_median_ms=round(stats.obs_to_send_median_ms, 3),
            receive_to_publish_median_ms=round(stats.receive_to_publish_median_ms, 3),
            observations_sent=stats.observations_sent,
            drops=dict(zip(stats.drop_reasons, stats.drop_counts, strict=True)),
            chunks_received=stats.chunks_received,
            chunks_published=stats.chunks_published,
            chunks_expired=stats.chunks_expired,
            fallbacks_published=stats.fallbacks_published,
        )
    if args.previews:  # the response latency a robot looking at previews gains, per step
        summary["preview_sooner_median_ms"] = sooner
    if execution:  # a world-action model: how its chunks (and previews) were executed
        summary["execution"] = execution
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    # before the first observation is paired the view has no observed half (and fewer rows)
    rows = strip_rows.rows
    rows = [r for r in rows if rows and r.shape[0] == max(x.shape[0] for x in rows)]
    if rows:
        picked = rows[:: max(1, len(rows) // 8)][:8]
        write_png(out / "strip.png", strip(picked))
    print("physis-demo summary: " + json.dumps(summary), flush=True)
    print(
        f"physis-demo: wrote {out / 'summary.json'}" + (f" and {out / 'strip.png'}" if rows else "")
    )
    # a world-action model publishes action chunks; a world model (push-wm) predicted frames
    published = (stats.chunks_published if stats is not None else 0) + counts.get(
        "predicted/image", 0
    )
    ok = stats is not None and published > 0 and all(c == 0 for c in exit_codes.values())
    return 0 if ok or interrupted else 1
