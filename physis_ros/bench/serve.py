"""`physis-bench serve`: the real server's admission and promises against what streams get.

Starts physis-serve as a user would (one process, or ``--ranks N`` gloo ranks under torchrun)
with ``--config``, then opens robot streams one by one at ``--target-ms`` until the server
refuses one (RESOURCE_EXHAUSTED) or ``--max-streams`` are open. Every admitted stream is a
real ``LinkClient`` that sends a chunk's camera frames (each with a commanded action) per
interval, one observed slot of the live timeline, and takes every prediction. After each
admission the streams run ``--settle-s`` seconds (every earlier stream is measured there:
does it keep its target after a later one joined?); after the last, all run ``--measure-s``
seconds, measured.

Measured per stream, from the server's stamps on its predictions: the interval between
consecutive chunks leaving the pipeline (median, p99), the response latency (observation
handed to the engine -> the first chunk conditioned on it left), and the chunk overlap (share
of chunks that entered before the previous one left). Promised: the newest promise the
server sent (at OpenStream or revised since). Prints one JSON object with ``--json``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import numpy as np

from physis_ros.children import stop_child
from physis_ros.link.client import LinkClient, Observation
from physis_ros.link.proto_gen import physis_pb2 as pb
from physis_ros.link.proto_gen import physis_pb2_grpc as pb_grpc
from physis_ros.link.wire import rgb_image
from physis_ros.nodes.stats import ChunkOverlap

DEFAULT_CONFIG = Path(__file__).resolve().parents[2] / "config" / "serve.yaml"
TOLERANCE = 0.10
"""A stream keeps its promise when its measured median interval is within this of it."""


@dataclass
class _Stream:
    """One admitted robot stream: its client, and what came back (server stamps, ns)."""

    index: int
    client: LinkClient
    target_ms: float
    left_ns: list[int] = field(default_factory=list)
    response_ms: list[float] = field(default_factory=list)
    overlap: ChunkOverlap = field(default_factory=ChunkOverlap)
    stop: threading.Event = field(default_factory=threading.Event)
    thread: threading.Thread | None = None
    _responded_seq: int = -1

    def run(self) -> None:
        """Send a chunk of camera frames every interval, take every prediction (its own thread)."""
        promise = self.client.stats().promise
        rng = np.random.default_rng(self.index)
        h, w = promise.image_height, promise.image_width
        # a camera: chunk_frames frames per interval, each observed slot one chunk (the live
        # timeline, DESIGN.md §3.1)
        period_s = (promise.target_interval_ms or self.target_ms) / 1e3
        period_s /= max(promise.chunk_frames, 1)
        seq, next_s = 0, time.monotonic()
        while not self.stop.is_set():
            now_s = time.monotonic()
            if now_s >= next_s:
                frame = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
                action = rng.uniform(-1, 1, promise.action_dim).astype(np.float32)
                self.client.send_observation(
                    Observation(
                        seq=seq,
                        capture_stamp_ns=time.time_ns(),
                        image=rgb_image(frame),
                        action=action if promise.action_dim else None,
                    )
                )
                seq += 1
                next_s = max(next_s + period_s, now_s)
            pred = self.client.get_prediction(min(0.01, max(next_s - now_s, 0.0)))
            if pred is None:
                continue
            times = pred.server_times_ns
            if not promise.rollouts or pred.horizon == 1:  # rollouts: the interval between them
                self.left_ns.append(times["left"])
            self.overlap.add(pred.stream_id, times["entered"], times["left"])
            if pred.observation_seq > self._responded_seq and times["queued"]:
                self._responded_seq = pred.observation_seq
                self.response_ms.append((times["left"] - times["queued"]) / 1e6)

    def intervals_ms(self, since_ns: int) -> list[float]:
        left = [t for t in self.left_ns if t >= since_ns]
        return [(b - a) / 1e6 for a, b in itertools.pairwise(left)]


def _pct(values: list[float], q: float) -> float:
    v = sorted(values)
    return v[min(len(v) - 1, int(q * len(v)))] if v else 0.0


def start_server(args: argparse.Namespace, folder: Path):
    """physis-serve (one process or torchrun) on 127.0.0.1, an ephemeral port; its port."""
    port_file = folder / "port"
    serve = ["-m", "physis_ros.serve.main", "--config", str(args.config), "--host", "127.0.0.1"]
    serve += ["--port", "0", "--port-file", str(port_file)]
    if args.model:
        serve += ["--model", args.model]
    if args.ranks:
        # physis-torchrun: torchrun that ends in one line when stopped (torchrun itself
        # writes a SignalException traceback into the server's log at every SIGTERM)
        cmd = [sys.executable, "-m", "physis_ros.tools.torchrun", "--standalone"]
        cmd += ["--nproc-per-node", str(args.ranks), *serve]
    else:
        cmd = [sys.executable, *serve]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(Path(__file__).resolve().parents[2]), env.get("PYTHONPATH")])
    )
    log_path = Path(args.log) if args.log else folder / "serve.log"
    log = open(log_path, "wb")  # noqa: SIM115 - closed by the caller via the returned handle
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + args.startup_timeout_s
    while not (port_file.exists() and port_file.read_text().strip()):
        if proc.poll() is not None or time.monotonic() > deadline:
            stop_child(proc)
            log.close()
            tail = log_path.read_text(errors="replace").strip().splitlines()[-5:]
            raise RuntimeError(f"physis-serve did not start: {' | '.join(tail)}")
        time.sleep(0.2)
    return proc, log, int(port_file.read_text())


def open_stream(target: str, index: int, target_ms: float, timeout_s: float):
    """A streaming client, or the server's refusal (None, reason)."""
    client = LinkClient(
        target,
        seed=index,
        target_interval_ms=target_ms,
        client_name=f"bench-{index}",
        connect_timeout_s=timeout_s,
    )
    client.start()
    deadline = time.monotonic() + timeout_s + 5
    while time.monotonic() < deadline:
        stats = client.stats()
        if stats.state == "streaming" and stats.promise is not None:
            return client, ""
        if stats.last_error:
            client.close()
            return None, stats.last_error
        time.sleep(0.02)
    client.close()
    return None, f"no answer to OpenStream in {timeout_s} s"


def server_plan(target: str) -> tuple[str, dict[str, str]]:
    with grpc.insecure_channel(target) as channel:
        info = pb_grpc.PhysisStub(channel).GetServerInfo(pb.ServerInfoRequest(), timeout=10)
    return info.placement, dict(info.engine)


def run(args: argparse.Namespace) -> dict:
    folder = Path(tempfile.mkdtemp(prefix="physis-bench-serve-"))
    proc, log, port = start_server(args, folder)
    target = f"127.0.0.1:{port}"
    streams: list[_Stream] = []
    refused = ""
    after_joins: dict[int, list[float]] = {}
    try:
        plan, engine_info = server_plan(target)
        for index in range(args.max_streams):
            client, refused = open_stream(target, index, args.target_ms, args.open_timeout_s)
            if client is None:
                break
            stream = _Stream(index=index, client=client, target_ms=args.target_ms)
            stream.thread = threading.Thread(target=stream.run, daemon=True)
            stream.thread.start()
            streams.append(stream)
            joined_ns = time.time_ns()
            time.sleep(args.settle_s)
            settle_from = joined_ns + int(args.settle_s * 0.4e9)  # past the joining transient
            for earlier in streams[:-1]:
                gaps = earlier.intervals_ms(settle_from)
                if gaps:
                    after_joins.setdefault(earlier.index, []).append(statistics.median(gaps))
        measure_from = time.time_ns()
        time.sleep(args.measure_s)
        report_streams = [_report(s, measure_from, after_joins) for s in streams]
        _, engine_info = server_plan(target)  # committed utilization and memory, all open
    finally:
        for s in streams:
            s.stop.set()
        for s in streams:
            if s.thread is not None:
                s.thread.join(timeout=5)
            s.client.close()
        stop_child(proc, timeout_s=30)
        log.close()
    within = [s["within_10_percent"] for s in report_streams]
    return {
        "runtime": f"torchrun, {args.ranks} gloo ranks" if args.ranks else "single process",
        "overlap": round(
            statistics.mean(s["overlap"] for s in report_streams) if report_streams else 0.0, 3
        ),
        "admitted": len(streams),
        "refused_reason": refused,
        "streams": report_streams,
        "all_within_10_percent": bool(within) and all(within),
        "none_missed_after_a_later_join": all(
            not s["missed_target_after_a_later_join"] for s in report_streams
        ),
        "target_ms": args.target_ms,
        "plan": plan,
        "pool": engine_info,
        "settle_s": args.settle_s,
        "measure_s": args.measure_s,
        "method": (
            "intervals between consecutive chunks leaving the server's pipeline (its stamps), "
            f"over the last {args.measure_s} s with every admitted stream running; each "
            "stream sends one chunk of camera frames per interval; promised: the newest promise "
            "the server sent the stream"
        ),
    }


def _report(stream: _Stream, since_ns: int, after_joins: dict[int, list[float]]) -> dict:
    promise = stream.client.stats().promise
    gaps = stream.intervals_ms(since_ns)
    p50 = statistics.median(gaps) if gaps else 0.0
    promised = promise.expected_interval_ms
    joins = after_joins.get(stream.index, [])
    return {
        "target_ms": stream.target_ms,
        "promised_ms": round(promised, 2),
        "measured_p50_ms": round(p50, 2),
        "measured_p99_ms": round(_pct(gaps, 0.99), 2),
        "within_10_percent": bool(gaps) and abs(p50 - promised) <= TOLERANCE * promised,
        "promised_latency_ms": round(promise.expected_response_latency_ms, 2),
        "measured_latency_p50_ms": round(
            statistics.median(stream.response_ms) if stream.response_ms else 0.0, 2
        ),
        "promise_revision": promise.revision,
        "horizon": promise.horizon,
        "rollouts": promise.rollouts,
        "p50_after_each_later_join_ms": [round(v, 2) for v in joins],
        "missed_target_after_a_later_join": any(
            v > (1 + TOLERANCE) * stream.target_ms for v in joins
        ),
        "overlap": round(stream.overlap.share(), 3),
        "chunks_measured": len(gaps) + 1 if gaps else 0,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="physis-bench serve", description=__doc__.split("\n")[0])
    parser.add_argument("--config", default=str(DEFAULT_CONFIG), help="physis-serve YAML")
    parser.add_argument("--model", default=None, help="overrides the config's engine.model")
    parser.add_argument(
        "--ranks", type=int, default=0, help="gloo ranks under torchrun (0: one process)"
    )
    parser.add_argument(
        "--target-ms", type=float, default=400.0, help="interval every stream asks for"
    )
    parser.add_argument("--max-streams", type=int, default=8)
    parser.add_argument("--settle-s", type=float, default=6.0, help="run after each admission")
    parser.add_argument("--measure-s", type=float, default=15.0, help="measured run, all streams")
    parser.add_argument("--open-timeout-s", type=float, default=30.0)
    parser.add_argument("--startup-timeout-s", type=float, default=300.0)
    parser.add_argument("--log", default=None, help="write physis-serve's log here")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    if args.ranks < 0 or args.target_ms <= 0 or args.max_streams < 1:
        parser.error("--ranks must be >= 0, --target-ms > 0 and --max-streams >= 1")
    try:
        result = run(args)
    except RuntimeError as err:
        print(f"physis-bench serve: {err}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(result))
    else:
        print(json.dumps(result, indent=1))
    return 0 if result["admitted"] else 1


if __name__ == "__main__":
    sys.exit(main())
