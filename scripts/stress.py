"""Run a command while every CPU core is kept busy: ``make test-stress`` runs the test suite
this way, to show the tests do not depend on an idle machine.

    python scripts/stress.py [--load-per-core N] -- COMMAND...

Starts N busy-loop processes per core (default 1) at normal priority, runs COMMAND, stops
them, and exits with COMMAND's exit status. The load processes die with this one (they
poll their parent), so an interrupted run leaves nothing spinning.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import subprocess
import sys
import time


def _spin(parent_pid: int) -> None:
    """Busy work; checks every ~50 ms that the parent is alive."""
    x = 0
    deadline = time.monotonic() + 0.05
    while True:
        x = (x * 1103515245 + 12345) & 0xFFFFFFFF
        if time.monotonic() > deadline:
            if os.getppid() != parent_pid:
                return
            deadline = time.monotonic() + 0.05


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--load-per-core", type=int, default=1)
    p.add_argument("command", nargs=argparse.REMAINDER)
    args = p.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        p.error("no command to run")
    cores = len(os.sched_getaffinity(0))
    n = cores * args.load_per_core
    ctx = mp.get_context("fork")
    load = [ctx.Process(target=_spin, args=(os.getpid(),), daemon=True) for _ in range(n)]
    for proc in load:
        proc.start()
    print(f"stress: {n} busy processes on {cores} cores while running: {' '.join(command)}",
          flush=True)  # fmt: skip
    started = time.monotonic()
    try:
        code = subprocess.call(command)
    finally:
        for proc in load:
            proc.terminate()
        for proc in load:
            proc.join(5)
    print(f"stress: exit {code} after {time.monotonic() - started:.0f} s under load", flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
