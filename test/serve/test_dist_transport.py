"""TorchDistTransport between real processes (gloo): ordering, payloads, control, faults.

Rank 0 is the test process; ranks 1..N-1 run ``relay_main`` below (this file run as a
script): each adds its rank to x (and h) and passes the activation on, the last hop going
to rank 0's sink. No engine is involved: this tests the wire alone.
"""

from __future__ import annotations

import datetime
import os
import signal
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from physis_ros.engine.ranks import framing
from physis_ros.engine.ranks import transport as dist_transport
from physis_ros.engine.ranks.framing import ActivationShapes, check_shapes_agree
from physis_ros.engine.ranks.launch import (
    as_rank,
    free_port,
    spawn_ranks,
    stop_ranks,
    tie_to_parent,
)
from physis_ros.engine.ranks.runtime import exit_now
from physis_ros.engine.ranks.transport import TorchDistTransport
from physis_ros.engine.transport import Activation

REPO_ROOT = Path(__file__).resolve().parents[2]
SHAPES = ActivationShapes(x_numel=6, h_tokens=3, h_dim=4, steps=3)


INIT_TIMEOUT_S = 120
"""Joining the job: spawned ranks import torch first, which takes seconds on a busy machine
(20 s ran out under load); init returns as soon as every rank joined."""


def relay_main() -> None:
    tie_to_parent()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=INIT_TIMEOUT_S))
    transport = TorchDistTransport(shapes=SHAPES, device=torch.device("cpu"))
    rank, world = transport.rank, transport.world_size
    next_heartbeat_s = 0.0
    while True:
        if time.monotonic() >= next_heartbeat_s:
            transport.send_heartbeat(0)
            next_heartbeat_s = time.monotonic() + 0.2
        if any(c.kind == "stop" for c in transport.recv_control()):
            transport.send_control(0, "bye", {"rank": rank})
            break
        for msg in transport.recv(timeout_s=0.05):
            h = (msg.h if msg.h is not None else torch.zeros(3, 4)) + rank
            last = rank == world - 1
            out = Activation(
                stream_id=msg.stream_id,
                chunk=msg.chunk,
                step=SHAPES.steps if last else msg.step,
                block=msg.block + 1,
                flags=msg.flags,
                x=msg.x + rank,
                h=h,
                created_s=msg.created_s,
            )
            transport.send(0 if last else rank + 1, out)
    transport.close()
    dist.destroy_process_group()
    exit_now(0)


@pytest.fixture
def ranks(request, tmp_path):
    """(transport of rank 0 in this process, child processes) for a world of N ranks."""
    world = request.param
    torch.set_num_threads(1)
    port = free_port()
    env = {"PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"}
    procs = spawn_ranks(
        world_size=world, master_port=port, argv=[__file__], extra_env=env, log_dir=str(tmp_path)
    )
    with as_rank(rank=0, world_size=world, master_port=port):
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=INIT_TIMEOUT_S))
    transport = TorchDistTransport(shapes=SHAPES, device=torch.device("cpu"))
    try:
        yield transport, procs
    finally:
        for r in range(1, world):
            transport.send_control(r, "stop")
        transport.close()
        codes = stop_ranks(procs, timeout_s=30.0)
        dist.destroy_process_group()
        # every rank exited on its own after "stop" (-9: the one a test killed)
        logs = {p.name: p.read_text(errors="replace")[-2000:] for p in tmp_path.glob("rank*.log")}
        assert all(code in (0, -signal.SIGKILL) for code in codes), (codes, logs)


def _wait_sink(transport, count, timeout_s=10.0):
    got, deadline = [], time.monotonic() + timeout_s
    while len(got) < count and time.monotonic() < deadline:
        got += [msg for _, msg in transport.recv_sink(timeout_s=0.1)]
    return got


@pytest.mark.parametrize("ranks", [3], indirect=True)
def test_relay_preserves_payload_order_and_metadata(ranks):
    transport, _ = ranks
    world = transport.world_size
    created = time.monotonic() - 1.25
    for chunk in range(6):
        x = torch.arange(6, dtype=torch.float32) * (chunk + 1)
        transport.send(
            1,
            Activation(
                stream_id=7, chunk=chunk, step=0, block=0, flags=1, x=x, h=None, created_s=created
            ),
        )
    got = _wait_sink(transport, 6)
    assert [m.chunk for m in got] == list(range(6))  # per-pair FIFO survives every hop
    rank_sum = sum(range(1, world))
    for m in got:
        assert (m.stream_id, m.step, m.block, m.flags) == (7, SHAPES.steps, world - 1, 1)
        expected_x = torch.arange(6, dtype=torch.float32) * (m.chunk + 1) + rank_sum
        assert torch.equal(m.x, expected_x)
        assert torch.equal(m.h, torch.full((3, 4), float(rank_sum)))
        assert m.created_s == created  # float64 stamp survives the int64 header bit-exactly
    assert transport.counters["received"] == 6


@pytest.mark.parametrize("ranks", [2], indirect=True)
def test_bad_shape_is_refused_before_sending(ranks):
    transport, _ = ranks
    with pytest.raises(ValueError, match="x has 5 values"):
        transport.send(
            1, Activation(stream_id=0, chunk=0, step=0, block=0, flags=0, x=torch.zeros(5), h=None)
        )
    with pytest.raises(ValueError, match="h shape"):
        transport.send(
            1,
            Activation(
                stream_id=0,
                chunk=0,
                step=0,
                block=0,
                flags=0,
                x=torch.zeros(6),
                h=torch.zeros(2, 4),
            ),
        )
    # the channel still works afterwards
    transport.send(
        1, Activation(stream_id=0, chunk=0, step=0, block=0, flags=0, x=torch.zeros(6), h=None)
    )
    assert len(_wait_sink(transport, 1)) == 1


@pytest.mark.parametrize("ranks", [3], indirect=True)
def test_killed_rank_is_seen_silent_and_others_keep_working(ranks):
    transport, procs = ranks
    # Both workers heard from: a loaded machine starts ranks slowly, and a rank still inside
    # init_process_group when its peer dies waits there for the whole init timeout.
    t0 = time.monotonic()
    while not (transport.heard_from(1) and transport.heard_from(2)) and time.monotonic() - t0 < 60:
        time.sleep(0.05)
    assert transport.heard_from(1) and transport.heard_from(2)
    procs[1].send_signal(signal.SIGKILL)  # rank 2
    procs[1].wait()
    t0 = time.monotonic()
    while transport.seconds_since_heard(2) < 1.0 and time.monotonic() - t0 < 5:
        time.sleep(0.05)
    assert transport.seconds_since_heard(2) >= 1.0
    assert transport.seconds_since_heard(1) < 3.0  # rank 1 still heartbeats (on a busy host)
    # A send to the dead rank fails fast and is counted, not hung.
    transport.send(
        2, Activation(stream_id=0, chunk=0, step=0, block=0, flags=0, x=torch.zeros(6), h=None)
    )
    deadline = time.monotonic() + 10
    while 2 not in transport.failed_peers() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert 2 in transport.failed_peers()


def old_protocol_main() -> None:
    """A rank whose wire code differs from rank 0's (as when it was started from an older
    install): the start-up handshake must refuse it on both sides."""
    tie_to_parent()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=INIT_TIMEOUT_S))
    framing.PROTOCOL_VERSION = 1
    try:
        check_shapes_agree(SHAPES, torch.device("cpu"))
        code = 0
    except RuntimeError as exc:
        code = 4 if "every rank must run the same physis_ros code" in str(exc) else 5
    exit_now(code)


def test_ranks_running_different_wire_code_are_refused_at_start_up():
    port = free_port()
    env = {"PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"}
    procs = spawn_ranks(
        world_size=2, master_port=port, argv=[__file__, "old-protocol"], extra_env=env
    )
    with as_rank(rank=0, world_size=2, master_port=port):
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=INIT_TIMEOUT_S))
    try:
        with pytest.raises(RuntimeError, match="rank 1 runs wire protocol 1") as err:
            check_shapes_agree(SHAPES, torch.device("cpu"))
        assert f"rank 0 runs {framing.PROTOCOL_VERSION}" in str(err.value)
    finally:
        codes = stop_ranks(procs, timeout_s=30.0)
        dist.destroy_process_group()
    assert codes == [4]  # the other side refused too, naming the cause


BIG = ActivationShapes(x_numel=16_000_000, h_tokens=3, h_dim=4, steps=3)
"""64 MB activations: a message many socket buffers long, so that a sender stopped 2 ms into
one leaves it half sent."""


def stall_main() -> None:
    """Rank 1 heartbeats rank 0 until ``stop``; rank 2, told ``stall``, starts a message of the
    largest size to rank 0 and is stopped (SIGSTOP, as a hung process) 2 ms into it."""
    tie_to_parent()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=INIT_TIMEOUT_S))
    transport = TorchDistTransport(shapes=BIG, device=torch.device("cpu"))
    stopping = False
    while not stopping:
        transport.send_heartbeat(0)
        for ctl in transport.recv_control(timeout_s=0.2):
            stopping |= ctl.kind == "stop"
            if ctl.kind == "stall":
                message = torch.zeros(transport.capacity_bytes, dtype=torch.uint8)
                threading.Timer(0.002, os.kill, args=(os.getpid(), signal.SIGSTOP)).start()
                dist.isend(message, dst=0, tag=framing.TAG_HEADER).wait()
    transport.close()
    dist.destroy_process_group()
    exit_now(0)


def test_a_rank_hung_mid_message_does_not_silence_the_others(tmp_path):
    """Rank 0 (the controller) receives from each rank on its own: a receive from any source
    is matched to the first sender, and one hung halfway through its message held it, so
    every other rank fell silent to the controller and was failed with the hung one."""
    world, port = 3, free_port()
    env = {"PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"}
    procs = spawn_ranks(
        world_size=world, master_port=port, argv=[__file__, "stall"], extra_env=env,
        log_dir=str(tmp_path),
    )  # fmt: skip
    with as_rank(rank=0, world_size=world, master_port=port):
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=INIT_TIMEOUT_S))
    transport = TorchDistTransport(shapes=BIG, device=torch.device("cpu"))
    try:
        t0 = time.monotonic()
        while (
            not (transport.heard_from(1) and transport.heard_from(2)) and time.monotonic() - t0 < 60
        ):
            time.sleep(0.05)
        assert transport.heard_from(1) and transport.heard_from(2)
        transport.send_control(2, "stall")
        t0 = time.monotonic()
        while transport.seconds_since_heard(2) < 3.0 and time.monotonic() - t0 < 30:
            time.sleep(0.05)
        assert transport.seconds_since_heard(2) >= 3.0  # rank 2 hung
        # rank 1 heartbeats every 0.2 s: heard within the last seconds (on a busy host)
        assert transport.seconds_since_heard(1) < 2.0, transport.seconds_since_heard(1)
        heartbeats = transport.counters["heartbeats_received"]
        time.sleep(1.0)
        assert transport.counters["heartbeats_received"] > heartbeats
    finally:
        procs[1].kill()  # the hung rank
        transport.send_control(1, "stop")
        transport.close()
        codes = stop_ranks(procs, timeout_s=30.0)
        dist.destroy_process_group()
    assert codes[0] == 0 and codes[1] == -signal.SIGKILL, codes


if __name__ == "__main__":
    mains = {"old-protocol": old_protocol_main, "stall": stall_main}
    sys.exit(mains[sys.argv[1]]() if sys.argv[1:] else relay_main())


def test_a_stopping_rank_wakes_its_receive_wait_and_the_wake_is_never_delivered():
    """StopFlag.set wakes the transport's queues: a worker blocked in a receive must not rely
    on the get's own timeout (a signal near its deadline makes CPython 3.11 wait forever)."""
    from physis_ros.engine.ranks.runtime import StopFlag

    inbox = dist_transport.queue.SimpleQueue()
    stop = StopFlag()
    stop.wake = lambda: inbox.put(dist_transport._WAKE)
    threading.Timer(0.1, stop.set, args=("SIGTERM",)).start()
    t0 = time.monotonic()
    assert dist_transport._drain(inbox, 30.0) == []
    assert time.monotonic() - t0 < 5.0
    assert stop.reason == "SIGTERM"
    inbox.put("activation")
    inbox.put(dist_transport._WAKE)
    assert dist_transport._drain(inbox, 0.0) == ["activation"]
