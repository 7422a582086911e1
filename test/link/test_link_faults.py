"""Faults inside the server, in process over a fake engine: each ends or degrades the stream
it belongs to, visibly (a counted drop, an error status, a log line, gRPC health), and the
other streams keep being served."""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from link_fake_engine import FakeEngine, served
from link_raw import RawStream, observation_bytes, open_stream
from link_server import server_info, wait_for

from physis_ros.link.proto_gen import physis_pb2 as pb
from physis_ros.link.proto_gen import physis_pb2_grpc as pb_grpc
from physis_ros.serve import session as session_module
from physis_ros.serve.frontend_config import FrontendConfig

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


@contextlib.contextmanager
def _serving(engine, config=None):
    """(engine loop, server handle, a channel to it) over ``engine``, in this process."""
    with (
        served(engine, config=config) as (loop, handle),
        grpc.insecure_channel(f"127.0.0.1:{handle.port}") as channel,
    ):
        yield loop, handle, channel


def _health(channel, metadata=()) -> int:
    stub = health_pb2_grpc.HealthStub(channel)
    request = health_pb2.HealthCheckRequest(service="physis.v1.Physis")
    return stub.Check(request, metadata=metadata, timeout=10).status


def _conditioned_on(stream: RawStream, seq: int) -> bool:
    return any(p.observation_seq == seq for p in list(stream.predictions))


def _still_served(stream: RawStream, seq: int) -> None:
    """A good observation on ``stream`` gets a prediction conditioned on it."""
    stream.send(observation_bytes(seq, stream.promise))
    wait_for(lambda: _conditioned_on(stream, seq), 30, what=f"a prediction on seq {seq}")
    assert stream.error is None


def test_a_fault_in_the_checks_is_a_counted_drop_and_the_stream_goes_on(monkeypatch, caplog):
    real = session_module.context_input
    calls = []

    def faulty(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("a bug the crafted message found")
        return real(*args, **kwargs)

    monkeypatch.setattr(session_module, "context_input", faulty)
    caplog.set_level(logging.WARNING, logger="physis_ros.serve.session")
    with _serving(FakeEngine(slots=2)) as (_loop, _handle, channel):
        stream = RawStream(channel, client_name="victim")
        try:
            stream.send(observation_bytes(1, stream.promise))
            wait_for(lambda: stream.drops().get("internal_error") == 1, 10, what="the drop")
            assert "a bug the crafted message found" in stream.counters.last_drop_detail
            _still_served(stream, 2)  # the reader thread lived on
        finally:
            stream.close()
    logged = [r for r in caplog.records if "internal_error" in r.getMessage()]
    assert len(logged) == 1 and logged[0].exc_info is not None  # with its traceback


def test_a_reader_that_fails_outside_the_checks_ends_its_stream_with_the_cause(monkeypatch, caplog):
    """What the per-message checks cannot catch (here: offer itself raising) must not leave
    a stream predicting on from its last observation: that stream ends (INTERNAL, with the
    cause, logged with its traceback); another stream and the health check are untouched."""
    real = session_module.Session.offer

    def offer(self, raw, received_ns):
        if self.client_name == "victim":
            raise MemoryError("a reader bug the checks never saw")
        return real(self, raw, received_ns)

    monkeypatch.setattr(session_module.Session, "offer", offer)
    caplog.set_level(logging.ERROR, logger="physis_ros.serve.frontend")
    with _serving(FakeEngine(slots=2)) as (_loop, _handle, channel):
        bystander = RawStream(channel, client_name="bystander")
        victim = RawStream(channel, client_name="victim")
        try:
            victim.send(observation_bytes(1, victim.promise))
            assert victim.wait_ended(30), "the stream whose reader failed never ended"
            assert victim.error.code() == grpc.StatusCode.INTERNAL
            assert "server stopped reading observations" in victim.error.details()
            assert "a reader bug the checks never saw" in victim.error.details()
            _still_served(bystander, 1)
            assert _health(channel) == SERVING
        finally:
            victim.close()
            bystander.close()
    logged = [r for r in caplog.records if "reading observations failed" in r.getMessage()]
    assert len(logged) == 1 and logged[0].exc_info is not None


def test_a_flood_of_bad_observations_is_counted_each_and_logged_once(caplog):
    caplog.set_level(logging.WARNING, logger="physis_ros.serve.session")
    with _serving(FakeEngine(slots=2)) as (_loop, _handle, channel):
        stream = RawStream(channel, client_name="flood")
        try:
            for _ in range(50):
                stream.send(observation_bytes(-1, stream.promise))
            wait_for(lambda: stream.drops().get("bad_seq") == 50, 20, what="50 drops")
            _still_served(stream, 7)
        finally:
            stream.close()
    logged = [r for r in caplog.records if "bad_seq" in r.getMessage()]
    assert len(logged) == 1, [r.getMessage() for r in logged]


def test_non_finite_model_output_is_never_published_and_ends_that_stream():
    engine = FakeEngine(slots=2)
    with _serving(engine) as (_loop, _handle, channel):
        bystander = RawStream(channel, client_name="bystander")
        victim_promise = open_stream(channel, client_name="victim")
        engine.non_finite_streams.add(victim_promise.stream_id)
        victim = RawStream(channel, stream_id=victim_promise.stream_id)
        victim.start_camera(victim_promise)  # chunks follow observed slots
        try:
            assert victim.wait_ended(30), "the stream of NaN chunks never ended"
            assert victim.error.code() == grpc.StatusCode.INTERNAL
            assert "NaN or inf" in victim.error.details()
            assert victim.n_predictions() == 0  # not one NaN chunk went out
            assert victim.drops().get("non_finite_output", 0) >= 1
            _still_served(bystander, 1)
            assert _health(channel) == SERVING  # one stream's fault: the server is fine
        finally:
            victim.close()
            bystander.close()


def test_a_fault_in_one_streams_engine_calls_ends_that_stream_alone():
    engine = FakeEngine(slots=2)
    with _serving(engine) as (loop, _handle, channel):
        bystander = RawStream(channel, client_name="bystander")
        victim_promise = open_stream(channel, client_name="victim")
        engine.raise_in_generate[victim_promise.stream_id] = RuntimeError("CUDA error: boom")
        victim = RawStream(channel, stream_id=victim_promise.stream_id)
        victim.start_camera(victim_promise)  # its first generate raises
        try:
            assert victim.wait_ended(30)
            assert victim.error.code() == grpc.StatusCode.INTERNAL
            assert "CUDA error: boom" in victim.error.details()
            _still_served(bystander, 1)
            assert loop.error == ""
            assert _health(channel) == SERVING
        finally:
            victim.close()
            bystander.close()


def test_engine_thread_fault_ends_every_stream_and_health_turns_not_serving():
    engine = FakeEngine(slots=3)
    with _serving(engine) as (loop, handle, channel):
        streams = [RawStream(channel, client_name=f"s{i}") for i in range(2)]
        try:
            for s in streams:
                s.start_camera(s.promise)  # chunks follow observed slots
                wait_for(s.n_predictions, 30, what="a first prediction")
            assert _health(channel) == SERVING
            engine.raise_in_poll = RuntimeError("device lost")
            for s in streams:
                assert s.wait_ended(30)
                assert s.error.code() == grpc.StatusCode.INTERNAL
                assert "device lost" in s.error.details()
            wait_for(lambda: _health(channel) == NOT_SERVING, 10, what="NOT_SERVING")
            info = server_info(f"127.0.0.1:{handle.port}")
            assert "device lost" in info.engine["error"]
            # A new stream is refused at once, not after the open timeout.
            with pytest.raises(grpc.RpcError) as err:
                open_stream(channel, client_name="late")
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "device lost" in err.value.details()
            assert "device lost" in loop.error
        finally:
            for s in streams:
                s.close()


def test_impaired_engine_turns_health_not_serving_while_other_streams_run():
    """A stream that failed with its rank: that stream ends, the engine says it is impaired
    (a rank is gone), health says NOT_SERVING, and streams on live ranks go on."""
    engine = FakeEngine(slots=3)
    with _serving(engine) as (_loop, _handle, channel):
        bystander = RawStream(channel, client_name="bystander")
        victim = RawStream(channel, client_name="victim")
        try:
            victim.start_camera(victim.promise)
            wait_for(victim.n_predictions, 30, what="a first prediction")
            engine.impaired = "rank 1 failed: silent for 5.0 s"
            engine.fail(victim.stream_id)
            assert victim.wait_ended(30)
            assert victim.error.code() == grpc.StatusCode.UNAVAILABLE
            wait_for(lambda: _health(channel) == NOT_SERVING, 10, what="NOT_SERVING")
            _still_served(bystander, 1)
        finally:
            victim.close()
            bystander.close()


def test_max_streams_holds_under_concurrent_opens():
    max_streams, attempts = 4, 24
    engine = FakeEngine(slots=100)
    engine.open_delay_s = 0.05  # every open waits in the engine: all of them overlap
    config = FrontendConfig(port=0, max_streams=max_streams, worker_threads=attempts + 8)
    with served(engine, config=config) as (_loop, handle):
        target = f"127.0.0.1:{handle.port}"
        with grpc.insecure_channel(target) as channel:

            def try_open(i: int) -> str:
                try:
                    open_stream(channel, client_name=f"c{i}")
                    return "OK"
                except grpc.RpcError as exc:
                    return exc.code().name

            with concurrent.futures.ThreadPoolExecutor(attempts) as pool:
                results = list(pool.map(try_open, range(attempts)))
            assert results.count("OK") == max_streams, results
            assert results.count("RESOURCE_EXHAUSTED") == attempts - max_streams
            info = server_info(target)
            assert info.open_streams == max_streams
            assert info.refusals["RESOURCE_EXHAUSTED"] == attempts - max_streams


def test_rejected_tokens_are_counted_logged_once_and_health_needs_no_token(caplog):
    caplog.set_level(logging.WARNING, logger="physis_ros.serve.auth")
    bearer = (("authorization", "Bearer s3cret"),)
    config = FrontendConfig(port=0, token="s3cret")
    with served(FakeEngine(slots=2), config=config) as (_loop, handle):
        target = f"127.0.0.1:{handle.port}"
        with grpc.insecure_channel(target) as channel:
            stub = pb_grpc.PhysisStub(channel)
            for metadata in [(), (("authorization", "Bearer wrong"),)] * 10:
                with pytest.raises(grpc.RpcError) as err:
                    stub.GetServerInfo(pb.ServerInfoRequest(), metadata=metadata, timeout=10)
                assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert _health(channel) == SERVING  # a probe carries no token
            info = server_info(target, metadata=bearer)
            assert info.refusals["UNAUTHENTICATED"] == 20
    logged = [r for r in caplog.records if "refused" in r.getMessage()]
    assert len(logged) == 1, [r.getMessage() for r in logged]
    assert "no bearer token" in logged[0].getMessage()
