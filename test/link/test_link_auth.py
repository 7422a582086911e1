"""TLS (server certificate, client certificates) and the bearer token, on a real server.

The certificates are made here with the openssl command line (a throw-away CA, a server
certificate for 127.0.0.1 and a client certificate), never downloaded or checked in.
"""

from __future__ import annotations

import shutil
import time

import grpc
import numpy as np
import pytest
from certs import make_certs
from grpc_health.v1 import health_pb2, health_pb2_grpc
from link_raw import RawStream, open_stream
from link_server import running_server, server_info, wait_for

from physis_ros.link.client import LinkClient, Observation
from physis_ros.link.proto_gen import physis_pb2 as pb
from physis_ros.link.proto_gen import physis_pb2_grpc as pb_grpc
from physis_ros.link.wire import rgb_image

TOKEN = "s3cret-token-for-tests"
BEARER = (("authorization", f"Bearer {TOKEN}"),)

pytestmark = [
    pytest.mark.skipif(shutil.which("openssl") is None, reason="needs openssl"),
    # a client's failed attempts close channels: grpc's connectivity thread must not die
    pytest.mark.filterwarnings("error::pytest.PytestUnhandledThreadExceptionWarning"),
]


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    return make_certs(tmp_path_factory.mktemp("certs"))


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory, certs):
    tmp = tmp_path_factory.mktemp("auth")
    token_file = tmp / "token"
    token_file.write_text(TOKEN + "\n")
    with running_server(
        tmp,
        "--token-file",
        str(token_file),
        "--tls-cert",
        str(certs["server.pem"]),
        "--tls-key",
        str(certs["server.key"]),
        "--tls-client-ca",
        str(certs["ca.pem"]),
    ) as srv:
        yield srv


def _credentials(certs, *, client_cert: bool = True) -> grpc.ChannelCredentials:
    root = certs["ca.pem"].read_bytes()
    if not client_cert:
        return grpc.ssl_channel_credentials(root)
    return grpc.ssl_channel_credentials(
        root, certs["client.key"].read_bytes(), certs["client.pem"].read_bytes()
    )


def test_tls_with_token_streams(tls_server, certs):
    client = LinkClient(
        tls_server.target,
        token=TOKEN,
        root_cert_path=str(certs["ca.pem"]),
        client_cert_path=str(certs["client.pem"]),
        client_key_path=str(certs["client.key"]),
        client_name="tls",
        connect_timeout_s=10,
    )
    client.start()
    try:
        wait_for(
            lambda: client.stats().state == "streaming",
            20,
            what=f"streaming over TLS ({client.stats().last_error})",
        )
        promise = client.stats().promise
        frame = np.zeros((promise.image_height, promise.image_width, 3), np.uint8)
        got = None
        for seq in range(200):
            client.send_observation(
                Observation(seq=seq, capture_stamp_ns=time.time_ns(), image=rgb_image(frame))
            )
            p = client.get_prediction(0.1)
            if p is not None and p.observation_seq >= 0:
                got = p
                break
        assert got is not None, client.stats()
    finally:
        client.close()


def _unauthenticated(fn) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as err:
        fn()
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED, err.value
    return err.value


@pytest.mark.parametrize(
    "metadata",
    [(), (("authorization", "Bearer wrong"),), (("authorization", TOKEN),)],
    ids=["no-token", "wrong-token", "no-bearer-prefix"],
)
def test_every_call_without_valid_token_is_unauthenticated(tls_server, certs, metadata):
    creds = _credentials(certs)
    before = server_info(tls_server.target, BEARER, creds)
    with grpc.secure_channel(tls_server.target, creds) as channel:
        stub = pb_grpc.PhysisStub(channel)
        _unauthenticated(lambda: open_stream(channel, metadata))
        _unauthenticated(
            lambda: stub.GetServerInfo(pb.ServerInfoRequest(), metadata=metadata, timeout=10)
        )
        _unauthenticated(
            lambda: stub.CloseStream(
                pb.CloseStreamRequest(stream_id=0), metadata=metadata, timeout=10
            )
        )
        # Health needs no token (probes and load balancers carry none); it tells nothing else.
        health = health_pb2_grpc.HealthStub(channel)
        reply = health.Check(health_pb2.HealthCheckRequest(), metadata=metadata, timeout=10)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        # Stream, even naming a stream that exists: refused before the handler runs.
        real = open_stream(channel, BEARER, client_name="victim")
        raw = RawStream(channel, metadata=metadata, stream_id=real.stream_id)
        assert raw.wait_ended(10)
        assert raw.error.code() == grpc.StatusCode.UNAUTHENTICATED
        assert not raw.predictions and not raw.pongs
        raw.close()
        stub.CloseStream(
            pb.CloseStreamRequest(stream_id=real.stream_id), metadata=BEARER, timeout=10
        )
    after = server_info(tls_server.target, BEARER, creds)
    assert after.streams_opened == before.streams_opened + 1  # only the authorised "victim"
    # OpenStream, GetServerInfo, CloseStream and Stream refused: each counted.
    refused = after.refusals["UNAUTHENTICATED"] - before.refusals["UNAUTHENTICATED"]
    assert refused == 4


def test_valid_token_is_accepted_by_every_call(tls_server, certs):
    with grpc.secure_channel(tls_server.target, _credentials(certs)) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        reply = health.Check(health_pb2.HealthCheckRequest(), metadata=BEARER, timeout=10)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        promise = open_stream(channel, BEARER, client_name="ok")
        pb_grpc.PhysisStub(channel).CloseStream(
            pb.CloseStreamRequest(stream_id=promise.stream_id), metadata=BEARER, timeout=10
        )


def test_link_client_without_token_reports_unauthenticated(tls_server, certs):
    client = LinkClient(
        tls_server.target,
        root_cert_path=str(certs["ca.pem"]),
        client_cert_path=str(certs["client.pem"]),
        client_key_path=str(certs["client.key"]),
        connect_timeout_s=5,
    )
    client.start()
    try:
        wait_for(
            lambda: "UNAUTHENTICATED" in client.stats().last_error,
            20,
            what="UNAUTHENTICATED reported",
        )
        assert client.stats().state != "streaming"
        assert client.get_prediction(0.2) is None
    finally:
        client.close()


def test_no_client_certificate_or_plaintext_cannot_connect(tls_server, certs):
    for channel in (
        grpc.secure_channel(tls_server.target, _credentials(certs, client_cert=False)),
        grpc.insecure_channel(tls_server.target),
    ):
        with channel:
            with pytest.raises(grpc.RpcError) as err:
                pb_grpc.PhysisStub(channel).GetServerInfo(
                    pb.ServerInfoRequest(), metadata=BEARER, timeout=5
                )
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE


@pytest.fixture(scope="module")
def other_ca(tmp_path_factory):
    """Certificates of another authority: the server's certificate does not chain to it."""
    return make_certs(tmp_path_factory.mktemp("other-certs"))


LONG_CONNECT_TIMEOUT_S = 120.0
"""Far above any handshake: a reason that shows up before it did not wait for the timeout."""


@pytest.mark.parametrize("mismatch", ["wrong_ca", "plaintext"])
def test_a_tls_mismatch_is_named_at_once_not_a_timeout(tls_server, certs, other_ca, mismatch):
    tls = {}
    if mismatch == "wrong_ca":
        tls = dict(
            root_cert_path=str(other_ca["ca.pem"]),
            client_cert_path=str(certs["client.pem"]),
            client_key_path=str(certs["client.key"]),
        )
    client = LinkClient(
        tls_server.target, token=TOKEN, connect_timeout_s=LONG_CONNECT_TIMEOUT_S, **tls
    )
    error = _first_connect_error(client)
    expected = "TLS handshake failed" if mismatch == "wrong_ca" else "probably requires TLS"
    assert expected in error and tls_server.target in error, error


def _first_connect_error(client: LinkClient) -> str:
    """The error the started ``client`` reports first; it must come before the connect
    timeout (the reason was named, not waited for) and the client never streams."""
    client.start()
    t0 = time.monotonic()
    try:
        error = wait_for(
            lambda: client.stats().last_error, LONG_CONNECT_TIMEOUT_S, what="a connect error"
        )
        assert time.monotonic() - t0 < LONG_CONNECT_TIMEOUT_S, error
        assert client.stats().state != "streaming"
        return error
    finally:
        client.close()


def test_a_host_that_does_not_resolve_is_named_at_once_not_a_timeout():
    client = LinkClient("does-not-exist.invalid:50051", connect_timeout_s=LONG_CONNECT_TIMEOUT_S)
    error = _first_connect_error(client)
    assert "does not resolve" in error and "does-not-exist.invalid" in error, error
    assert "no connection within" not in error, error


def test_physis_eval_link_names_a_tls_failure_and_stops_waiting(tls_server, certs, other_ca):
    """physis-eval --link --tls-ca <wrong CA>: its probe of the server ends in the TLS reason
    (LinkUnavailable: exit 1), long before its connect timeout."""
    from physis_ros.eval.link_replay import LinkUnavailable, ReplayLink, probe
    from physis_ros.link.options import LinkOptions

    opts = ReplayLink(
        target=tls_server.target,
        link=LinkOptions(
            token=TOKEN,
            root_cert_path=str(other_ca["ca.pem"]),
            client_cert_path=str(certs["client.pem"]),
            client_key_path=str(certs["client.key"]),
            connect_timeout_s=LONG_CONNECT_TIMEOUT_S,
        ),
    )
    t0 = time.monotonic()
    with pytest.raises(LinkUnavailable, match="TLS handshake failed") as err:
        probe(opts)
    assert time.monotonic() - t0 < LONG_CONNECT_TIMEOUT_S
    assert "within" not in str(err.value)  # not reported as a timeout
