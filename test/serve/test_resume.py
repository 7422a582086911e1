"""Resumable streams in the real server (physis-serve, tiny model, real gRPC on 127.0.0.1): a
stream whose Stream call is cut is held detached for the resume grace and re-attached with
its resume token (same stream, its slots go on past the gap); a wrong or missing token is
refused and leaves it resumable; after the grace it is gone and counted expired; a new stream
that needs its room gets it; a LinkClient whose connection is dropped resumes by itself.

One server for the module, with front-end max_streams 1: each test ends its streams (or
leaves one detached, which the next open takes the room of)."""

from __future__ import annotations

import logging
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import numpy as np
import pytest
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "link"))
from link_raw import RawStream, observation_bytes
from link_server import REPO_ROOT, child_env, running_server, server_info, wait_for

from physis_ros.bench.link_cut import LinkCutProxy
from physis_ros.link.client import LinkClient, Observation
from physis_ros.link.proto_gen import physis_pb2 as pb
from physis_ros.link.proto_gen import physis_pb2_grpc as pb_grpc
from physis_ros.link.wire import PROTOCOL_VERSION, RESUME_TOKEN_METADATA_KEY, rgb_image
from physis_ros.link.wire_promise import resume_from_reply
from physis_ros.serve.frontend_config import FrontendConfig

GRACE_S = 8.0
"""The server's resume grace: long enough for a cut, a look and a resume on a loaded host."""


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("resume")
    cfg = yaml.safe_load((REPO_ROOT / "config" / "serve.yaml").read_text())
    cfg["frontend"]["max_streams"] = 1
    (tmp / "serve.yaml").write_text(yaml.safe_dump(cfg))
    with running_server(
        tmp, "--config", str(tmp / "serve.yaml"), "--resume-grace-s", str(GRACE_S)
    ) as srv:
        yield srv
        assert srv.proc.poll() is None, f"server died:\n{srv.log()}"


@pytest.fixture(scope="module")
def channel(server):
    with grpc.insecure_channel(server.target) as ch:
        yield ch


class Camera:
    """Frames at a steady rate to whichever Stream call is current (none while cut): its seq
    runs on through a cut, as a robot's camera does."""

    def __init__(self, promise: pb.StreamPromise, period_s: float = 0.05) -> None:
        self.promise = promise
        self.seq = 0
        self.target: RawStream | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(period_s,), daemon=True)
        self._thread.start()

    def _run(self, period_s: float) -> None:
        while not self._stop.wait(period_s):
            self.seq += 1
            target = self.target
            if target is not None:
                target.send(observation_bytes(self.seq, self.promise))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)


def open_resumable(channel) -> pb.OpenStreamReply:
    spec = pb.StreamSpec(protocol_version=PROTOCOL_VERSION, client_name="resume", resumable=True)
    return pb_grpc.PhysisStub(channel).OpenStream(spec, timeout=30)


def attach(channel, stream_id: int, token: str | None) -> RawStream:
    metadata = () if token is None else ((RESUME_TOKEN_METADATA_KEY, token),)
    return RawStream(channel, metadata=metadata, stream_id=stream_id)


def close_stream(channel, stream_id: int) -> bool:
    request = pb.CloseStreamRequest(stream_id=stream_id)
    return pb_grpc.PhysisStub(channel).CloseStream(request, timeout=10).closed


def stream_info(target: str, stream_id: int) -> pb.StreamInfo | None:
    return next((s for s in server_info(target).streams if s.stream_id == stream_id), None)


def attached(target: str, stream_id: int) -> bool:
    info = stream_info(target, stream_id)
    return info is not None and info.attached


def detached(target: str, stream_id: int) -> pb.StreamInfo | None:
    info = stream_info(target, stream_id)
    return info if info is not None and info.detached_s > 0 else None


def cut(stream: RawStream) -> None:
    """The call ends under the server's feet, as when the client's connection drops."""
    stream.close()


def refused(stream: RawStream, timeout_s: float = 30.0) -> grpc.StatusCode:
    assert stream.wait_ended(timeout_s), "the call was not ended"
    assert stream.error is not None, "the call ended without an error"
    return stream.error.code()


def test_a_cut_stream_resumes_with_its_token_and_goes_on_past_the_gap(server, channel):
    reply = open_resumable(channel)
    ticket = resume_from_reply(reply)
    assert ticket is not None and ticket.grace_s == GRACE_S
    assert len(ticket.token) >= 32  # >= 128 random bits, URL-safe base64
    sid = ticket.stream_id
    camera = Camera(reply.promise)
    first = attach(channel, sid, None)  # the first call needs no token
    camera.target = first
    try:
        wait_for(lambda: first.n_predictions() >= 5, 60, what="predictions before the cut")
        camera.target = None
        cut(first)
        held = wait_for(lambda: detached(server.target, sid), 30, what="the stream detached")
        assert not held.attached
        engine = server_info(server.target).engine
        assert engine["open_streams"] == "1"  # the engine keeps it: admission counts it
        before = list(first.predictions)
        received_before = held.counters.observations_received
        resumed = attach(channel, sid, ticket.token)
        first_seq_after = camera.seq + 1  # (chunks anchored on slots before the cut may come)
        camera.target = resumed
        wait_for(
            lambda: any(p.observation_seq >= first_seq_after for p in resumed.predictions),
            60,
            what=f"predictions conditioned on frames after the resume ({resumed.error})",
        )
        after = [p for p in resumed.predictions if p.observation_seq >= first_seq_after]
        assert {p.stream_id for p in after} == {sid}
        # the same timeline: slots go on past the gap, and the counters go on
        assert min(p.anchor_slot for p in after) > max(p.anchor_slot for p in before)
        assert max(p.chunk_index for p in after) > max(p.chunk_index for p in before)
        counters = after[-1].counters
        assert counters.observations_received > received_before
        # the frames of the cut: filled, the gap skipped, or (a loaded host) the slot after
        # it dropped because the engine had not generated it yet
        drops = dict(counters.drops)
        missed = counters.filled_frames + drops.get("seq_gap", 0)
        missed += drops.get("server_behind", 0)
        assert missed > 0, counters
        info = server_info(server.target)
        mine = stream_info(server.target, sid)
        assert mine.attached and mine.detached_s == 0 and mine.resumes == 1
        assert info.streams_resumed >= 1
        assert f"stream {sid} resumed after" in server.log()
    finally:
        camera.stop()
        close_stream(channel, sid)


def test_a_wrong_or_missing_token_is_refused_and_the_stream_stays_resumable(server, channel):
    reply = open_resumable(channel)
    ticket = resume_from_reply(reply)
    sid = ticket.stream_id
    first = attach(channel, sid, None)
    try:
        wait_for(lambda: attached(server.target, sid), 30, what="the call attached")
        cut(first)
        wait_for(lambda: detached(server.target, sid), 30, what="the stream detached")
        denied_before = server_info(server.target).refusals["PERMISSION_DENIED"]
        wrong = "x" * len(ticket.token)
        assert refused(attach(channel, sid, wrong)) == grpc.StatusCode.PERMISSION_DENIED
        assert refused(attach(channel, sid, None)) == grpc.StatusCode.PERMISSION_DENIED
        assert server_info(server.target).refusals["PERMISSION_DENIED"] == denied_before + 2
        assert stream_info(server.target, sid) is not None  # still held
        resumed = attach(channel, sid, ticket.token)
        wait_for(lambda: attached(server.target, sid), 30, what=f"resumed ({resumed.error})")
        assert not resumed.wait_ended(0)
        assert stream_info(server.target, sid).resumes == 1
    finally:
        close_stream(channel, sid)


def test_a_resume_takes_the_stream_over_from_a_call_the_server_still_holds(server, channel):
    """A link that died without the server noticing (no FIN: a cable, a NAT) leaves the old
    call open on the server: the client's resume takes the stream over, the old call ends."""
    ticket = resume_from_reply(open_resumable(channel))
    sid = ticket.stream_id
    old = attach(channel, sid, None)
    try:
        wait_for(lambda: attached(server.target, sid), 30, what="the call attached")
        assert refused(attach(channel, sid, None)) == grpc.StatusCode.ALREADY_EXISTS
        new = attach(channel, sid, ticket.token)
        assert refused(old) == grpc.StatusCode.ABORTED
        wait_for(lambda: stream_info(server.target, sid).resumes == 1, 30, what="resumed")
        assert not new.wait_ended(0) and attached(server.target, sid)
    finally:
        close_stream(channel, sid)


def test_after_the_grace_the_stream_is_gone_and_counted_expired(server, channel):
    reply = open_resumable(channel)
    ticket = resume_from_reply(reply)
    sid = ticket.stream_id
    expired_before = server_info(server.target).streams_expired
    first = attach(channel, sid, None)
    wait_for(lambda: attached(server.target, sid), 30, what="the call attached")
    cut(first)
    info = wait_for(
        lambda: (i := server_info(server.target)).streams_expired > expired_before and i,
        GRACE_S + 60,
        what="the stream expired",
    )
    assert sid not in {s.stream_id for s in info.streams}
    wait_for(
        lambda: server_info(server.target).engine["open_streams"] == "0",
        30,
        what="its engine stream closed",
    )
    assert refused(attach(channel, sid, ticket.token)) == grpc.StatusCode.NOT_FOUND
    assert f"stream {sid} expired" in server.log()


def test_a_detached_stream_is_given_back_when_a_new_stream_needs_its_room(server, channel):
    old = resume_from_reply(open_resumable(channel))
    first = attach(channel, old.stream_id, None)
    wait_for(lambda: attached(server.target, old.stream_id), 30, what="the call attached")
    cut(first)
    wait_for(lambda: detached(server.target, old.stream_id), 30, what="the stream detached")
    reclaimed_before = server_info(server.target).streams_reclaimed
    new = resume_from_reply(open_resumable(channel))  # max_streams 1: the detached one goes
    try:
        info = server_info(server.target)
        assert info.streams_reclaimed == reclaimed_before + 1
        assert [s.stream_id for s in info.streams] == [new.stream_id]
        assert refused(attach(channel, old.stream_id, old.token)) == grpc.StatusCode.NOT_FOUND
        assert f"stream {old.stream_id} given back" in server.log()
    finally:
        close_stream(channel, new.stream_id)


def test_a_link_client_resumes_its_stream_after_the_connection_drops(server, caplog):
    caplog.set_level(logging.INFO, logger="physis_ros.link.reconnect")
    proxy = LinkCutProxy(server.target)
    client = LinkClient(
        proxy.address,
        client_name="blip",
        connect_timeout_s=10,
        reconnect_backoff_s=(0.05, 0.5),
    )
    stop = threading.Event()

    def feed() -> None:
        seq = 0
        while not stop.wait(0.05):
            promise = client.stats().promise
            if promise is not None:
                frame = np.zeros((promise.image_height, promise.image_width, 3), np.uint8)
                obs = Observation(seq=seq, capture_stamp_ns=time.time_ns(), image=rgb_image(frame))
                client.send_observation(obs)
                seq += 1

    feeder = threading.Thread(target=feed, daemon=True)
    client.start()
    feeder.start()
    try:
        before = wait_for(lambda: client.get_prediction(0.1), 60, what="first prediction")
        proxy.cut()
        wait_for(lambda: client.stats().state != "streaming", 30, what="the client seeing the cut")
        time.sleep(1.0)  # the link stays down a while
        proxy.restore()
        wait_for(lambda: client.stats().resumes == 1, 60, what=f"resumed ({client.stats()})")
        while client.get_prediction(0) is not None:  # what arrived before the cut
            pass
        after = wait_for(lambda: client.get_prediction(0.1), 60, what="a prediction after")
        assert after.stream_id == before.stream_id
        assert after.chunk_index > before.chunk_index
        stats = client.stats()
        assert stats.connections == 2 and stats.state == "streaming"
        resumed_lines = [r for r in caplog.records if "resumed stream" in r.getMessage()]
        assert len(resumed_lines) == 1
        assert f"resumed stream {before.stream_id} after" in resumed_lines[0].getMessage()
        # the client's streaming connections are counted exactly above (2: the first, the
        # resume); the proxy forwards every TCP connection once the link is back, an attempt
        # the client gave up on as not ready in time (a loaded host) among them
        assert proxy.connections >= 2
    finally:
        stop.set()
        feeder.join(5)
        client.close()
        proxy.close()
    info = wait_for(lambda: (i := server_info(server.target)).open_streams == 0 and i, 30)
    assert info.streams_resumed >= 1


@pytest.mark.parametrize("value", [-1.0, float("nan"), float("inf")])
def test_resume_grace_must_be_finite_and_not_negative(value):
    with pytest.raises(ValueError, match="resume_grace_s"):
        FrontendConfig(resume_grace_s=value)


def test_a_negative_resume_grace_flag_is_refused_by_name():
    proc = subprocess.run(
        [sys.executable, "-m", "physis_ros.serve.main", "--port", "0", "--resume-grace-s", "-1"],
        check=False,
        cwd=REPO_ROOT,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert "resume_grace_s must be a finite number >= 0" in proc.stderr
