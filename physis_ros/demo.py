"""``physis-demo`` (what ``make demo`` runs): the closed loop on this machine.

Starts physis-serve (the embedded default: ``push-wm`` with its shipped trained weights,
CPU, ephemeral port), ``sim_robot`` (a planar arm pushing a box, its camera at the size and
rate the model was trained on: 32x32 at 10 Hz) and the ``bridge`` as child processes on an
isolated ROS domain with real topics and the real link; the sim robot executes the
trajectories the bridge publishes (a world model publishes none: its scripted policy runs).
Prints once a second the achieved interval, response latency and drops; stops after
``--duration-s`` or Ctrl-C; stops every child; writes ``summary.json`` and ``strip.png``
(observed | predicted, one row per sampled second) under ``--out``.
No torch in this process: the model runs in physis-serve.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import struct
import sys
import time
import zlib
from pathlib import Path

import numpy as np


def write_png(path: Path, rgb: np.ndarray) -> None:
    """[H, W, 3] uint8 -> an 8-bit RGB PNG (zlib only, no imaging library needed)."""
    height, width, _ = rgb.shape
    raw = b"".join(b"\x00" + rgb[row].tobytes() for row in range(height))

    def chunk(kind: bytes, data: bytes) -> bytes:
        body = kind + data
        return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    path.write_bytes(
        b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw, 6))
        + chunk(b"IEND", b"")
    )  # fmt: skip


def image_to_rgb(msg) -> np.ndarray:
    return (
        np.frombuffer(bytes(msg.data), np.uint8)
        .reshape(msg.height, msg.step)[:, : msg.width * 3]
        .reshape(msg.height, msg.width, 3)
    )


def strip(rows: list[np.ndarray], scale: int = 2) -> np.ndarray:
    """Rows (observed | predicted) stacked with 2-pixel gaps, upscaled ``scale`` times."""
    width = max(r.shape[1] for r in rows)
    padded = []
    for r in rows:
        canvas = np.full((r.shape[0] + 2, width, 3), 32, np.uint8)
        canvas[: r.shape[0], : r.shape[1]] = r
        padded.append(canvas)
    image = np.concatenate(padded, axis=0)
    return np.repeat(np.repeat(image, scale, axis=0), scale, axis=1)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="physis-demo", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--duration-s", type=float, default=20.0, help="run this long (Ctrl-C stops early)"
    )
    parser.add_argument(
        "--model",
        default="push-wm",
        help="model preset physis-serve runs (push-wm: the shipped trained weights; others: "
        "random weights)",
    )
    parser.add_argument(
        "--target-interval-ms",
        type=float,
        default=None,
        help="pacing asked of the server (default: the video one chunk covers for a model "
        "with shipped weights, 200 ms for push-wm; else 100; 0: as fast as it can; the action "
        "deadline is two intervals, so an unpaced CPU server with jitter trips it often)",
    )
    parser.add_argument(
        "--previews",
        action="store_true",
        help="the bridge asks for previews (each chunk's x0 estimate after every denoising step "
        "but the last, on predicted/preview/step_<k>); the summary says how much sooner they came",
    )
    parser.add_argument(
        "--out", default="out/demo", help="directory for summary.json and strip.png"
    )
    parser.add_argument(
        "--domain-id",
        type=int,
        default=None,
        help="ROS_DOMAIN_ID (default: $ROS_DOMAIN_ID or a random one in 150..199)",
    )
    args = parser.parse_args(argv)
    if not args.duration_s > 0:
        parser.error(f"--duration-s must be positive, got {args.duration_s}")
    camera = shipped_camera(args.model)
    if args.target_interval_ms is None:
        args.target_interval_ms = camera["chunk_ms"] if camera else 100.0
    if args.target_interval_ms < 0:
        parser.error(f"--target-interval-ms must be >= 0, got {args.target_interval_ms}")
    return args


def shipped_camera(model: str) -> dict | None:
    """For a preset with shipped weights: the camera the weights were trained on (image size,
    frame rate) and the video one chunk covers; None for the others. Reads the safetensors
    header only (no torch in this process)."""
    from physis_ros.weights import SHIPPED, read_metadata

    path = SHIPPED.get(model)
    if path is None or not path.exists():
        return None
    meta = read_metadata(path)
    height, width = (int(v) for v in meta["image_size"].split("x"))
    frame_hz = float(meta["frame_hz"])
    frames_per_chunk = int(meta.get("frames_per_chunk", "2"))
    return {
        "image_height": height,
        "image_width": width,
        "camera_rate_hz": frame_hz,
        "chunk_ms": 1e3 * frames_per_chunk / frame_hz,
    }


def preview_sooner_ms(diagnostics) -> dict[str, float]:
    """step k -> median ms its previews came before their chunks (the bridge's /diagnostics)."""
    from physis_ros.nodes.monitor import diagnostics_by_name

    if diagnostics is None:
        return {}
    values = diagnostics_by_name(diagnostics).get("bridge: output", (0, "", {}))[2]
    prefix, suffix = "preview_step_", "_sooner_median_ms"
    return {
        key[len(prefix) : -len(suffix)]: round(float(v), 2)
        for key, v in values.items()
        if key.startswith(prefix) and key.endswith(suffix)
    }


def main(argv=None) -> int:
    args = parse_args(argv)
    from physis_ros.nodes.monitor import Monitor
    from physis_ros.nodes.system import LocalSystem

    domain_id = args.domain_id
    if domain_id is None:
        domain_id = int(os.environ.get("ROS_DOMAIN_ID") or random.randint(150, 199))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    loop = LocalSystem(domain_id=domain_id, model=args.model, log_dir=str(out / "logs"))
    os.environ.update(
        {k: loop.env[k] for k in ("ROS_AUTOMATIC_DISCOVERY_RANGE", "FASTDDS_DEFAULT_PROFILES_FILE")}
    )
    print(f"physis-demo: ROS_DOMAIN_ID={domain_id}, logs in {loop.log_dir}", flush=True)
    monitor = None
    rows: list[np.ndarray] = []
    stats = None
    started_s = time.monotonic()
    interrupted = False
    try:
        port = loop.start_server()
        print(f"physis-demo: physis-serve ({args.model}) on 127.0.0.1:{port}", flush=True)
        monitor = Monitor(domain_id=domain_id)
        camera = shipped_camera(args.model)
        if camera is not None:
            loop.start_sim_robot(**{k: v for k, v in camera.items() if k != "chunk_ms"})
        else:
            loop.start_sim_robot()
        loop.start_bridge(target_interval_ms=args.target_interval_ms, previews=args.previews)
        started_s = time.monotonic()
        while time.monotonic() - started_s < args.duration_s:
            time.sleep(1.0)
            dead = [name for name, ok in loop.alive().items() if not ok]
            if dead:
                print(f"physis-demo: {dead} exited; see {loop.log_dir}", file=sys.stderr)
                break
            stats = monitor.get("pipeline_stats")
            view = monitor.get("predicted/side_by_side")
            if view is not None:
                rows.append(image_to_rgb(view))
            t = time.monotonic() - started_s
            if stats is None:
                frames = monitor.count("camera/image")
                print(f"[{t:5.1f} s] waiting for the bridge ({frames} camera frames)", flush=True)
                continue
            drops = dict(zip(stats.drop_reasons, stats.drop_counts, strict=True))
            print(
                f"[{t:5.1f} s] interval {stats.interval_median_ms:6.1f} ms "
                f"(p99 {stats.interval_p99_ms:6.1f}, target {stats.target_interval_ms:.0f})  "
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
        counts, sooner = {}, {}
        if monitor is not None:
            counts = {
                t: monitor.count(t) for t in ("camera/image", "action_chunk", "predicted/image")
            }
            if args.previews:
                sooner = preview_sooner_ms(monitor.get("/diagnostics"))
            monitor.close()
        exit_codes = loop.stop()
    summary = {
        "model": args.model,
        "duration_s": round(elapsed_s, 2),
        "interrupted": interrupted,
        "children_exit_codes": exit_codes,
        "topic_messages_seen": counts,
    }
    if stats is not None:
        summary.update(
            interval_median_ms=round(stats.interval_median_ms, 2),
            interval_p99_ms=round(stats.interval_p99_ms, 2),
            interval_jitter_ms=round(stats.interval_jitter_ms, 2),
            promised_interval_ms=round(stats.promised_interval_ms, 2),
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
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    # before the first observation is paired the view has no observed half (and fewer rows)
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


if __name__ == "__main__":
    sys.exit(main())
