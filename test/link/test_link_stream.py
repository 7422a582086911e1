"""A real physis-serve (child process, ephemeral 127.0.0.1 port): a stream end to end, and
every kind of bad input, while a bystander stream keeps running untouched."""

from __future__ import annotations

import io
import itertools
import struct
import time
import zlib

import grpc
import numpy as np
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc
from link_raw import RawStream, observation_bytes, open_stream
from link_server import REPO_ROOT, running_server, server_info, wait_for
from PIL import Image, PngImagePlugin

from physis_ros.link.client import LinkClient, Observation
from physis_ros.link.encoding import array_to_tensor
from physis_ros.link.proto_gen import physis_pb2 as pb
from physis_ros.link.proto_gen import physis_pb2_grpc as pb_grpc
from physis_ros.link.wire import PROTOCOL_VERSION, STREAM_ID_METADATA_KEY, rgb_image

MAX_OBSERVATION_BYTES = 64 * 1024
MAX_MESSAGE_BYTES = 256 * 1024
MAX_STREAMS = 3


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("link_stream")
    cfg = yaml.safe_load((REPO_ROOT / "config" / "serve.yaml").read_text())
    cfg["frontend"].update(
        max_observation_bytes=MAX_OBSERVATION_BYTES,
        max_message_bytes=MAX_MESSAGE_BYTES,
        max_streams=MAX_STREAMS,
    )
    (tmp / "serve.yaml").write_text(yaml.safe_dump(cfg))
    with running_server(tmp, "--config", str(tmp / "serve.yaml")) as srv:
        yield srv
        assert srv.proc.poll() is None, f"server died:\n{srv.log()}"


@pytest.fixture(scope="module")
def channel(server):
    with grpc.insecure_channel(server.target) as ch:
        yield ch


def image_for(promise, value: int) -> np.ndarray:
    return np.full((promise.image_height, promise.image_width, 3), value, np.uint8)


def test_stream_end_to_end(server):
    client = LinkClient(server.target, client_name="e2e", connect_timeout_s=10)
    client.start()
    try:
        wait_for(lambda: client.stats().state == "streaming", 20, what="streaming")
        promise = client.stats().promise
        assert promise.image_height > 0 and promise.steps > 0 and promise.blocks > 0
        stamps: dict[int, int] = {}
        predictions = []
        seq = 0
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            stamps[seq] = time.time_ns()
            client.send_observation(
                Observation(
                    seq=seq,
                    capture_stamp_ns=stamps[seq],
                    image=rgb_image(image_for(promise, (seq * 10) % 256)),
                    wrench=np.arange(6, dtype=np.float32),
                )
            )
            seq += 1
            p = client.get_prediction(max(promise.expected_interval_ms, 20) / 1000)
            if p is not None:
                predictions.append(p)
            if sum(p.observation_seq >= 0 for p in predictions) >= 4:
                break
        conditioned = [p for p in predictions if p.observation_seq >= 0]
        assert len(conditioned) >= 4, f"{len(predictions)} predictions, none conditioned"
        chunks = [p.chunk_index for p in predictions]
        assert chunks == sorted(set(chunks)), "chunks out of order or repeated"
        seqs = [p.observation_seq for p in conditioned]
        assert seqs == sorted(seqs)
        for p in predictions:
            assert p.frames is not None or p.actions is not None
            if p.frames is not None:
                assert p.frames.dtype == np.uint8
                assert p.frames.shape[1:] == (promise.image_height, promise.image_width, 3)
            if p.actions is not None:
                assert p.actions.dtype == np.float32
                assert p.actions.shape == (promise.action_horizon, promise.action_dim)
        for p in conditioned:
            assert p.observation_stamp_ns == stamps[p.observation_seq]
            t = p.server_times_ns
            order = [t[k] for k in ("received", "queued", "entered", "left", "decoded", "sent")]
            assert all(v > 0 for v in order), t
            assert order == sorted(order), f"server hops out of order: {t}"
            assert p.received_ns >= p.observation_stamp_ns
        stats = client.stats()
        # Same host, same wall clock: the estimate must find ~0 within its own uncertainty.
        assert stats.clock_offset_ms is not None
        assert abs(stats.clock_offset_ms) <= stats.clock_offset_uncertainty_ms + 1.0, stats
        last = conditioned[-1]
        for hop in ("uplink", "server_queue", "pipeline", "downlink", "capture_to_received"):
            assert hop in last.hop_ms, last.hop_ms
        assert last.hop_ms["capture_to_received"] >= last.hop_ms["pipeline"]
        info = server_info(server.target)
        (mine,) = [s for s in info.streams if s.client_name == "e2e"]
        assert mine.attached and mine.chunks_out >= len(predictions)
        assert mine.achieved_interval_ms > 0
        assert mine.counters.observations_used >= 1
        assert info.model == promise.model and info.steps == promise.steps
        assert info.blocks == promise.blocks
        assert info.placement, "server info names no placement"
        assert info.engine["open_streams"] == str(info.open_streams)
    finally:
        client.close()
    assert client.stats().state == "disconnected"
    wait_for(
        lambda: not any(s.client_name == "e2e" for s in server_info(server.target).streams),
        10,
        what="stream closed on the server",
    )


def test_previews_arrive_before_their_chunk(server):
    """A client that asks for previews gets, before each chunk, its x0 estimate after every
    denoising step but the last (decoded frames of the chunk's shape); one that did not
    gets none."""
    got: dict[str, list] = {"with": [], "without": []}
    clients = {
        name: LinkClient(
            server.target,
            client_name=f"previews-{name}",
            connect_timeout_s=10,
            previews=name == "with",
            prediction_queue_size=1024,
        )
        for name in got
    }
    try:
        for client in clients.values():
            client.start()
        for client in clients.values():
            wait_for(lambda c=client: c.stats().state == "streaming", 20, what="streaming")
        promise = clients["with"].stats().promise
        K = promise.steps
        seq = 0
        deadline = time.monotonic() + 60
        while sum(not p.preview_steps for p in got["with"]) < 4 and time.monotonic() < deadline:
            for client in clients.values():
                client.send_observation(
                    Observation(
                        seq=seq,
                        capture_stamp_ns=time.time_ns(),
                        image=rgb_image(image_for(promise, (seq * 10) % 256)),
                    )
                )
            seq += 1
            time.sleep(max(promise.expected_interval_ms, 20) / 1000)
            for name, client in clients.items():
                while (p := client.get_prediction(0.0)) is not None:
                    got[name].append(p)
    finally:
        for client in clients.values():
            client.close()
    assert not any(p.preview_steps for p in got["without"])
    order = [(p.chunk_index, p.preview_steps or K) for p in got["with"]]
    finals = [c for c, k in order if k == K]
    assert len(finals) >= 4, order
    for c in finals[1:]:  # (the first chunk's previews may predate the attach)
        assert [k for cc, k in order if cc == c] == list(range(1, K + 1)), (c, order)
    for p in got["with"]:
        assert p.frames is not None and p.frames.dtype == np.uint8
        assert p.frames.shape[1:] == (promise.image_height, promise.image_width, 3)


def test_a_stream_with_rollouts_gets_one_from_every_observation(server, channel):
    """Horizon 3 with rollouts: every observed slot a gets slots a+1..a+3 generated from it,
    in that order, each saying its anchor and horizon. This server's model is a world-action
    model: its streams get no rollouts unless they ask (world models: test_frontend_units)."""
    stream = RawStream(
        channel, client_name="rollouts", horizon=3, rollouts=pb.StreamSpec.ROLLOUTS_ON
    )
    default = RawStream(channel, client_name="default", horizon=3)
    try:
        assert stream.promise.rollouts and stream.promise.horizon == 3
        assert stream.promise.action_mode == "predict" and not default.promise.rollouts
        frames = max(stream.promise.chunk_frames, 1)
        seq = 0
        for slot in range(4):
            for _ in range(frames):
                seq += 1
                stream.send(observation_bytes(seq, stream.promise, value=10 * seq))
            wait_for(
                lambda a=slot: (
                    {p.horizon for p in list(stream.predictions) if p.anchor_slot == a} == {1, 2, 3}
                ),
                60,
                what=f"the rollout anchored on slot {slot}",
            )
        preds = [p for p in list(stream.predictions) if not p.preview_steps]
        assert [(p.anchor_slot, p.horizon) for p in preds] == [
            (a, j) for a in range(4) for j in (1, 2, 3)
        ]
        assert all(p.chunk_index == p.anchor_slot + p.horizon for p in preds)
        assert not stream.drops()
    finally:
        stream.close()
        default.close()


@pytest.fixture(scope="module")
def bystander(server):
    """A well-behaved stream that runs through all the bad-input tests."""
    client = LinkClient(server.target, client_name="bystander", connect_timeout_s=10)
    client.start()
    wait_for(lambda: client.stats().state == "streaming", 20, what="bystander streaming")
    yield client
    stats = client.stats()
    client.close()
    server_drops = {k: v for k, v in stats.drops.items() if k.startswith("server:")}
    assert not server_drops, f"bad input on other streams touched the bystander: {stats.drops}"
    assert stats.predictions_received > 0
    assert stats.connections == 1, "the bystander's stream was interrupted"


_BYSTANDER_SEQ = itertools.count(1)


def _feed_bystander(client: LinkClient) -> None:
    """One good observation; and take what arrived, as a real robot would."""
    promise = client.stats().promise
    client.send_observation(
        Observation(
            seq=next(_BYSTANDER_SEQ),
            capture_stamp_ns=time.time_ns(),
            image=rgb_image(image_for(promise, 50)),
        )
    )
    while client.get_prediction(0) is not None:
        pass


def _jpeg(h: int, w: int) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.zeros((h, w, 3), np.uint8)).save(buf, format="JPEG")
    return buf.getvalue()


def _png(h: int, w: int, **save) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.zeros((h, w, 3), np.uint8)).save(buf, format="PNG", **save)
    return buf.getvalue()


def _png_text_bomb(h: int, w: int) -> bytes:
    """A right-sized PNG whose zTXt chunk inflates to 20 MB (its file is ~20 KB)."""
    info = PngImagePlugin.PngInfo()
    info.add_text("comment", "a" * (20 * 1024 * 1024), zip=True)
    return _png(h, w, pnginfo=info)


def _png_claiming(h: int, w: int, claimed: tuple[int, int]) -> bytes:
    """A PNG whose header (IHDR, valid CRC) claims ``claimed`` (height, width) pixels."""
    data = bytearray(_png(h, w))
    data[16:24] = struct.pack(">II", claimed[1], claimed[0])
    data[29:33] = struct.pack(">I", zlib.crc32(bytes(data[12:29])))
    return bytes(data)


def _bad_cases(promise):
    h, w = promise.image_height, promise.image_width
    nan_wrench = pb.Tensor(
        dtype="float32", shape=[6], data=np.array([0, 0, np.nan, 0, 0, 0], np.float32).tobytes()
    )
    inf_action = pb.Tensor(
        dtype="float32",
        shape=[promise.action_dim or 1],
        data=np.full(promise.action_dim or 1, np.inf, np.float32).tobytes(),
    )
    short_tensor = pb.Tensor(dtype="float32", shape=[6], data=b"\0" * 20)
    odd_dtype = pb.Tensor(dtype="complex64", shape=[6], data=b"\0" * 48)
    bad_action = pb.Tensor(dtype="float32", shape=[3, 5], data=b"\0" * 60)
    return {
        "malformed": [b"\xff\xff\xff\xff garbage"],
        "protocol_version": [observation_bytes(1, promise, version=99)],
        "image_size": [
            observation_bytes(
                1,
                promise,
                image=pb.CameraImage(
                    encoding="rgb8",
                    height=h // 2,
                    width=w // 2,
                    step=w // 2 * 3,
                    data=b"\0" * (h // 2 * w // 2 * 3),
                ),
            )
        ],
        "image_encoding": [
            observation_bytes(
                1,
                promise,
                image=pb.CameraImage(
                    encoding="yuv422", height=h, width=w, step=w * 2, data=b"\0" * (h * w * 2)
                ),
            )
        ],
        "image_layout": [
            observation_bytes(
                1,
                promise,
                image=pb.CameraImage(
                    encoding="rgb8", height=h, width=w, step=w * 3, data=b"\0" * 10
                ),
            )
        ],
        "image_decode": [
            observation_bytes(
                1,
                promise,
                image=pb.CameraImage(encoding="jpeg", data=b"\xff\xd8\xff not really a jpeg"),
            )
        ],
        "jpeg_size": [
            observation_bytes(
                1, promise, image=pb.CameraImage(encoding="jpeg", data=_jpeg(h + 8, w))
            )
        ],
        "non_finite": [
            observation_bytes(1, promise, wrench=nan_wrench),
            observation_bytes(2, promise, action=inf_action),
        ],
        "bad_tensor": [
            observation_bytes(1, promise, wrench=short_tensor),
            observation_bytes(2, promise, wrench=odd_dtype),
        ],
        "action_shape": [observation_bytes(1, promise, action=bad_action)],
        "no_image": [observation_bytes(1, promise, clear=["image"])],
        "oversized": [
            observation_bytes(
                1,
                promise,
                image=pb.CameraImage(
                    encoding="rgb8",
                    height=h,
                    width=w,
                    step=w * 3,
                    data=b"\0" * (MAX_OBSERVATION_BYTES + 100),
                ),
            )
        ],
        # Crafted shapes whose element count wraps int64 to the bytes present (0).
        "shape_wraps": [
            observation_bytes(1, promise, wrench=pb.Tensor(dtype="float32", shape=[2**32, 2**32])),
            observation_bytes(
                2, promise, action=pb.Tensor(dtype="float64", shape=[2**31, 2**31, 4, 1])
            ),
        ],
        "png_text_bomb": [
            observation_bytes(
                1, promise, image=pb.CameraImage(encoding="png", data=_png_text_bomb(h, w))
            )
        ],
        "png_pixel_bomb": [
            observation_bytes(
                1,
                promise,
                image=pb.CameraImage(encoding="png", data=_png_claiming(h, w, (100_000, 100_000))),
            )
        ],
        "raw_pixel_bomb": [
            observation_bytes(
                1,
                promise,
                image=pb.CameraImage(
                    encoding="rgb8", height=2**31, width=2**31, step=2**32 - 1, data=b"\0" * 12
                ),
            )
        ],
        "bad_seq": [observation_bytes(-5, promise)],
        "bad_stamp": [
            observation_bytes(1, promise, capture_stamp_ns=-1),
            observation_bytes(2, promise, send_stamp_ns=2**63 - 1),
        ],
        "duplicate_seq": [observation_bytes(5, promise), observation_bytes(5, promise)],
        "out_of_order_seq": [observation_bytes(5, promise), observation_bytes(3, promise)],
    }


EXPECTED_REASON = {
    "jpeg_size": "image_size",
    "shape_wraps": "bad_tensor",
    "png_text_bomb": "image_decode",
    "png_pixel_bomb": "image_size",
    "raw_pixel_bomb": "image_size",
}
CASES = [
    "malformed",
    "protocol_version",
    "image_size",
    "image_encoding",
    "image_layout",
    "image_decode",
    "jpeg_size",
    "non_finite",
    "bad_tensor",
    "action_shape",
    "no_image",
    "oversized",
    "shape_wraps",
    "png_text_bomb",
    "png_pixel_bomb",
    "raw_pixel_bomb",
    "bad_seq",
    "bad_stamp",
    "duplicate_seq",
    "out_of_order_seq",
]
EXPECTED_COUNT = {"non_finite": 2, "bad_tensor": 2, "shape_wraps": 2, "bad_stamp": 2}


@pytest.mark.parametrize("case", CASES)
def test_bad_observation_is_dropped_counted_and_reported(case, server, channel, bystander):
    _feed_bystander(bystander)
    stream = RawStream(channel, client_name=f"bad-{case}")
    try:
        if case == "action_shape" and stream.promise.action_dim == 0:
            pytest.skip("model takes no actions")
        for raw in _bad_cases(stream.promise)[case]:
            stream.send(raw)
        reason = EXPECTED_REASON.get(case, case)
        want = EXPECTED_COUNT.get(case, 1)
        wait_for(
            lambda: stream.drops().get(reason, 0) >= want,
            10,
            what=f"drop {reason} reported (got {stream.drops()})",
        )
        assert stream.drops()[reason] == want
        assert reason in stream.counters.last_drop_detail
        # The stream lives on: good observations after the bad one are used (one slot's
        # frames: the slot is observed once its last frame came).
        frames = max(stream.promise.chunk_frames, 1)
        for seq in range(10_000, 10_000 + frames):
            stream.send(observation_bytes(seq, stream.promise))
        wait_for(
            lambda: any(p.observation_seq == 10_000 + frames - 1 for p in list(stream.predictions)),
            30,
            what="a prediction conditioned on the good observations after the bad one",
        )
        assert stream.error is None
        assert stream.drops().get("internal_error", 0) == 0
        _feed_bystander(bystander)
    finally:
        stream.close()


def test_every_frame_of_a_fast_client_enters_its_time_slot(server, channel):
    """40 frames back to back, far faster than any interval: frame n is in slot n // F, each
    slot's observation enters the stream, and predictions say their anchor and horizon."""
    stream = RawStream(channel, client_name="fast")
    try:
        frames = max(stream.promise.chunk_frames, 1)
        for seq in range(1, 41):
            stream.send(observation_bytes(seq, stream.promise, value=seq))
        last_slot = 40 // frames - 1
        wait_for(
            lambda: any(p.anchor_slot == last_slot for p in list(stream.predictions)),
            30,
            what="a prediction anchored on the last slot",
        )
        # a server that cannot keep up with a burst skips generation (counted), never frames
        assert set(stream.drops()) <= {"server_behind"}
        assert stream.counters.observed_chunks == 40 // frames
        assert stream.counters.observations_used == 40 // frames
        assert stream.counters.filled_frames == 0
        preds = list(stream.predictions)
        anchors = [p.anchor_slot for p in preds]
        assert anchors == sorted(anchors) and anchors[-1] == last_slot
        for p in preds:
            assert p.horizon == p.chunk_index - p.anchor_slot
            assert 1 <= p.horizon <= stream.promise.horizon
            assert p.observation_seq == 1 + (p.anchor_slot + 1) * frames - 1
            assert p.first_frame_seq == 1 + p.chunk_index * frames
    finally:
        stream.close()


def test_message_over_grpc_limit_ends_only_that_call(server, channel, bystander):
    stream = RawStream(channel, client_name="huge")
    promise = stream.promise
    before = bystander.stats().predictions_received
    stream.send(
        observation_bytes(
            1,
            promise,
            image=pb.CameraImage(
                encoding="rgb8",
                height=promise.image_height,
                width=promise.image_width,
                step=promise.image_width * 3,
                data=b"\0" * (MAX_MESSAGE_BYTES + 1000),
            ),
        )
    )
    assert stream.wait_ended(10)
    assert stream.error is not None
    assert stream.error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    stream.close()
    # predictions come for observed slots: the bystander goes on sending frames
    wait_for(
        lambda: _feed_bystander(bystander) or bystander.stats().predictions_received > before + 1,
        20,
        what="bystander still receiving",
    )
    assert server.proc.poll() is None


def test_unknown_and_missing_stream_ids(server, channel):
    stub = pb_grpc.PhysisStub(channel)
    unknown = RawStream(channel, stream_id=987654321)
    assert unknown.wait_ended(10)
    assert unknown.error.code() == grpc.StatusCode.NOT_FOUND
    assert "987654321" in unknown.error.details()
    unknown.close()
    call = stub.Stream(iter([]), timeout=10)  # no stream id in the metadata
    with pytest.raises(grpc.RpcError) as err:
        list(call)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    # Closing a stream that is not open is an answer, as the proto promises: closed=false.
    reply = stub.CloseStream(pb.CloseStreamRequest(stream_id=987654321), timeout=10)
    assert reply.closed is False
    # A stream can be attached once only.
    first = RawStream(channel, client_name="attach-once")
    second = RawStream(channel, stream_id=first.stream_id)
    assert second.wait_ended(10)
    assert second.error.code() == grpc.StatusCode.ALREADY_EXISTS
    second.close()
    first.close()


def _emb(array: np.ndarray) -> pb.Tensor:
    return array_to_tensor(array)


@pytest.mark.parametrize(
    ("spec", "what"),
    [
        ({"protocol_version": 0}, "protocol_version"),
        ({"target_interval_ms": -5.0}, "target_interval_ms"),
        ({"target_interval_ms": float("nan")}, "target_interval_ms"),
        ({"prompt": "nope"}, "unknown prompt 'nope'"),
        ({"prompt": "empty", "prompt_embedding": _emb(np.zeros((2, 16), np.float32))}, "not both"),
        ({"prompt_embedding": _emb(np.zeros((5, 16), np.float32))}, "[n <= 4, 16]"),
        ({"prompt_embedding": _emb(np.zeros((2, 16), np.int32))}, "float32 or float16"),
        ({"prompt_embedding": _emb(np.full((2, 16), np.inf, np.float16))}, "NaN or inf"),
        ({"prompt_embedding": pb.Tensor(dtype="float32", shape=[2, 16], data=b"x")}, "bytes"),
        ({"response_latency_budget_ms": -1.0}, "response_latency_budget_ms"),
        ({"response_latency_budget_ms": float("inf")}, "response_latency_budget_ms"),
    ],
)
def test_bad_stream_spec_is_invalid_argument(server, channel, spec, what):
    with pytest.raises(grpc.RpcError) as err:
        open_stream(channel, **spec)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert what in err.value.details()


def test_prompt_embedding_sent_with_the_stream_is_admitted(server, channel):
    embedding = np.random.default_rng(0).standard_normal((3, 16)).astype(np.float16)
    promise = open_stream(channel, prompt_embedding=_emb(embedding), client_name="raw-prompt")
    assert promise.model == "tiny"
    pb_grpc.PhysisStub(channel).CloseStream(
        pb.CloseStreamRequest(stream_id=promise.stream_id), timeout=10
    )


def test_latency_budget_the_server_cannot_promise_is_refused(server, channel):
    plain = RawStream(channel, client_name="budget-probe")
    promised_ms = plain.promise.expected_response_latency_ms
    plain.close()
    assert promised_ms > 0
    with pytest.raises(grpc.RpcError) as err:
        open_stream(channel, response_latency_budget_ms=promised_ms / 2)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "latency" in err.value.details() and "> budget" in err.value.details()
    kept = RawStream(channel, client_name="budget-ok", response_latency_budget_ms=2 * promised_ms)
    assert kept.promise.expected_response_latency_ms <= 2 * promised_ms
    kept.close()


def test_malformed_unary_requests(server, channel):
    for method in ("OpenStream", "CloseStream", "GetServerInfo"):
        call = channel.unary_unary(
            f"/physis.v1.Physis/{method}",
            request_serializer=lambda b: b,
            response_deserializer=None,
        )
        with pytest.raises(grpc.RpcError) as err:
            call(b"\xff\xff\xff garbage", timeout=10)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, method
        assert "malformed" in err.value.details()


def test_refused_when_full_then_admitted_after_close(server, channel, bystander):
    opened = []
    try:
        with pytest.raises(grpc.RpcError) as err:
            for _ in range(MAX_STREAMS + 1):
                opened.append(RawStream(channel, client_name="filler"))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert err.value.details()
        assert server_info(server.target).refusals["RESOURCE_EXHAUSTED"] >= 1
    finally:
        for s in opened:
            s.close()
    # Closed (cancelled) streams free their place: a new one is admitted.
    wait_for(lambda: server_info(server.target).open_streams <= 1, 10, what="streams freed")
    again = RawStream(channel, client_name="after")
    again.close()


def test_server_healthy_after_everything(server, channel):
    health = health_pb2_grpc.HealthStub(channel)
    reply = health.Check(health_pb2.HealthCheckRequest(service="physis.v1.Physis"), timeout=5)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING
    assert server.proc.poll() is None
    info = server_info(server.target)
    assert info.protocol_version == PROTOCOL_VERSION
    assert STREAM_ID_METADATA_KEY  # the key the Stream call is addressed by


def test_a_new_prompt_reopens_the_stream_with_it(server):
    """A task's new instruction (a goal-prompted model's new goal): set_prompt ends the
    stream on the server and opens the next one with the new prompt; one the server does not
    hold is refused with its reason, and the client keeps trying until the prompt is good."""
    client = LinkClient(server.target, client_name="reprompt", connect_timeout_s=10)
    client.start()
    try:
        wait_for(lambda: client.stats().state == "streaming", 20, what="streaming")
        first = client.stats().promise.stream_id
        client.set_prompt("no_such_prompt")
        wait_for(
            lambda: "unknown prompt 'no_such_prompt'" in client.stats().last_error,
            20,
            what="the refusal",
        )
        assert client.stats().state != "streaming"
        client.set_prompt("")  # the model's empty prompt, which the server holds
        wait_for(lambda: client.stats().state == "streaming", 20, what="streaming again")
        stats = client.stats()
        assert stats.promise.stream_id != first and stats.connections == 2
        names = [s.client_name for s in server_info(server.target).streams]
        assert names.count("reprompt") == 1  # the first stream was closed, not left behind
    finally:
        client.close()
