"""`physis-bench link`: what the robot <-> workstation link adds to latency, on loopback.

A child process runs the real front end (gRPC server, session pacing, engine thread) over
an echo engine that answers each generate request at once with a [16, 7] float32 action
chunk, so what is timed is the link, not a model. This process runs the real LinkClient.
Both processes share the host's wall clock, so one-way times are read directly:

- observation (640x480 rgb8, ~0.9 MB): from ``send_observation()`` to the server having
  parsed, checked and decoded it (the ``received`` stamp of the prediction conditioned on it);
- action chunk (16x7 float32): from the server's ``decoded`` stamp (the engine handed the
  chunk over) to the client handing it to the application (``on_prediction``);
- observation -> action reply: the two together for each observation and the first chunk
  conditioned on it (the wait for the stream's next slot left out), against the round trip
  of the same bytes over bare gRPC bidirectional streams (``bare_grpc``: an immediate echo,
  a reply with the link's slot timing and thread hand-offs, and the least a protocol that
  reads its messages does) measured in the same run, in alternating rounds.

The in-process baseline, measured in the same run next to each sample, is the call a
co-located consumer would make for the same payload (decode/check the observation into the
engine's input; copy the action chunk out). ``added = link - in-process``, per sample.
Warm-up samples are excluded; medians and p99 are reported. No torch anywhere.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from physis_ros.bench import link_trace
from physis_ros.bench.bare_grpc import METHODS, READING, BareClient
from physis_ros.bench.bare_grpc import serve as serve_bare
from physis_ros.bench.link_echo import ACTION_HA, IMAGE_HW, prediction_reply_bytes, serve_echo
from physis_ros.children import stop_child
from physis_ros.cli_errors import finite_float
from physis_ros.link.client import LinkClient, Observation
from physis_ros.link.wire import rgb_image, serialize_observation
from physis_ros.serve.observations import context_input

TARGET_MEDIAN_MS = 2.0
TARGET_P99_MS = 5.0
TARGET_ROUND_TRIP_RATIO = 1.2
"""Observation -> action reply through the link, over the bare gRPC stream of the same bytes."""
PAUSE_S = 0.020
"""The breakdown also times the link's per-message steps alone in one thread after a sleep
this long (a 50 Hz stream's gap): what a pause costs on the host, without the link."""
AFTER_PAUSE_KEY = f"cpu_us_alone_after_{PAUSE_S * 1e3:g}ms_sleep"


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


def _start_child(flag: str, port_file: Path, *extra: str) -> tuple[subprocess.Popen, int]:
    """A child of this module (``--serve-echo`` / ``--serve-bare``) and the port it bound."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    child = subprocess.Popen(
        [sys.executable, "-m", "physis_ros.bench.link", flag, str(port_file), *extra],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    deadline = time.monotonic() + 60
    while not port_file.exists():
        if child.poll() is not None or time.monotonic() > deadline:
            stop_child(child)
            raise RuntimeError(
                f"{flag} server did not start: "
                + (child.stderr.read().decode() if child.stderr else "")
            )
        time.sleep(0.02)
    return child, int(port_file.read_text())


def run(
    samples: int,
    warmup: int,
    rate_hz: float,
    interval_ms: float,
    rounds: int,
    *,
    breakdown: bool = False,
) -> dict:
    """The link and the bare gRPC streams side by side: ``rounds`` rounds, each
    ``samples / rounds`` observations through the link, then as many round trips of the same
    bytes over each bare stream, at the same rate. ``breakdown``: where the link's round
    trip goes (``link_trace``)."""
    children = []
    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp) / "server_trace.json"
        try:
            extra = ("--trace", str(trace)) if breakdown else ()
            echo, echo_port = _start_child("--serve-echo", Path(tmp) / "echo", *extra)
            children.append(echo)
            bare_child, bare_port = _start_child(
                "--serve-bare", Path(tmp) / "bare", "--interval-ms", str(interval_ms)
            )
            children.append(bare_child)
            if breakdown:
                link_trace.install_client()
            link = _LinkRun(f"127.0.0.1:{echo_port}", interval_ms, context_input)
            bare = {m: BareClient(f"127.0.0.1:{bare_port}", m) for m in METHODS}
            try:
                per_round = max(samples // rounds, 1)
                head, pixels = link.request_parts()
                # Echo and Slotted send the same joined bytes every time; the Read streams join
                # them each time, as every message carrying a header and the pixels must.
                parts = {m: (head, pixels) if m in READING else (head + pixels,) for m in bare}
                link.observe(warmup, rate_hz, measured=False)
                for m, client in bare.items():
                    _bare_round(client, parts[m], warmup, rate_hz)
                bare_ms: dict[str, list[list[float]]] = {m: [] for m in bare}
                for _ in range(rounds):
                    link.observe(per_round, rate_hz, measured=True)
                    for m, client in bare.items():
                        bare_ms[m].append(_bare_round(client, parts[m], per_round, rate_hz))
                time.sleep(0.2)  # the last predictions come home
            finally:
                for client in bare.values():
                    client.close()
                stats = link.close()
        finally:
            for child in children:
                stop_child(child)
        result = link.result(stats, bare_ms, warmup=warmup, rate_hz=rate_hz)
        if breakdown:
            server = json.loads(trace.read_text()) if trace.exists() else []
            result["breakdown"] = {
                **link_trace.breakdown(link_trace.STAMPS, server, link.first_reply(), warmup),
                "cpu_us_warm_back_to_back": link_trace.step_cpu_us(),
                AFTER_PAUSE_KEY: link_trace.step_cpu_us(repeats=60, pause_s=PAUSE_S),
            }
        return result


def _bare_round(
    client: BareClient, parts: tuple[bytes, ...], n: int, rate_hz: float
) -> list[float]:
    period_s, next_s, out = 1.0 / rate_hz, time.monotonic(), []
    for _ in range(n):
        out.append(client.round_trip_ms(parts))
        next_s += period_s
        time.sleep(max(0.0, next_s - time.monotonic()))
    return out


class _LinkRun:
    """The real LinkClient against the echo front end; what each observation and action
    chunk took."""

    def __init__(self, target: str, interval_ms: float, context_input) -> None:
        rng = np.random.default_rng(0)
        self.image = rgb_image(rng.integers(0, 255, (*IMAGE_HW, 3), dtype=np.uint8))
        self.context_input = context_input
        # The application gets each prediction on the link's thread (on_prediction), as a
        # consumer that hands it on by itself would.
        self.client = LinkClient(
            target,
            target_interval_ms=interval_ms,
            client_name="bench",
            on_prediction=lambda p: self.got.append((time.time_ns(), p)),
        )
        self.interval_ms = interval_ms
        self.got: list[tuple[int, object]] = []  # (robot ns when the application got it, p)
        self.sent_ns: dict[int, int] = {}
        self.inproc_ms: dict[int, float] = {}
        self.measured: set[int] = set()
        self.next_seq = 0
        self.client.start()
        deadline = time.monotonic() + 30
        while self.client.stats().state != "streaming":
            if time.monotonic() > deadline:
                raise RuntimeError(f"no stream: {self.client.stats().last_error}")
            time.sleep(0.01)

    def request_parts(self) -> tuple[bytes, bytes]:
        """What the client puts on the wire for one observation: (the header, the pixels)."""
        obs = Observation(seq=0, capture_stamp_ns=time.time_ns(), image=self.image)
        raw = serialize_observation(obs, send_stamp_ns=time.time_ns())
        pixels = self.image.data
        if not raw.endswith(pixels):
            raise RuntimeError("the serialised observation does not end with its pixels")
        return raw[: len(raw) - len(pixels)], pixels

    def observe(self, n: int, rate_hz: float, *, measured: bool) -> None:
        period_s, next_s = 1.0 / rate_hz, time.monotonic()
        for _ in range(n):
            seq = self.next_seq
            self.next_seq += 1
            obs = Observation(seq=seq, capture_stamp_ns=time.time_ns(), image=self.image)
            t0 = time.perf_counter()
            self.context_input(
                obs,
                send_stamp_ns=0,
                height=IMAGE_HW[0],
                width=IMAGE_HW[1],
                action_horizon=ACTION_HA[0],
                action_dim=ACTION_HA[1],
            )
            self.inproc_ms[seq] = (time.perf_counter() - t0) * 1e3
            if measured:
                self.measured.add(seq)
            self.sent_ns[seq] = time.time_ns()
            self.client.send_observation(obs)
            next_s += period_s
            time.sleep(max(0.0, next_s - time.monotonic()))

    def first_reply(self) -> dict[int, int]:
        """Observation seq -> chunk of the first reply conditioned on it."""
        out: dict[int, int] = {}
        for _, p in self.got:
            if p.observation_seq >= 0:
                out.setdefault(p.observation_seq, p.chunk_index)
        return out

    def close(self):
        stats = self.client.stats()
        self.client.close()
        return stats

    def result(self, stats, bare_rounds: dict, *, warmup: int, rate_hz: float):
        obs_link, obs_inproc, seen = [], [], set()
        act_link, act_inproc, act_server = [], [], []
        round_trip: dict[int, float] = {}  # seq -> uplink + downlink of its first reply
        for t_got_ns, p in self.got:
            seq, times = p.observation_seq, p.server_times_ns
            if seq in self.measured and seq not in seen and times["received"]:
                seen.add(seq)
                up_ms = (times["received"] - self.sent_ns[seq]) / 1e6
                obs_link.append(up_ms)
                obs_inproc.append(self.inproc_ms[seq])
                round_trip[seq] = up_ms + (t_got_ns - times["decoded"]) / 1e6
            if p.chunk_index >= warmup and p.actions is not None:
                act_link.append((t_got_ns - times["decoded"]) / 1e6)
                act_server.append((times["sent"] - times["decoded"]) / 1e6)
                t0 = time.perf_counter()
                np.array(p.actions, dtype=np.float32, copy=True)  # the in-process hand-over
                act_inproc.append((time.perf_counter() - t0) * 1e3)
        if not obs_link or not act_link:
            raise RuntimeError(f"no samples measured; link stats: {stats}")
        result = {
            "bench": "link",
            "transport": "gRPC over 127.0.0.1 loopback, server (real front end, echo engine) "
            "in a child process",
            "observation_rgb8_640x480": _summary(
                obs_link, obs_inproc, IMAGE_HW[0] * IMAGE_HW[1] * 3
            ),
            "actions_16x7": {
                **_summary(act_link, act_inproc, ACTION_HA[0] * ACTION_HA[1] * 4),
                # Of link_ms: the server's part (engine thread -> gRPC writer thread,
                # serialised), the rest being the wire and the client.
                "server_ms_median": round(float(np.median(act_server)), 4),
            },
            "round_trip": {
                "what": "observation (rgb8 640x480) up, 16x7 float32 action chunk down; the "
                "link: uplink to the server's parsed-and-checked stamp + downlink from the "
                "engine's hand-over (the wait for the stream's next slot left out); each "
                "baseline measured right after the link in every round",
                "target_ratio": TARGET_ROUND_TRIP_RATIO,
                "vs_bare_echo": _round_trips(
                    round_trip, sorted(self.measured), bare_rounds["Echo"]
                ),
                "vs_bare_slotted": _round_trips(
                    round_trip, sorted(self.measured), bare_rounds["Slotted"]
                ),
                # floors for any protocol that reads its messages (answering at once, or from
                # an engine thread at the slot): not targets, bounds
                "vs_bare_read": _round_trips(
                    round_trip, sorted(self.measured), bare_rounds["Read"], target=False
                ),
                "vs_bare_slotted_read": _round_trips(
                    round_trip, sorted(self.measured), bare_rounds["SlottedRead"], target=False
                ),
                # how far above the echo a protocol can get at best, on the host, in this run
                "floors_over_echo": {
                    m: _floor_over_echo(bare_rounds[m], bare_rounds["Echo"]) for m in READING
                },
            },
            "warmup_samples": warmup,
            "observation_rate_hz": rate_hz,
            "chunk_interval_ms": self.interval_ms,
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


def _floor_over_echo(floor_rounds: list[list[float]], echo_rounds: list[list[float]]) -> float:
    """A baseline's round trip over the echo's: the median over rounds of the ratio of their
    medians (each round's two measured back to back)."""
    ratios = [np.median(f) / np.median(e) for f, e in zip(floor_rounds, echo_rounds, strict=True)]
    return round(float(np.median(ratios)), 3)


def _round_trips(
    link_ms: dict[int, float], seqs: list[int], bare_rounds, *, target: bool = True
) -> dict:
    """Per round, the link's observation -> first action reply against a bare stream's round
    trip of the same bytes; the median of the rounds' ratios (and, ``target``, whether it
    meets the target ratio)."""
    per_round = len(seqs) // len(bare_rounds)
    rounds = []
    for r, bare in enumerate(bare_rounds):
        mine = [link_ms[s] for s in seqs[r * per_round : (r + 1) * per_round] if s in link_ms]
        if mine and bare:
            link_med, bare_med = float(np.median(mine)), float(np.median(bare))
            rounds.append(
                {
                    "link_ms_median": round(link_med, 4),
                    "bare_ms_median": round(bare_med, 4),
                    "ratio": round(link_med / bare_med, 3),
                    "samples": [len(mine), len(bare)],
                }
            )
    if not rounds:
        raise RuntimeError("no round trips measured")
    ratio = float(np.median([r["ratio"] for r in rounds]))
    out = {
        "link_ms_median": round(float(np.median(list(link_ms.values()))), 4),
        "bare_ms_median": round(float(np.median([v for b in bare_rounds for v in b])), 4),
        "ratio_median_of_rounds": round(ratio, 3),
        "rounds": rounds,
    }
    if target:
        out["meets_target_ratio"] = ratio <= TARGET_ROUND_TRIP_RATIO
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="physis-bench link", description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--samples", type=int, default=300, help="observations measured")
    parser.add_argument("--warmup", type=int, default=30, help="observations not measured")
    parser.add_argument("--rate-hz", type=finite_float, default=30.0, help="observation rate")
    parser.add_argument(
        "--interval-ms", type=finite_float, default=20.0, help="chunk interval asked"
    )
    parser.add_argument(
        "--rounds", type=int, default=5, help="alternations of link and bare-stream samples"
    )
    parser.add_argument(
        "--breakdown",
        action="store_true",
        help="also report where the link's round trip goes, step by step (link_trace)",
    )
    parser.add_argument("--serve-echo", metavar="PORT_FILE", help=argparse.SUPPRESS)
    parser.add_argument("--serve-bare", metavar="PORT_FILE", help=argparse.SUPPRESS)
    parser.add_argument("--trace", metavar="OUT", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve_echo:
        if args.trace:
            link_trace.install_server(args.trace)
        return serve_echo(args.serve_echo)
    if args.serve_bare:
        return serve_bare(args.serve_bare, prediction_reply_bytes(), args.interval_ms)
    for name in ("samples", "rate_hz", "interval_ms", "rounds"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be > 0, got {getattr(args, name)}")
    result = run(
        args.samples,
        args.warmup,
        args.rate_hz,
        args.interval_ms,
        args.rounds,
        breakdown=args.breakdown,
    )
    if args.json:
        print(json.dumps(result))
    else:
        _print_human(result, breakdown=args.breakdown)
    return 0


def _print_human(result: dict, *, breakdown: bool) -> None:
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
    for name, rt in (
        ("bare gRPC echo", result["round_trip"]["vs_bare_echo"]),
        ("bare gRPC, slotted reply", result["round_trip"]["vs_bare_slotted"]),
        ("bare gRPC, joined and read", result["round_trip"]["vs_bare_read"]),
        ("bare gRPC, read, slotted reply", result["round_trip"]["vs_bare_slotted_read"]),
    ):
        verdict = ""
        if "meets_target_ratio" in rt:
            met = "met" if rt["meets_target_ratio"] else "NOT met"
            verdict = f"; target <= {TARGET_ROUND_TRIP_RATIO}: {met}"
        print(
            f"observation -> action reply: link {rt['link_ms_median']:.3f} ms, {name} "
            f"{rt['bare_ms_median']:.3f} ms, ratio {rt['ratio_median_of_rounds']:.2f} (median "
            f"of {len(rt['rounds'])} rounds{verdict})"
        )
    floors = result["round_trip"]["floors_over_echo"]
    print(
        f"the bare streams that read over the echo: answered at once {floors['Read']:.2f}, "
        f"from an engine thread at the slot {floors['SlottedRead']:.2f}"
    )
    if breakdown:
        b = result["breakdown"]
        print(f"where the link's round trip goes (medians over {b['pairs']} pairs, ms):")
        for name, ms in b["segments_ms_median"].items():
            print(f"  {name:42s} {ms:8.3f}")
        print(
            "processor us per call: as run in the link / back to back (warm) / alone in one "
            f"thread after a {PAUSE_S * 1e3:g} ms sleep"
        )
        for name, us in b["cpu_us_median_per_call"].items():
            print(
                f"  {name:42s} {us:8.1f} / {b['cpu_us_warm_back_to_back'][name]:.1f} / "
                f"{b[AFTER_PAUSE_KEY][name]:.1f}"
            )


if __name__ == "__main__":
    sys.exit(main())
