"""Soak: ``physis-demo`` for N minutes, as an operator leaves it running. Prints one JSON
object (and writes it with ``--out``):

- ``rss_mb_per_min``: each process's resident memory slope (least squares over samples
  every ``--sample-s``, after the first ``--warmup-min`` minutes): physis-serve, the
  bridge, sim_robot and physis-demo itself; ``rss_mb``: first, last and highest sample;
- ``per_minute``: for each minute of streaming, chunks received and drops by reason in
  it, and the bridge's interval and response latency p50/p99 (its ``pipeline_stats``:
  windows of its last 200 deliveries; p50 at the minute's end, p99 the highest it read
  in the minute);
- ``drops`` and ``chunks_received`` over the run, ``exit_codes`` of physis-demo and of
  each program it started.

    python benchmarks/soak.py --minutes 10 --out docs/soak/2026-05-09.json
    python benchmarks/soak.py --minutes 2 -- --model push-wam     # physis-demo's flags after --
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from physis_ros.children import stop_child
from physis_ros.nodes.system import ros_env

PROGRAMS = {
    "server": "physis_ros.serve.main",
    "bridge": "physis_ros.nodes.bridge",
    "sim_robot": "physis_ros.nodes.sim_robot",
}
"""physis-demo's children, by the module each runs."""

STARTUP_ALLOWANCE_S = 420.0
"""physis-demo's start (server load and calibration on a busy host) and stop, beyond the run."""


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=10.0, help="streaming time")
    parser.add_argument("--sample-s", type=float, default=5.0, help="RSS sampling period")
    parser.add_argument(
        "--warmup-min", type=float, default=1.0, help="minutes left out of the RSS slopes"
    )
    parser.add_argument("--out", default=None, help="also write the JSON here")
    parser.add_argument("demo_args", nargs="*", help="more physis-demo flags (after --)")
    args = parser.parse_args(argv)
    if not (args.minutes > 0 and args.sample_s > 0 and 0 <= args.warmup_min < args.minutes):
        parser.error("--minutes and --sample-s must be positive, --warmup-min below --minutes")
    return args


def rss_mb(pid: int) -> float | None:
    """Resident memory of ``pid`` (None once it is gone)."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    for line in text.splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return None


def children_of(pid: int) -> dict[str, int]:
    """physis-demo's programs (``PROGRAMS``) by name -> pid."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) != pid:
            continue
        args = [a.decode(errors="replace") for a in cmdline]
        for name, module in PROGRAMS.items():
            if module in args:
                found[name] = int(entry.name)
    return found


class StatsListener:
    """The bridge's ``pipeline_stats`` on the demo's domain, each with its arrival time."""

    def __init__(self, domain_id: int) -> None:
        import rclpy
        from rclpy.context import Context
        from rclpy.executors import SingleThreadedExecutor
        from rclpy.node import Node
        from rclpy.qos import QoSProfile, ReliabilityPolicy
        from rclpy.signals import SignalHandlerOptions

        from physis_ros.msg import PipelineStats

        self._rclpy = rclpy
        self.context = Context()
        # Ctrl-C stays a KeyboardInterrupt of this process: it stops physis-demo (run)
        rclpy.init(
            args=[],
            context=self.context,
            domain_id=domain_id,
            signal_handler_options=SignalHandlerOptions.NO,
        )
        self.node = Node("physis_soak", context=self.context)
        self.messages: list[tuple[float, object]] = []  # one a second: small for hours
        self._lock = threading.Lock()
        qos = QoSProfile(depth=10, reliability=ReliabilityPolicy.RELIABLE)
        self.node.create_subscription(PipelineStats, "pipeline_stats", self._take, qos)
        self.executor = SingleThreadedExecutor(context=self.context)
        self.executor.add_node(self.node)
        self._running = True
        self._thread = threading.Thread(target=self._spin, daemon=True)
        self._thread.start()

    def _take(self, msg) -> None:
        with self._lock:
            self.messages.append((time.monotonic(), msg))

    def _spin(self) -> None:
        while self._running and self.context.ok():
            self.executor.spin_once(timeout_sec=0.1)

    def taken(self) -> list[tuple[float, object]]:
        with self._lock:
            return list(self.messages)

    def close(self) -> None:
        self._running = False
        self._thread.join(timeout=2.0)
        self.executor.shutdown()
        self.node.destroy_node()
        self._rclpy.shutdown(context=self.context)


def slope_mb_per_min(samples: list[tuple[float, float]], from_s: float) -> float | None:
    """Least-squares slope of (seconds, MB) samples from ``from_s`` on, in MB per minute."""
    kept = [(t, mb) for t, mb in samples if t >= from_s]
    if len(kept) < 3:
        return None
    t, mb = np.array(kept).T
    return round(float(np.polyfit(t / 60.0, mb, 1)[0]), 4)


def _drops(msg) -> dict[str, int]:
    return dict(zip(msg.drop_reasons, (int(c) for c in msg.drop_counts), strict=True))


def per_minute(stats: list[tuple[float, object]]) -> list[dict]:
    """One row per whole minute from the first chunk (see the module docstring)."""
    streaming = [(t, m) for t, m in stats if m.chunks_received > 0]
    if not streaming:
        return []
    t0 = streaming[0][0]
    rows, previous = [], streaming[0][1]
    minute = 1
    while True:
        inside = [m for t, m in streaming if t0 + (minute - 1) * 60 < t <= t0 + minute * 60]
        if not inside or streaming[-1][0] < t0 + minute * 60 - 2.0:
            break  # the last minute is whole (a stats message a second, some slack)
        last = inside[-1]
        before, after = _drops(previous), _drops(last)
        rows.append(
            {
                "minute": minute,
                "chunks": int(last.chunks_received - previous.chunks_received),
                "interval_p50_ms": round(last.interval_median_ms, 1),
                "interval_p99_ms": round(max(m.interval_p99_ms for m in inside), 1),
                "response_p50_ms": round(last.response_latency_ms, 1),
                "response_p99_ms": round(max(m.response_latency_p99_ms for m in inside), 1),
                "drops": {
                    k: v - before.get(k, 0) for k, v in after.items() if v > before.get(k, 0)
                },
            }
        )
        previous, minute = last, minute + 1
    return rows


def run(args) -> dict:
    domain_id = int(os.environ.get("ROS_DOMAIN_ID") or random.randint(150, 199))
    env = ros_env(domain_id)
    for key in ("ROS_AUTOMATIC_DISCOVERY_RANGE", "FASTDDS_DEFAULT_PROFILES_FILE"):
        if key in env:  # this process's listener discovers the demo's nodes like they do
            os.environ[key] = env[key]
    out_dir = Path(tempfile.mkdtemp(prefix="physis_soak_"))
    cmd = [sys.executable, "-m", "physis_ros.demo", "--duration-s", str(args.minutes * 60),
           "--domain-id", str(domain_id), "--out", str(out_dir), *args.demo_args]  # fmt: skip
    started = datetime.datetime.now(datetime.UTC)
    load_before = os.getloadavg()
    listener = StatsListener(domain_id)
    log = open(out_dir / "physis-demo.log", "wb")  # noqa: SIM115 - closed below
    demo = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    samples: dict[str, list[tuple[float, float]]] = {"physis-demo": []}
    pids = {"physis-demo": demo.pid}
    t_start = time.monotonic()
    deadline = t_start + args.minutes * 60 + STARTUP_ALLOWANCE_S
    try:
        while demo.poll() is None and time.monotonic() < deadline:
            pids.update(children_of(demo.pid))
            now = time.monotonic() - t_start
            for name, pid in pids.items():
                mb = rss_mb(pid)
                if mb is not None:
                    samples.setdefault(name, []).append((now, mb))
            time.sleep(args.sample_s)
    finally:
        code = stop_child(demo, sig=signal.SIGINT, timeout_s=60.0)  # physis-demo's own stop
        log.close()
        listener.close()
    stats = listener.taken()
    summary_path = out_dir / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    first_chunk = next((t - t_start for t, m in stats if m.chunks_received > 0), 0.0)
    slope_from = first_chunk + args.warmup_min * 60
    last = stats[-1][1] if stats else None
    return {
        "started_utc": started.isoformat(timespec="seconds"),
        "minutes": args.minutes,
        "physis_demo_args": cmd[3:],
        "host": {
            "cpus": os.cpu_count(),
            "loadavg_before": load_before,
            "loadavg_after": os.getloadavg(),
        },
        "first_chunk_after_s": round(first_chunk, 1),
        "rss_mb_per_min": {
            name: slope_mb_per_min(points, slope_from) for name, points in samples.items()
        },
        "rss_mb": {
            name: {
                "first": round(points[0][1], 1),
                "last": round(points[-1][1], 1),
                "max": round(max(mb for _, mb in points), 1),
            }
            for name, points in samples.items()
            if points
        },
        "per_minute": per_minute(stats),
        "chunks_received": int(last.chunks_received) if last is not None else 0,
        "promised_interval_ms": round(last.promised_interval_ms, 1) if last else None,
        "drops": _drops(last) if last is not None else {},
        "exit_codes": {"physis-demo": code, **summary.get("children_exit_codes", {})},
        "demo_summary": {k: summary[k] for k in ("duration_s", "interrupted") if k in summary},
        "logs": str(out_dir),
    }


def main(argv=None) -> int:
    args = parse_args(argv)
    # Also when started in the background (SIGINT ignored, as physis-demo would inherit it):
    # Ctrl-C stops the soak, and physis-demo stops on SIGINT.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    report = run(args)
    text = json.dumps(report, indent=2)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
    print(text)
    return 0 if all(c == 0 for c in report["exit_codes"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
