"""``physis-torchrun``: torchrun (``torch.distributed.run``) that ends quietly on Ctrl-C.

On SIGINT or SIGTERM torchrun passes the signal to its ranks, waits for them to stop, then
re-raises it as a ``SignalException`` and prints a traceback with exit status 1. Stopping a
server with Ctrl-C or ``ros2 launch``'s shutdown is the normal way to end it, so this entry
says so in one line and exits 0. Everything else (arguments, rank failures) is torchrun's.
workstation.launch.py runs it, so torchrun is found in the package like physis-serve and
runs with the package's interpreter.
"""

from __future__ import annotations

import signal
import sys


def main(argv: list[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.run import main as torchrun_main

    try:
        torchrun_main(argv)
    except SignalException as stop:
        name = signal.Signals(stop.sigval).name
        print(f"physis-torchrun: {name}: the ranks were stopped", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
