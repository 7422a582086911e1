"""``physis-torchrun``: torchrun (``torch.distributed.run``) that ends quietly on Ctrl-C.

On SIGINT or SIGTERM torchrun passes the signal to its ranks, waits for them to stop, then
re-raises it as a ``SignalException`` and prints a traceback with exit status 1. Stopping a
server with Ctrl-C or ``ros2 launch``'s shutdown is the normal way to end it, so this entry
says so in one line and exits 0. A rank that fails ends it in one line too, naming the rank
and its exit status (the rank's own one-line error is above), exit 2 when every failed rank
reported a usage or config error, else 1; torchrun's own arguments are torchrun's.
workstation.launch.py runs it, so torchrun is found in the package like physis-serve and
runs with the package's interpreter.
"""

from __future__ import annotations

import signal
import sys

from physis_ros.children import tie_to_launcher
from physis_ros.cli_errors import EXIT_USAGE, RuntimeFailure, UsageError, cli_main


@cli_main("physis-torchrun")
def main(argv: list[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    tie_to_launcher()  # ends (stopping its ranks) with the launcher that named itself
    args = parse_args(argv)
    _stop_once()
    try:
        run(args)  # not torchrun's main: its @record prints a failed rank's report as a table
    except SignalException as stop:
        name = signal.Signals(stop.sigval).name
        print(f"physis-torchrun: {name}: the ranks were stopped", file=sys.stderr)
    except ChildFailedError as exc:
        codes = {rank: failure.exitcode for rank, failure in sorted(exc.failures.items())}
        # ranks that failed on their own (those the agent stopped exit by a signal, < 0)
        own = {rank: code for rank, code in codes.items() if code > 0} or codes
        named = ", ".join(f"rank {rank} exited {code}" for rank, code in own.items())
        error = UsageError if all(c == EXIT_USAGE for c in own.values()) else RuntimeFailure
        raise error(
            f"{named}; the other ranks were stopped",
            "see the rank's own error line above (physis-serve: error: ...)",
        ) from exc
    finally:
        # The ranks are gone: a Ctrl-C now has nothing to stop. Ignored, not left to a Python
        # handler: at exit Python puts SIG_DFL back for its own handlers, and a late second
        # SIGINT (launch signals the group, then each process) killed us (-2) after our line.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    return 0


def _stop_once() -> None:
    """A second SIGINT while the ranks are being stopped changes nothing: Ctrl-C under ``ros2
    launch`` signals the whole process group and launch then signals each process again.
    torchrun's handler raises on every signal, and the second one, raised inside the agent's
    shutdown (in a log call), printed a traceback. A SIGTERM still escalates."""
    from torch.distributed.elastic.multiprocessing import api

    raise_signal = api._terminate_process_handler  # looked up when the agent installs it
    stopping: set[int] = set()

    def handler(signum: int, frame) -> None:
        if signum == signal.SIGINT and signum in stopping:
            return
        stopping.add(signum)
        raise_signal(signum, frame)

    api._terminate_process_handler = handler


if __name__ == "__main__":
    sys.exit(main())
