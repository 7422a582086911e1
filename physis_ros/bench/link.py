"""`physis-bench link`: what the robot <-> workstation link adds to latency, on loopback.

A child process runs the real front end (gRPC server, session pacing, engine thread) over
an echo engine that answers each generate request at once with a [16, 7] float32 action
chunk, so what is timed is the link, not a model. This process runs the real LinkClient.
Both processes share the host's wall clock, so one-way times are read directly:

- observation (640x480 rgb8, ~0.9 MB): from ``send_observation()`` to the server having
  parsed, checked and decoded it (the ``received`` stamp of the prediction conditioned on it);
- action chunk (16x7 float32): from the server's ``decoded`` stamp (the engine handed the
  chunk over) to ``get_prediction()`` returning it here.

The in-process baseline, measured in the same run next to each sample, is the call a
co-located consumer would make for the same payload (decode/check the observation into the
engine's input; copy the action chunk out). ``added = link - in-process``, per sample.
Warm-up samples are excluded; medians and p99 are reported. No torch anywhere.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from physis_ros.children import stop_child
from physis_ros.link.client import LinkClient, Observation
from physis_ros.link.wire import rgb_image

IMAGE_HW = (480, 640)
ACTION_HA = (16, 7)
TARGET_MEDIAN_MS = 2.0
TARGET_P99_MS = 5.0


class EchoEngine:
    """A StreamEngine with no model: each generate request is finished at once."""

    def __init__(
        self, *, image_hw: tuple[int, int] = IMAGE_HW, action_ha: tuple[int, int] = ACTION_HA
    ) -> None:
        self.image_hw, self.action_ha = image_hw, action_ha
        self._next_id = 0
        self._chunks: dict[int, int] = {}
        """stream -> the next slot no chunk was submitted for."""
        self._anchors: dict[int, int] = {}
        self._done: queue.SimpleQueue = queue.SimpleQueue()

    def open_stream(self, spec):
        from physis_ros.engine.api import StreamPromise

        sid, self._next_id = self._next_id, self._next_id + 1
        self._chunks[sid] = 0
        return StreamPromise(
            stream_id=sid,
            model="echo",
            steps=1,
            blocks=1,
            expected_interval_ms=0.0,
            pipeline_depth=1,
            expected_response_latency_ms=0.0,
            chunk_frames=1,
            image_height=self.image_hw[0],
            image_width=self.image_hw[1],
            action_horizon=self.action_ha[0],
            action_dim=self.action_ha[1],
        )

    def close_stream(self, stream_id: int) -> None:
        self._chunks.pop(stream_id, None)

    def submit_context(self, stream_id: int, frames, actions=None, *, slot=None) -> int:
        slot = self._chunks[stream_id] if slot is None else slot
        self._anchors[stream_id] = slot
        self._chunks[stream_id] = max(self._chunks[stream_id], slot + 1)
        return slot

    def submit_generate(self, stream_id: int, actions=None) -> int:
        from physis_ros.engine.api import ChunkOutput

        chunk = self._chunks[stream_id]
        self._chunks[stream_id] = chunk + 1
        now_s = time.monotonic()
        self._done.put(
            ChunkOutput(
                stream_id=stream_id,
                chunk=chunk,
                frames=None,
                actions=np.full(self.action_ha, chunk, np.float32),
                entered_s=now_s,
                left_s=now_s,
                decoded_s=now_s,
                anchor=self._anchors.get(stream_id, -1),
            )
        )
        return chunk

    def poll(self, timeout_s: float):
        out = []
        try:
            out.append(self._done.get(timeout=timeout_s))
            while True:
                out.append(self._done.get_nowait())
        except queue.Empty:
            pass  # nothing more finished: return what there is
        return out

    def shutdown(self) -> None:
        self._chunks.clear()


def serve_echo(port_file: str) -> int:
    """The child process: the real front end over EchoEngine on 127.0.0.1, until SIGTERM."""
    from physis_ros.serve.frontend import FrontendConfig, ServerDescription
    from physis_ros.serve.main import run_frontend

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    return run_frontend(
        EchoEngine(),
        ServerDescription(model="echo", steps=1, blocks=1),
        FrontendConfig(port=0),
        port_file=port_file,
        stop=stop,
        loop_options={"poll_timeout_s": 0.001},
    )


def _summary(link_ms: list[float], inproc_ms: list[float], nbytes: int) -> dict[str, float]:
    link = np.asarray(link_ms)
    inproc = np.asarray(inproc_ms)
    added = link - inproc
    return {
        "payload_bytes": nbytes,
        "samples": len(link),
        "added_ms_median": round(float(np.median(added)), 4),
        "added_ms_p99": round(float(np.percentile(added, 99)), 4),
        "inproc_ms_median": round(float(np.median(inproc)), 4),
        "link_ms_median": round(float(np.median(link)), 4),
        "link_ms_p99": round(float(np.percentile(link, 99)), 4),
    }


def run(samples: int, warmup: int, rate_hz: float, interval_ms: float) -> dict:
    from physis_ros.serve.observations import context_input

    with tempfile.TemporaryDirectory() as tmp:
        port_file = Path(tmp) / "port"
        env = dict(os.environ, OMP_NUM_THREADS="1")
        child = subprocess.Popen(
            [sys.executable, "-m", "physis_ros.bench.link", "--serve-echo", str(port_file)],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        try:
            deadline = time.monotonic() + 60
            while not port_file.exists():
                if child.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(
                        "echo server did not start: "
                        + (child.stderr.read().decode() if child.stderr else "")
                    )
                time.sleep(0.02)
            port = int(port_file.read_text())
            return _measure(
                f"127.0.0.1:{port}",
                samples,
                warmup,
                rate_hz,
                interval_ms,
                context_input=context_input,
            )
        finally:
            stop_child(child)


def _measure(target, samples, warmup, rate_hz, interval_ms, *, context_input) -> dict:
    rng = np.random.default_rng(0)
    frame = rng.integers(0, 255, (*IMAGE_HW, 3), dtype=np.uint8)
    image = rgb_image(frame)
    client = LinkClient(
        target, target_interval_ms=interval_ms, client_name="bench", prediction_queue_size=1024
    )
    got: list[tuple[int, object]] = []  # (robot ns when get_prediction returned, prediction)
    stop = threading.Event()

    def consume() -> None:
        while not stop.is_set():
            p = client.get_prediction(0.05)
            if p is not None:
                got.append((time.time_ns(), p))

    consumer = threading.Thread(target=consume, daemon=True)
    client.start()
    consumer.start()
    sent_ns: dict[int, int] = {}
    obs_inproc_ms: dict[int, float] = {}
    try:
        deadline = time.monotonic() + 30
        while client.stats().state != "streaming":
            if time.monotonic() > deadline:
                raise RuntimeError(f"no stream: {client.stats().last_error}")
            time.sleep(0.01)
        period_s = 1.0 / rate_hz
        next_s = time.monotonic()
        for seq in range(warmup + samples):
            obs = Observation(seq=seq, capture_stamp_ns=time.time_ns(), image=image)
            t0 = time.perf_counter()
            context_input(
                obs,
                send_stamp_ns=0,
                height=IMAGE_HW[0],
                width=IMAGE_HW[1],
                action_horizon=ACTION_HA[0],
                action_dim=ACTION_HA[1],
            )
            obs_inproc_ms[seq] = (time.perf_counter() - t0) * 1e3
            sent_ns[seq] = time.time_ns()
            client.send_observation(obs)
            next_s += period_s
            time.sleep(max(0.0, next_s - time.monotonic()))
        time.sleep(0.2)
    finally:
        stop.set()
        consumer.join(5)
        stats = client.stats()
        client.close()

    obs_link, obs_inproc, seen = [], [], set()
    act_link, act_inproc, act_server = [], [], []
    for t_got_ns, p in got:
        seq = p.observation_seq
        if seq >= warmup and seq not in seen and p.server_times_ns["received"]:
            seen.add(seq)
            obs_link.append((p.server_times_ns["received"] - sent_ns[seq]) / 1e6)
            obs_inproc.append(obs_inproc_ms[seq])
        if p.chunk_index >= warmup and p.actions is not None:
            act_link.append((t_got_ns - p.server_times_ns["decoded"]) / 1e6)
            act_server.append((p.server_times_ns["sent"] - p.server_times_ns["decoded"]) / 1e6)
            t0 = time.perf_counter()
            np.array(p.actions, dtype=np.float32, copy=True)  # the in-process hand-over
            act_inproc.append((time.perf_counter() - t0) * 1e3)
    if not obs_link or not act_link:
        raise RuntimeError(f"no samples measured; link stats: {stats}")
    result = {
        "bench": "link",
        "transport": "gRPC over 127.0.0.1 loopback, server (real front end, echo engine) in a "
        "child process",
        "observation_rgb8_640x480": _summary(obs_link, obs_inproc, IMAGE_HW[0] * IMAGE_HW[1] * 3),
        "actions_16x7": {
            **_summary(act_link, act_inproc, ACTION_HA[0] * ACTION_HA[1] * 4),
            # Of link_ms: the server's part (engine thread -> gRPC writer thread, serialised),
            # the rest being the wire and the client (grpc threads -> get_prediction).
            "server_ms_median": round(float(np.median(act_server)), 4),
        },
        "warmup_samples": warmup,
        "observation_rate_hz": rate_hz,
        "chunk_interval_ms": interval_ms,
        "clock_offset_ms": stats.clock_offset_ms,
        "clock_offset_uncertainty_ms": stats.clock_offset_uncertainty_ms,
        "drops": stats.drops,
        "target_added_ms_median": TARGET_MEDIAN_MS,
        "target_added_ms_p99": TARGET_P99_MS,
    }
    result["meets_target"] = all(
        result[k]["added_ms_median"] <= TARGET_MEDIAN_MS
        and result[k]["added_ms_p99"] <= TARGET_P99_MS
        for k in ("observation_rgb8_640x480", "actions_16x7")
    )
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="physis-bench link", description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--samples", type=int, default=300, help="observations measured")
    parser.add_argument("--warmup", type=int, default=30, help="observations not measured")
    parser.add_argument("--rate-hz", type=float, default=30.0, help="observation rate")
    parser.add_argument("--interval-ms", type=float, default=20.0, help="chunk interval asked")
    parser.add_argument("--serve-echo", metavar="PORT_FILE", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve_echo:
        return serve_echo(args.serve_echo)
    for name in ("samples", "rate_hz", "interval_ms"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be > 0, got {getattr(args, name)}")
    result = run(args.samples, args.warmup, args.rate_hz, args.interval_ms)
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"{'payload':28s} {'added med':>10s} {'added p99':>10s} {'in-proc med':>12s}  (ms)")
    for key in ("observation_rgb8_640x480", "actions_16x7"):
        r = result[key]
        print(
            f"{key:28s} {r['added_ms_median']:10.3f} {r['added_ms_p99']:10.3f} "
            f"{r['inproc_ms_median']:12.4f}"
        )
    print(
        f"target: median <= {TARGET_MEDIAN_MS} ms, p99 <= {TARGET_P99_MS} ms: "
        f"{'met' if result['meets_target'] else 'NOT met'}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
