"""``physis-bench link --breakdown``: where an observation -> action reply spends its time.

Wraps the link's own steps, on both sides, with stamps of the host's monotonic clock (shared
by the two processes) and of the calling thread's processor time, then pairs each
observation with the first reply conditioned on it:

    client: send_observation -> serialised -> (gRPC, wire, server's gRPC threads) ->
    server: reader has it -> parsed and checked ("received") ...the stream's slot...
            engine hands the chunk over -> writer thread has it -> serialised ->
            (gRPC, wire, client's gRPC threads) ->
    client: reply parsed -> application has it

Each wrapped step also reports its processor time per call, and the same code's processor
time when run back to back in one thread: on a shared host the link's threads wake cold
between messages, and the same Python runs many times slower than warm.
"""

from __future__ import annotations

import atexit
import functools
import json
import time
from pathlib import Path

import numpy as np

from physis_ros.bench.link_echo import ACTION_HA, IMAGE_HW, prediction_reply_bytes
from physis_ros.engine.api import ChunkOutput
from physis_ros.link.client import LinkClient, Observation
from physis_ros.link.wire import (
    StreamCounts,
    observation_from_proto,
    parse_client_message,
    parse_server_message,
    rgb_image,
    serialize_observation,
    serialize_prediction,
)
from physis_ros.serve import session
from physis_ros.serve.observations import check_observation, context_input

STAMPS: list[tuple[str, int, int, int]] = []
"""(step, key, monotonic ns at its end, processor ns it took)."""


def _wrap(owner, name: str, step: str, key) -> None:
    """``owner.name`` records ``step`` with ``key(args, result)`` at every call."""
    inner = getattr(owner, name)

    @functools.wraps(inner)
    def wrapped(*args, **kwargs):
        cpu0 = time.thread_time_ns()
        out = inner(*args, **kwargs)
        k = key(args, kwargs, out)
        if k is not None:
            STAMPS.append((step, k, time.perf_counter_ns(), time.thread_time_ns() - cpu0))
        return out

    setattr(owner, name, wrapped)


def install_client() -> None:
    _wrap(LinkClient, "send_observation", "c_serialised", lambda a, kw, r: a[1].seq)

    def reply_key(args, kwargs, out):
        msg = args[1]
        return msg.prediction.chunk_index if msg.WhichOneof("body") == "prediction" else None

    _wrap(LinkClient, "_on_server_message", "c_parsed", reply_key)


def install_server(out_path: str) -> None:
    """In the echo server's process: wrap, and write the stamps to ``out_path`` at exit."""
    original_offer = session.Session.offer

    def offer(self, raw, received_ns):
        # The reader's processor clock here, so that "checked" can report the whole parse
        # and check (both stamps are this thread's).
        STAMPS.append(("s_reader_got", -1, time.perf_counter_ns(), time.thread_time_ns()))
        return original_offer(self, raw, received_ns)

    session.Session.offer = offer
    original_check = session.context_input

    def context_input(obs, **kwargs):
        out = original_check(obs, **kwargs)
        STAMPS.append(("s_checked", obs.seq, time.perf_counter_ns(), time.thread_time_ns()))
        return out

    session.context_input = context_input
    _wrap(session.Session, "take", "s_handed_over", lambda a, kw, r: a[1].out.chunk)

    original = session.serialize_prediction

    def serialise(out, **kwargs):
        STAMPS.append(("s_writer_has_it", out.chunk, time.perf_counter_ns(), 0))
        return original(out, **kwargs)

    session.serialize_prediction = serialise
    _wrap(session, "serialize_prediction", "s_serialised", lambda a, kw, r: a[0].chunk)
    atexit.register(lambda: Path(out_path).write_text(json.dumps(STAMPS)))


def breakdown(client: list, server: list, first_reply: dict[int, int], skip: int) -> dict:
    """Median of each segment over the observations (after ``skip``) and their first
    replies (``first_reply``: observation seq -> chunk)."""

    def by(stamps, step):
        return {k: (t, cpu) for s, k, t, cpu in stamps if s == step}

    c_ser, c_par = by(client, "c_serialised"), by(client, "c_parsed")
    s_chk, s_hand = by(server, "s_checked"), by(server, "s_handed_over")
    s_has, s_ser = by(server, "s_writer_has_it"), by(server, "s_serialised")
    reader = sorted((t, cpu) for s, _, t, cpu in server if s == "s_reader_got")
    segments: dict[str, list[float]] = {}
    parse_cpu: list[float] = []
    for seq, chunk in first_reply.items():
        if seq < skip or seq not in c_ser or seq not in s_chk:
            continue
        if not all(chunk in d for d in (s_hand, s_has, s_ser, c_par)):
            continue
        got, cpu0 = max(((t, c) for t, c in reader if t <= s_chk[seq][0]), default=(None, 0))
        if got is None:
            continue
        parse_cpu.append(s_chk[seq][1] - cpu0)
        for name, ms in (
            ("client: serialise (caller's thread)", c_ser[seq][1] / 1e6),
            ("uplink: gRPC, wire, server reader wakes", (got - c_ser[seq][0]) / 1e6),
            ("server: parse and check", (s_chk[seq][0] - got) / 1e6),
            ("server: engine -> writer thread", (s_has[chunk][0] - s_hand[chunk][0]) / 1e6),
            ("server: serialise reply", (s_ser[chunk][0] - s_has[chunk][0]) / 1e6),
            ("downlink: gRPC, wire, client threads", (c_par[chunk][0] - s_ser[chunk][0]) / 1e6),
        ):
            segments.setdefault(name, []).append(ms)
    cpu = {
        "client serialise": [v[1] for v in c_ser.values()],
        "server parse+check": parse_cpu,
        "server serialise reply": [v[1] for v in s_ser.values()],
        "client parse reply": [v[1] for v in c_par.values()],
    }
    return {
        "pairs": len(next(iter(segments.values()), [])),
        "segments_ms_median": {k: round(float(np.median(v)), 4) for k, v in segments.items()},
        "cpu_us_median_per_call": {
            k: round(float(np.median(v)) / 1e3, 1) for k, v in cpu.items() if v
        },
    }


def step_cpu_us(repeats: int = 300, pause_s: float = 0.0) -> dict[str, float]:
    """The same four steps in this thread alone: processor us each. ``pause_s`` 0: back to
    back (caches warm); else a sleep that long before each call, as the link's threads idle
    between messages, which tells the host's cost of a pause from the link's own."""
    image = rgb_image(np.zeros((*IMAGE_HW, 3), np.uint8))
    obs = Observation(seq=0, capture_stamp_ns=1, image=image)
    raw = serialize_observation(obs, send_stamp_ns=1)
    out = ChunkOutput(
        stream_id=1,
        chunk=1,
        frames=None,
        actions=np.ones(ACTION_HA, np.float32),
        entered_s=1.0,
        left_s=1.0,
        decoded_s=1.0,
    )
    reply = prediction_reply_bytes()
    client = LinkClient("127.0.0.1:1", on_prediction=lambda p: None)

    def parse_and_check():  # what the reader does to the "received" stamp
        msg, pixels = parse_client_message(raw)
        observation = observation_from_proto(msg.observation, image_data=pixels)
        check_observation(observation)
        context_input(
            observation,
            send_stamp_ns=1,
            height=IMAGE_HW[0],
            width=IMAGE_HW[1],
            action_horizon=ACTION_HA[0],
            action_dim=ACTION_HA[1],
        )

    steps = {
        "client serialise": lambda: serialize_observation(obs, send_stamp_ns=1),
        "server parse+check": parse_and_check,
        "server serialise reply": lambda: serialize_prediction(
            out,
            stream_id=1,
            anchor=None,
            action_timing=None,
            first_frame_seq=-1,
            counts=StreamCounts(),
            sent_ns=1,
        ),
        "client parse reply": lambda: client._on_server_message(*parse_server_message(reply)),
    }
    result = {}
    for name, step in steps.items():
        samples = []
        for _ in range(repeats):
            if pause_s:
                time.sleep(pause_s)
            t0 = time.thread_time_ns()
            step()
            samples.append(time.thread_time_ns() - t0)
        result[name] = round(float(np.median(samples[repeats // 5 :])) / 1e3, 1)
    return result
