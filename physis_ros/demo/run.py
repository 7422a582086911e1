"""One ``physis-demo`` run (``DemoRun``): its children started in order, watched once a second
(the progress line), stopped, and what it saw written as ``summary.json`` and ``strip.png``;
the bridge's statuses it reads off /diagnostics.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from physis_ros.demo.drive import episodes_line, episodes_progress, shipped_camera
from physis_ros.demo.strip import StripRows, image_to_rgb, strip, write_png
from physis_ros.nodes.monitor import Monitor, diagnostics_by_name
from physis_ros.nodes.system import LocalSystem
from physis_ros.weights import missing_shipped_weights

DIAGNOSTICS_KEPT = 100
"""/diagnostics messages kept (the newest: the bridge's and sim_robot's statuses are read)."""

STATS_SUMMARY_ROUNDED = {
    "interval_median_ms": 2, "interval_p99_ms": 2, "interval_jitter_ms": 2,
    "promised_interval_ms": 2, "promised_response_latency_ms": 2, "chunk_overlap": 3,
    "obs_to_send_median_ms": 3, "receive_to_publish_median_ms": 3,
}  # fmt: skip
STATS_SUMMARY_KEPT = (
    "promise_revision", "horizon", "rollouts", "observations_sent", "chunks_received",
    "chunks_published", "chunks_expired", "fallbacks_published",
)  # fmt: skip


def served_camera(args: argparse.Namespace) -> tuple[dict[str, Any] | None, str]:
    """The served model's camera (``shipped_camera``) and, when it cannot be served, why ('')."""
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
    return camera, missing or ""


def bridge_status(monitor, name: str) -> tuple[int, str, dict[str, str]] | None:
    """The bridge's newest ``bridge: <name>`` status on /diagnostics (kept messages;
    sim_robot publishes there too): (level, message, values), None before one."""
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


def stats_summary(stats) -> dict[str, Any]:
    """The bridge's newest ``pipeline_stats`` as summary.json gives them."""
    out: dict[str, Any] = {k: round(getattr(stats, k), n) for k, n in STATS_SUMMARY_ROUNDED.items()}
    out.update({k: getattr(stats, k) for k in STATS_SUMMARY_KEPT})
    out["response_latency_median_ms"] = round(stats.response_latency_ms, 2)
    out["response_latency_p99_ms"] = round(stats.response_latency_p99_ms, 2)
    hops = [round(v, 2) for v in stats.hop_median_ms]
    out["hop_median_ms"] = dict(zip(stats.hop_names, hops, strict=True))
    out["drops"] = dict(zip(stats.drop_reasons, stats.drop_counts, strict=True))
    return out


class DemoRun:
    """The children of one run on ``loop`` and what the run saw of them."""

    def __init__(self, args: argparse.Namespace, loop: LocalSystem, camera: dict | None) -> None:
        self.args = args
        self.loop = loop
        self.camera = camera
        self.drive = camera["drive"] if camera is not None else None
        self.monitor: Monitor | None = None
        self.strip_rows = StripRows()
        self.stats = None
        """The bridge's newest pipeline_stats (None before one)."""
        self.interrupted = False
        self.started_s = time.monotonic()
        self.elapsed_s = 0.0
        self.exit_codes: dict[str, int] = {}
        self.seen: dict[str, Any] = {"counts": {}, "sooner": {}, "execution": {}}

    def start(self, domain_id: int) -> None:
        """sim_robot, then physis-serve, then the bridge. The robot first: physis-serve
        measures this machine at start-up, with the load the simulated robot puts on it."""
        args, camera, drive = self.args, self.camera, self.drive
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
        self.loop.start_sim_robot(**sim_params)
        metrics = [] if args.metrics_port is None else ["--metrics-port", str(args.metrics_port)]
        port = self.loop.start_server(timeout_s=300.0, ranks=args.ranks, server_args=metrics)
        print(f"physis-demo: physis-serve ({args.model}) on 127.0.0.1:{port}", flush=True)
        if metrics:
            print(f"physis-demo: metrics on http://127.0.0.1:{args.metrics_port}/metrics")
        self.monitor = Monitor(
            domain_id=domain_id, keep=("/diagnostics",), keep_last=DIAGNOSTICS_KEPT
        )
        target_ms = args.target_interval_ms
        if target_ms is None:  # what the camera fills: one observed chunk per chunk_ms
            target_ms = camera["chunk_ms"] if camera is not None else 0.0
        self.loop.start_bridge(
            target_interval_ms=target_ms, previews=args.previews, **bridge_params
        )
        self.started_s = time.monotonic()

    def watch(self) -> None:
        """A progress line a second until ``--duration-s`` after the first predicted chunk,
        or until start-up times out, a child exits or the stream is refused."""
        args, loop, monitor = self.args, self.loop, self.monitor
        live_s = None  # when the first chunk was predicted: the duration counts from there
        while live_s is None or time.monotonic() - live_s < args.duration_s:
            if live_s is None and time.monotonic() - self.started_s > args.startup_timeout_s:
                print(
                    f"physis-demo: no chunk predicted within --startup-timeout-s "
                    f"{args.startup_timeout_s:g}; see {loop.log_dir}",
                    file=sys.stderr,
                )
                return
            time.sleep(1.0)
            dead = [name for name, ok in loop.alive().items() if not ok]
            if dead:
                print(f"physis-demo: {dead} exited; see {loop.log_dir}", file=sys.stderr)
                return
            self.stats = monitor.get("pipeline_stats")
            view = monitor.get("predicted/side_by_side")
            if view is not None:
                self.strip_rows.offer(image_to_rgb(view))
            if live_s is None and (refused := refusal(monitor)):
                print(
                    f"physis-demo: the server refused the stream ({refused}); it measured "
                    "this host too slow for that interval at start-up (a busy host: run "
                    f"again when it is idle); see {loop.log_dir}",
                    file=sys.stderr,
                )
                return
            if live_s is None and self.stats is not None and self.stats.chunks_received > 0:
                live_s = time.monotonic()
            for line in self.progress_lines(time.monotonic() - self.started_s):
                print(line, flush=True)

    def progress_lines(self, t: float) -> list[str]:
        """This second's lines: the episodes, the previews acted on, the pipeline."""
        stats, monitor, drive = self.stats, self.monitor, self.drive
        if stats is None:
            frames = monitor.count("camera/image")
            return [f"[{t:5.1f} s] waiting for the bridge ({frames} camera frames)"]
        lines = []
        episodes = episodes_progress(monitor, drive.label) if drive is not None else None
        if episodes is not None:
            lines.append(f"[{t:5.1f} s] {episodes_line(drive, episodes)}")
        if drive is not None and self.args.act_on_previews:
            done = execution_summary(monitor)
            lines.append(
                f"[{t:5.1f} s] previews acted on {done.get('previews_acted', 0):.0f} "
                f"(ignored {done.get('previews_ignored', 0):.0f}); each chunk's rows started "
                f"{done.get('preview_action_sooner_median_ms', 0):.1f} ms sooner (median)"
            )
        drops = dict(zip(stats.drop_reasons, stats.drop_counts, strict=True))
        lines.append(
            f"[{t:5.1f} s] interval {stats.interval_median_ms:6.1f} ms "
            f"(p99 {stats.interval_p99_ms:6.1f}, promised {stats.promised_interval_ms:.1f})  "
            f"overlap {stats.chunk_overlap:4.0%}  "
            f"response {stats.response_latency_ms:6.1f} ms  "
            f"chunks {stats.chunks_published:4d}  sent {stats.observations_sent:4d}  "
            f"dropped {stats.observations_dropped} {drops or ''}"
        )
        return lines

    def stop(self) -> None:
        """Reads what the topics showed, then stops every child."""
        self.elapsed_s = time.monotonic() - self.started_s
        monitor = self.monitor
        if monitor is not None:
            if self.drive is not None:
                self.seen["episodes"] = episodes_progress(monitor, self.drive.label)
            topics = ("camera/image", "action_chunk", "predicted/image")
            self.seen["counts"] = {t: monitor.count(t) for t in topics}
            if self.args.previews:
                self.seen["sooner"] = preview_sooner_ms(monitor)
            self.seen["execution"] = execution_summary(monitor)
            monitor.close()
        self.exit_codes = self.loop.stop()

    def summary(self) -> dict[str, Any]:
        args = self.args
        summary = {
            "model": args.model,
            "server": f"torchrun, {args.ranks} ranks" if args.ranks else "one process",
            "duration_s": round(self.elapsed_s, 2),
            "interrupted": self.interrupted,
            "children_exit_codes": self.exit_codes,
            "topic_messages_seen": self.seen["counts"],
        }
        if self.seen.get("episodes") is not None:  # sim_robot's episodes, of the scene named
            summary["goal_push"] = {"scene": self.drive.scene, **self.seen["episodes"]}
        if self.stats is not None:
            summary.update(stats_summary(self.stats))
        if args.previews:  # the response latency a robot looking at previews gains, per step
            summary["preview_sooner_median_ms"] = self.seen["sooner"]
        if self.seen["execution"]:  # a world-action model: how its chunks were executed
            summary["execution"] = self.seen["execution"]
        return summary

    def report(self, out: Path) -> int:
        """Writes summary.json and strip.png under ``out``; the run's exit status: 0 when
        predictions were published and every child exited cleanly (or on Ctrl-C)."""
        summary = self.summary()
        (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        # before the first observation is paired the view has no observed half (and fewer rows)
        rows = self.strip_rows.rows
        rows = [r for r in rows if rows and r.shape[0] == max(x.shape[0] for x in rows)]
        if rows:
            picked = rows[:: max(1, len(rows) // 8)][:8]
            write_png(out / "strip.png", strip(picked))
        print("physis-demo summary: " + json.dumps(summary), flush=True)
        wrote = f"physis-demo: wrote {out / 'summary.json'}"
        print(wrote + (f" and {out / 'strip.png'}" if rows else ""))
        # a world-action model publishes action chunks; a world model (push-wm) predicted frames
        stats, counts = self.stats, self.seen["counts"]
        published = (stats.chunks_published if stats is not None else 0) + counts.get(
            "predicted/image", 0
        )
        clean = all(c == 0 for c in self.exit_codes.values())
        ok = stats is not None and published > 0 and clean
        return 0 if ok or self.interrupted else 1
