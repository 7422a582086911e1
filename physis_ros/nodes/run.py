"""``run_node``: the one ``main`` of every node here: the command line (``--help`` prints the
node's usage and parameters and exits 0 before anything starts; ROS arguments, ``--ros-args
...``, go to rclpy; anything else is a usage error), init, spin, clean exit on Ctrl-C or
SIGTERM (rclpy shuts the context down; a callback caught mid-publish then fails with
RCLError, which is the shutdown, not a fault), and the node's own ``shutdown`` hook.

``executor="events"`` uses rclpy's EventsExecutor, whose per-message overhead is a fraction
of the SingleThreadedExecutor's (it matters at hundreds of sensor messages a second). In
rclpy 9.1.2 its ``spin()`` busy-loops and starves timers, so it is driven by ``spin_once``
with a timeout, which works.
"""

from __future__ import annotations

import argparse
import functools
import signal
import sys
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass

import rclpy
from rclpy._rclpy_pybind11 import RCLError  # rclpy 9 exports it only here
from rclpy.executors import ExternalShutdownException

EXECUTORS = ("single", "events")


@dataclass(frozen=True)
class NodeUsage:
    """What ``--help`` prints for a node."""

    prog: str
    description: str
    parameters: Sequence[tuple[str, object, str]]
    """(name, default, description) of each ROS parameter."""
    params_file: str
    """The parameter file shipped in config/ (share/physis_ros/config once installed)."""
    example: str


def check_command_line(usage: NodeUsage, args: Sequence[str] | None = None) -> None:
    """``--help``: usage on stdout, exit 0. Arguments outside ``--ros-args ... [--]``
    other than that: a usage error (exit 2). ROS arguments are left to rclpy."""
    argv = list(sys.argv if args is None else args)
    own = rclpy.utilities.remove_ros_args(argv)[1:]
    lines = textwrap.wrap(
        f"ROS parameters (--ros-args -p NAME:=VALUE, or --params-file FILE; all of them with "
        f"their defaults in config/{usage.params_file}):",
        88,
    )
    for name, default, text in usage.parameters:
        lines.append(f"  {name} (default: {default!r})")
        lines += textwrap.wrap(text, 88, initial_indent=" " * 6, subsequent_indent=" " * 6)
    lines += ["", "example:", f"  {usage.example}"]
    parser = argparse.ArgumentParser(
        prog=usage.prog,
        usage="%(prog)s [-h] [--ros-args ROS_ARGUMENTS ... [--]]",
        description=usage.description,
        epilog="\n".join(lines),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.parse_args(own)


def quiet_at_shutdown(callback):
    """For a node's callbacks that publish: Ctrl-C shuts the context down under a callback that is
    publishing, whose publish then raises RCLError; that is the shutdown, and the
    EventsExecutor would log it as a FATAL error with a stack. Other errors pass."""

    @functools.wraps(callback)
    def guarded(node, *args, **kwargs):
        try:
            return callback(node, *args, **kwargs)
        except RCLError:
            if node.context.ok():
                raise
            return None

    return guarded


def run_node(
    factory, args=None, *, usage: NodeUsage | None = None, executor: str = "single"
) -> int:
    """``usage``: the node's command line is checked (--help, --ros-args); None: the caller
    parsed its own arguments (a helper process such as physis-bench's feed)."""
    if executor not in EXECUTORS:
        raise ValueError(f"executor {executor!r} is not one of {EXECUTORS}")
    if usage is not None:
        check_command_line(usage, args)
    try:
        with rclpy.init(args=args):
            context = rclpy.get_default_context()
            node = factory()
            try:
                if executor == "events":
                    from rclpy.experimental import EventsExecutor

                    _spin_events(EventsExecutor(context=context), node, context)
                else:
                    rclpy.spin(node)
            except RCLError:
                if context.ok():
                    raise
            finally:
                _ignore_further_interrupts()
                hook = getattr(node, "shutdown", None)
                if callable(hook):
                    hook()
    except (KeyboardInterrupt, ExternalShutdownException):
        pass
    finally:
        _ignore_further_interrupts()  # rclpy's shutdown put its predecessor's handler back
    return 0


def _ignore_further_interrupts() -> None:
    """Once the node is stopping, SIGINT is spent: Ctrl-C in a terminal signals the whole
    process group and ``ros2 launch`` then signals each process again; that second SIGINT
    killed sim_robot mid-teardown (exit -2) instead of letting it finish (exit 0)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


MAX_CONSECUTIVE_EXECUTOR_ERRORS = 10


def _spin_events(events, node, context) -> None:
    """EventsExecutor (experimental in rclpy 9) can raise a bare RuntimeError from pybind11
    ("Unable to convert call argument '0' to Python object"): it ended the bridge in one
    test run of the demo. When the context is shutting down that is the shutdown; otherwise
    one event is lost, which is logged, and the node keeps running unless it happens again
    and again."""
    events.add_node(node)
    errors_in_a_row = 0
    while context.ok():
        try:
            events.spin_once(timeout_sec=0.1)
            errors_in_a_row = 0
        except RuntimeError as err:
            if not context.ok():
                return  # shut down while spinning
            if isinstance(err, RCLError):
                raise
            errors_in_a_row += 1
            node.get_logger().error(
                f"executor dropped an event ({errors_in_a_row} in a row): {err}"
            )
            if errors_in_a_row >= MAX_CONSECUTIVE_EXECUTOR_ERRORS:
                raise
