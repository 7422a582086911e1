"""Failures on either end of a real link: the server killed and restarted (the client
reconnects by itself), and a robot process killed mid-stream (its slots are freed)."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import grpc
import numpy as np
import pytest
import yaml
from link_raw import open_stream
from link_server import (
    HERE,
    REPO_ROOT,
    child_env,
    running_server,
    server_info,
    start_server,
    wait_for,
)

from physis_ros.link.client import LinkClient, Observation
from physis_ros.link.wire import rgb_image


def test_server_killed_and_restarted_client_reconnects(tmp_path):
    server = start_server(tmp_path, name="first")
    port = server.port
    client = LinkClient(
        server.target, client_name="reconnect", connect_timeout_s=2, reconnect_backoff_s=(0.05, 0.5)
    )
    stop = threading.Event()

    def feed() -> None:
        seq = 0
        while not stop.is_set():
            promise = client.stats().promise
            if promise is not None:
                frame = np.zeros((promise.image_height, promise.image_width, 3), np.uint8)
                client.send_observation(
                    Observation(seq=seq, capture_stamp_ns=time.time_ns(), image=rgb_image(frame))
                )
                seq += 1
            time.sleep(0.02)

    feeder = threading.Thread(target=feed, daemon=True)
    client.start()
    feeder.start()
    restarted = None
    try:
        wait_for(lambda: client.get_prediction(0.1), 30, what="first prediction")
        server.kill()
        wait_for(
            lambda: client.stats().state in ("connecting", "disconnected"),
            10,
            what="client noticing the dead server",
        )
        assert client.stats().last_error
        while client.get_prediction(0) is not None:  # what arrived before the kill
            pass
        restarted = start_server(tmp_path, port=port, name="second")
        assert restarted.port == port
        first_after = wait_for(
            lambda: client.get_prediction(0.1),
            60,
            what=f"prediction after restart ({client.stats().last_error})",
        )
        assert client.stats().connections == 2
        conditioned = wait_for(
            lambda: (p := client.get_prediction(0.1)) is not None and p.observation_seq >= 0 and p,
            30,
            what="a conditioned prediction after restart",
        )
        assert conditioned.chunk_index > first_after.chunk_index or first_after.chunk_index == 0
        assert client.stats().state == "streaming"
        assert client.stats().clock_offset_ms is not None
    finally:
        stop.set()
        feeder.join(5)
        client.close()
        server.kill()
        if restarted is not None:
            assert restarted.stop() == 0, restarted.log()


def test_robot_killed_mid_stream_frees_its_slots(tmp_path):
    """The engine (not the front end) holds one stream's KV slots: while the robot streams a
    second stream is refused by the engine's admission; after the robot is killed its slots
    are freed in the engine and a new stream is admitted."""
    cfg = yaml.safe_load((REPO_ROOT / "config" / "serve.yaml").read_text())
    cfg["frontend"]["max_streams"] = 4
    # held for the robot to resume this long after its connection ended, then freed
    cfg["frontend"]["resume_grace_s"] = 2.0
    cfg["engine"]["max_streams"] = 1
    (tmp_path / "serve.yaml").write_text(yaml.safe_dump(cfg))
    with running_server(tmp_path, "--config", str(tmp_path / "serve.yaml")) as server:
        ready = tmp_path / "robot.ready"
        robot = subprocess.Popen(
            [sys.executable, str(HERE / "link_robot.py"), server.target, str(ready)],
            cwd=REPO_ROOT,
            env=child_env(),
        )
        try:
            wait_for(ready.exists, 60, what="the robot child streaming")
            info = server_info(server.target)
            assert info.open_streams == 1 and info.streams[0].attached
            assert info.engine["open_streams"] == "1"
            with grpc.insecure_channel(server.target) as channel:
                with pytest.raises(grpc.RpcError) as err:
                    open_stream(channel, client_name="second")
                assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                assert "the engine takes 1" in err.value.details()  # refused by the engine
            robot.kill()
            robot.wait(10)
            freed = wait_for(
                lambda: (
                    (i := server_info(server.target)).open_streams == 0
                    and i.engine["open_streams"] == "0"
                    and i
                ),
                10,
                what="the killed robot's stream and its engine slots freed",
            )
            assert freed.streams_closed >= 1
            with grpc.insecure_channel(server.target) as channel:
                promise = open_stream(channel, client_name="after-kill")
                assert promise.stream_id != info.streams[0].stream_id
        finally:
            if robot.poll() is None:
                robot.kill()
                robot.wait(10)
