"""devcopy.HostCopier: deliveries in order on its own thread, close joins it, and a process
that never closes one still exits cleanly (the atexit hook joins it before the interpreter
finalises; rc 134 "terminate called without an active exception" otherwise)."""

from __future__ import annotations

import subprocess
import sys
import threading

import pytest
import torch

from physis_ros.engine.devcopy import HostCopier, close_all


def test_deliveries_in_order_on_the_copiers_thread_and_close_joins_it():
    got, threads = [], set()
    copier = HostCopier("cpu")
    xs = [torch.full((3,), float(i)) for i in range(5)]
    for x in xs:
        copier.copy([x], lambda outs: (got.append(outs[0]), threads.add(threading.get_ident())))
    xs[0].fill_(-1.0)  # the copy was taken when asked for
    copier.close()
    assert not copier.alive
    assert [int(g[0]) for g in got] == [0, 1, 2, 3, 4]
    assert threads and threading.get_ident() not in threads
    with pytest.raises(RuntimeError, match="closed"):
        copier.copy([xs[1]], lambda outs: None)
    copier.close()  # idempotent


def test_a_failing_delivery_stops_the_copier_and_is_raised_by_the_next_copy():
    copier = HostCopier("cpu")

    def bad(outs):
        raise ValueError("sink gone")

    copier.copy([torch.zeros(1)], bad)
    copier._thread.join(timeout=60)
    with pytest.raises(RuntimeError, match="stopped") as info:
        copier.copy([torch.zeros(1)], bad)
    assert isinstance(info.value.__cause__, ValueError)
    close_all()


def test_close_all_joins_every_live_copier():
    copiers = [HostCopier("cpu") for _ in range(3)]
    close_all()
    assert not any(c.alive for c in copiers)


EXIT_SCRIPT = """
import torch
from physis_ros.engine.devcopy import HostCopier
a = torch.randn(400, 400)
done = []
def deliver(outs):
    # a torch op that releases the GIL, still running when the main thread ends
    for _ in range(300):
        torch.mm(a, a)
    done.append(1)
    print("delivered", len(done), flush=True)
copier = HostCopier("cpu")
for _ in range(3):
    copier.copy([a], deliver)
print("main ends", flush=True)
"""


def test_a_process_that_never_closes_its_copier_exits_cleanly():
    """The thread is inside torch.mm (GIL released) when the main thread ends: without the
    atexit join, finalisation ends it with pthread_exit there and the process aborts."""
    proc = subprocess.run(
        [sys.executable, "-c", EXIT_SCRIPT],
        check=False,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "terminate called" not in proc.stderr
    assert proc.stdout.splitlines()[-1] == "delivered 3", proc.stdout
