"""Blip: a robot's link cut for a while and back, resumed stream against a new stream. Prints
one JSON object (and writes it with ``--out``).

For each mode, physis-serve with the shipped default model (config/serve.yaml) and two
LinkClients streaming at ``--target-ms``: stream A through a TCP proxy whose link is cut for
``--cut-s`` (``physis_ros.bench.link_cut``), stream B straight to the server, undisturbed.
Modes: ``resumed`` (``--resume-grace-s``: A re-attaches to its stream) and ``new_stream``
(``--resume-grace-s 0``: A opens a new stream, as before resumable streams). Per repeat:

- ``first_prediction_s``: from the link coming back to A's first prediction;
- ``first_conditioned_s``: ... to A's first prediction conditioned on an observation captured
  after the link came back;
- ``refused``: why A had no prediction 30 s after the link came back (a new stream goes
  through admission again, which may refuse it on a pool that got slower meanwhile);
- ``other_stream``: B's interval p50/p99 (between its rollouts, or chunks without rollouts)
  over ``--window-s`` before the cut, during the cut and until A's first prediction, and
  ``--window-s`` after; B's promise (revision, interval) at each of those moments.

Medians over the repeats and their ratios (new_stream / resumed) close the report.

    python benchmarks/blip.py --repeats 5 --out docs/blip/DATE.json
    python benchmarks/blip.py --cut-s 5 --repeats 3 -- --model tiny   # physis-serve flags after --
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc
import numpy as np

from physis_ros.bench.link_cut import LinkCutProxy
from physis_ros.children import stop_child
from physis_ros.link.client import LinkClient, Observation, Prediction
from physis_ros.link.proto_gen import physis_pb2 as pb
from physis_ros.link.proto_gen import physis_pb2_grpc as pb_grpc
from physis_ros.link.wire import rgb_image

BACKOFF_S = (0.05, 0.25)
"""Both clients' reconnect backoff: the time to the next attempt after the link is back is
the same small figure in both modes, not a share of a doubling backoff."""


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cut-s", type=float, default=2.0, help="how long the link is cut")
    parser.add_argument("--repeats", type=int, default=5, help="cuts per mode")
    parser.add_argument("--target-ms", type=float, default=1000.0, help="each stream's interval")
    parser.add_argument("--resume-grace-s", type=float, default=10.0, help="the resumed mode's")
    parser.add_argument("--window-s", type=float, default=8.0, help="B's before/after windows")
    parser.add_argument("--warmup-s", type=float, default=10.0, help="streaming before cuts")
    parser.add_argument("--out", default=None, help="also write the JSON here")
    parser.add_argument("serve_args", nargs="*", help="more physis-serve flags (after --)")
    args = parser.parse_args(argv)
    if not (args.cut_s > 0 and args.repeats >= 1 and args.target_ms > 0):
        parser.error("--cut-s and --target-ms must be > 0, --repeats >= 1")
    if not args.resume_grace_s > args.cut_s:
        parser.error("--resume-grace-s must be longer than --cut-s")
    return args


class Server:
    """physis-serve on an ephemeral 127.0.0.1 port, its log in ``log_path``."""

    def __init__(self, out_dir: Path, name: str, flags: list[str]) -> None:
        port_file = out_dir / f"{name}.port"
        self.log_path = out_dir / f"{name}.log"
        cmd = [sys.executable, "-m", "physis_ros.serve.main", "--port", "0",
               "--port-file", str(port_file), *flags]  # fmt: skip
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 600
        while not port_file.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"physis-serve did not serve: see {self.log_path}")
            time.sleep(0.1)
        self.target = f"127.0.0.1:{int(port_file.read_text())}"

    def info(self) -> pb.ServerInfo:
        with grpc.insecure_channel(self.target) as channel:
            return pb_grpc.PhysisStub(channel).GetServerInfo(pb.ServerInfoRequest(), timeout=10)

    def stop(self) -> int:
        return stop_child(self.proc, timeout_s=30.0)


class Robot:
    """A LinkClient fed frames at the stream's pace; its predictions kept with their arrival
    time (robot clock, monotonic ns)."""

    def __init__(self, target: str, name: str, target_ms: float) -> None:
        self.client = LinkClient(
            target,
            client_name=name,
            target_interval_ms=target_ms,
            reconnect_backoff_s=BACKOFF_S,
            connect_timeout_s=10.0,
            on_prediction=self._take,
        )
        self._lock = threading.Lock()
        self.arrivals: list[tuple[int, Prediction]] = []
        self.seq = 0
        self._stop = threading.Event()
        self._feeder = threading.Thread(target=self._feed, args=(target_ms,), daemon=True)

    def start(self) -> None:
        self.client.start()
        self._feeder.start()

    def _take(self, prediction: Prediction) -> None:
        with self._lock:
            self.arrivals.append((time.monotonic_ns(), prediction))

    def _feed(self, target_ms: float) -> None:
        while not self._stop.is_set():
            promise = self.client.stats().promise
            if promise is None:
                self._stop.wait(0.05)
                continue
            frame = np.zeros((promise.image_height, promise.image_width, 3), np.uint8)
            action = np.zeros(promise.action_dim, np.float32) if promise.action_dim else None
            self.client.send_observation(
                Observation(
                    seq=self.seq,
                    capture_stamp_ns=time.time_ns(),
                    image=rgb_image(frame),
                    action=action,
                )
            )
            self.seq += 1
            self._stop.wait(target_ms / 1000.0 / max(promise.chunk_frames, 1))

    def since(self, t_ns: int) -> list[tuple[int, Prediction]]:
        with self._lock:
            return [(t, p) for t, p in self.arrivals if t >= t_ns and not p.preview_steps]

    def close(self) -> None:
        self._stop.set()
        self._feeder.join(5)
        self.client.close()


def wait_first(robot: Robot, t_ns: int, *, min_seq: int = -1, timeout_s: float = 30.0):
    """Seconds from ``t_ns`` to the robot's first prediction after it (anchored on an
    observation >= ``min_seq``); None on timeout."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for t, p in robot.since(t_ns):
            if p.observation_seq >= min_seq:
                return (t - t_ns) / 1e9
        time.sleep(0.005)
    return None


def intervals(arrivals: list[tuple[int, Prediction]], rollouts: bool) -> dict:
    """p50 / p99 (ms) of the time between deliveries: rollouts (the first chunk of each
    anchor) or chunks."""
    times, anchors = [], set()
    for t, p in arrivals:
        if rollouts and p.anchor_slot in anchors:
            continue
        anchors.add(p.anchor_slot)
        times.append(t)
    gaps = np.diff(np.array(times, dtype=np.float64)) / 1e6
    if len(gaps) == 0:
        return {"n": 0}
    return {
        "n": len(gaps),
        "p50_ms": round(float(np.percentile(gaps, 50)), 1),
        "p99_ms": round(float(np.percentile(gaps, 99)), 1),
    }


def promise_now(robot: Robot) -> dict:
    p = robot.client.stats().promise
    return {
        "revision": p.revision,
        "interval_ms": round(p.expected_interval_ms, 1),
        "response_latency_ms": round(p.expected_response_latency_ms, 1),
    }


def one_cut(a: Robot, b: Robot, proxy: LinkCutProxy, args) -> dict:
    """One cut of A's link; B watched before, during and after it."""
    rollouts = b.client.stats().promise.rollouts
    t_before = time.monotonic_ns()
    time.sleep(args.window_s)
    if not a.since(t_before):  # an earlier cut left it refused: nothing to cut
        return {"skipped": f"stream A not streaming ({a.client.stats().last_error})"}
    promise_before = promise_now(b)
    t_cut = time.monotonic_ns()
    proxy.cut()
    time.sleep(args.cut_s)
    proxy.restore()
    t_back, seq_back = time.monotonic_ns(), a.seq
    first = wait_first(a, t_back)
    conditioned = wait_first(a, t_back, min_seq=seq_back) if first is not None else None
    refused = a.client.stats().last_error if first is None else ""  # e.g. admission's
    t_first = time.monotonic_ns()
    promise_during = promise_now(b)
    time.sleep(args.window_s)
    t_end = time.monotonic_ns()
    seen = b.since(t_before)
    return {
        "first_prediction_s": None if first is None else round(first, 3),
        "first_conditioned_s": None if conditioned is None else round(conditioned, 3),
        **({"refused": refused} if refused else {}),
        "other_stream": {
            "before": intervals([x for x in seen if x[0] < t_cut], rollouts),
            "during": intervals([x for x in seen if t_cut <= x[0] < t_first], rollouts),
            "after": intervals([x for x in seen if t_first <= x[0] < t_end], rollouts),
            "promise": {
                "before": promise_before,
                "during": promise_during,
                "after": promise_now(b),
            },
        },
    }


def run_mode(name: str, grace_s: float, out_dir: Path, args) -> dict:
    server = Server(out_dir, name, ["--resume-grace-s", str(grace_s), *args.serve_args])
    proxy = LinkCutProxy(server.target)
    a = Robot(proxy.address, "blip-a", args.target_ms)
    b = Robot(server.target, "blip-b", args.target_ms)
    try:
        b.start()
        a.start()
        t0 = time.monotonic_ns()
        for robot in (a, b):
            if wait_first(robot, t0, timeout_s=300.0) is None:
                raise RuntimeError(
                    f"{name}: no prediction ({robot.client.stats().last_error}): with a "
                    "refusal, try a larger --target-ms"
                )
        time.sleep(args.warmup_s)
        cuts = [one_cut(a, b, proxy, args) for _ in range(args.repeats)]
        info = server.info()
        stats = a.client.stats()
    finally:
        a.close()
        b.close()
        proxy.close()
        code = server.stop()
    firsts = [c["first_prediction_s"] for c in cuts if c.get("first_prediction_s") is not None]
    conds = [c["first_conditioned_s"] for c in cuts if c.get("first_conditioned_s") is not None]
    return {
        "resume_grace_s": grace_s,
        "repeats": cuts,
        "median_first_prediction_s": round(statistics.median(firsts), 3) if firsts else None,
        "median_first_conditioned_s": round(statistics.median(conds), 3) if conds else None,
        "not_back_within_30_s": sum(1 for c in cuts if "refused" in c),
        "skipped": sum(1 for c in cuts if "skipped" in c),
        "stream_a": {"connections": stats.connections, "resumes": stats.resumes},
        "server": {
            "streams_opened": info.streams_opened,
            "refusals": dict(info.refusals),
            "streams_resumed": info.streams_resumed,
            "streams_expired": info.streams_expired,
            "model": info.model,
        },
        "server_exit_code": code,
    }


def main(argv=None) -> int:
    args = parse_args(argv)
    out_dir = Path(tempfile.mkdtemp(prefix="physis_blip_"))
    started = datetime.datetime.now(datetime.UTC)
    load_before = os.getloadavg()
    modes = {
        "resumed": run_mode("resumed", args.resume_grace_s, out_dir, args),
        "new_stream": run_mode("new_stream", 0.0, out_dir, args),
    }
    ratios = {}
    for key in ("median_first_prediction_s", "median_first_conditioned_s"):
        resumed, new = modes["resumed"][key], modes["new_stream"][key]
        ratios[key] = round(new / resumed, 2) if resumed and new else None
    report = {
        "started_utc": started.isoformat(timespec="seconds"),
        "cut_s": args.cut_s,
        "target_interval_ms": args.target_ms,
        "reconnect_backoff_s": list(BACKOFF_S),
        "serve_args": args.serve_args,
        "host": {
            "cpus": os.cpu_count(),
            "loadavg_before": load_before,
            "loadavg_after": os.getloadavg(),
        },
        "modes": modes,
        "new_stream_over_resumed": ratios,
        "logs": str(out_dir),
    }
    text = json.dumps(report, indent=2)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
