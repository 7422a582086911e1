"""Resident memory of physis-serve through floods of large observations (issue 20): idle, at
the end of each flood, and some seconds after it; repeated floods show whether it grows.
Prints one JSON object.

    python benchmarks/flood_memory.py [--streams 14] [--floods 3] [--mb 7]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc

from physis_ros.link.proto_gen import physis_pb2 as pb
from physis_ros.link.proto_gen import physis_pb2_grpc as pb_grpc
from physis_ros.link.wire import PROTOCOL_VERSION, STREAM_ID_METADATA_KEY

STREAM_TARGET_MS = 2000.0


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def observation(seq: int, nbytes: int) -> bytes:
    msg = pb.ClientMessage(protocol_version=PROTOCOL_VERSION)
    o = msg.observation
    o.protocol_version, o.seq = PROTOCOL_VERSION, seq
    o.capture_stamp_ns = o.send_stamp_ns = time.time_ns()
    o.image.encoding, o.image.height, o.image.width, o.image.step = "rgb8", 16, 16, 48
    o.image.data = os.urandom(nbytes)  # the wrong size: dropped after it was received
    return msg.SerializeToString()


def run(args, tmp: Path) -> dict:
    (tmp / "serve.yaml").write_text("engine: {model: tiny}\n")
    port_file = tmp / "port"
    server = subprocess.Popen(
        [sys.executable, "-m", "physis_ros.serve.main", "--config", str(tmp / "serve.yaml"),
         "--port", "0", "--port-file", str(port_file), "--threads", "1", "--log-level", "WARNING"],
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )  # fmt: skip
    try:
        while not port_file.exists():
            if server.poll() is not None:
                raise RuntimeError(f"physis-serve exited {server.returncode}")
            time.sleep(0.1)
        target = f"127.0.0.1:{int(port_file.read_text())}"
        out = {"idle_mb": 0.0, "floods": []}
        with grpc.insecure_channel(target, [("grpc.max_send_message_length", 64 << 20)]) as ch:
            stub = pb_grpc.PhysisStub(ch)
            time.sleep(2.0)
            out["idle_mb"] = round(rss_mb(server.pid), 1)
            payloads = [observation(i, args.mb * 1_000_000 + i) for i in range(8)]
            calls, queues = [], []
            for i in range(args.streams):
                # slow targets: every stream is admitted beside the others (what is measured
                # is the front end's memory; the engine only ever sees dropped observations)
                spec = pb.StreamSpec(
                    protocol_version=PROTOCOL_VERSION,
                    client_name=f"f{i}",
                    target_interval_ms=STREAM_TARGET_MS,
                )
                sid = stub.OpenStream(spec, timeout=30).promise.stream_id
                q: list = []
                queues.append(q)
                call = ch.stream_stream("/physis.v1.Physis/Stream", lambda b: b, lambda b: b)(
                    _feeder(q),
                    metadata=((STREAM_ID_METADATA_KEY, str(sid)),),
                )
                calls.append(call)
                threading.Thread(target=_drain, args=(call,), daemon=True).start()
            for _ in range(args.floods):
                for r in range(30):
                    for i, q in enumerate(queues):
                        q.append(payloads[(i + r) % len(payloads)])
                while any(queues):
                    time.sleep(0.1)
                time.sleep(1.0)
                end_mb = rss_mb(server.pid)
                time.sleep(args.settle_s)
                out["floods"].append(
                    {"end_mb": round(end_mb, 1), "after_idle_mb": round(rss_mb(server.pid), 1)}
                )
            for call in calls:
                call.cancel()
        return out
    finally:
        server.terminate()
        server.wait(30)


def _drain(call) -> None:
    """Reads the stream's replies as a client does (unread, they would pile up in gRPC)."""
    try:
        for _ in call:
            pass
    except grpc.RpcError:
        return


def _feeder(q: list):
    """Yields what the benchmark appends to ``q`` (a busy-wait free enough for a benchmark)."""
    while True:
        while not q:
            time.sleep(0.005)
        yield q.pop(0)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--streams", type=int, default=14)
    p.add_argument("--floods", type=int, default=3)
    p.add_argument("--mb", type=int, default=7, help="observation size (MB, under 8)")
    p.add_argument("--settle-s", type=float, default=6.0, help="idle time after each flood")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as d:
        result = {
            "streams": args.streams,
            "observation_mb": args.mb,
            "observations_per_flood": 30 * args.streams,
            **run(args, Path(d)),
        }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
