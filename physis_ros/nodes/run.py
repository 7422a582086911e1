"""``run_node``: the one ``main`` of every node here: the command line (``--help`` prints the
node's usage and parameters and exits 0 before anything starts; ROS arguments, ``--ros-args
...``, go to rclpy; anything else is a usage error), init, spin, and a clean exit (0) on
Ctrl-C or SIGTERM at any moment: while the node is being built, or while it spins (then
executor, the node's own ``on_stop`` and ``shutdown`` hooks, node, context are stopped in
that order; see ``StopSignals``). A node started by a launcher that names itself in
PHYSIS_PARENT_PID (the launch files) stops the same way when that launcher dies
(``children.tie_to_launcher``).

``executor="events"`` uses rclpy's EventsExecutor, whose per-message overhead is a fraction
of the SingleThreadedExecutor's (it matters at hundreds of sensor messages a second).
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
from rclpy.executors import ExternalShutdownException, SingleThreadedExecutor
from rclpy.qos import DurabilityPolicy, QoSProfile, ReliabilityPolicy
from rclpy.signals import SignalHandlerOptions

from physis_ros.children import tie_to_launcher
from physis_ros.cli_errors import ignore_further_interrupts

LATCHED_QOS = QoSProfile(
    depth=1, reliability=ReliabilityPolicy.RELIABLE, durability=DurabilityPolicy.TRANSIENT_LOCAL
)
"""A topic whose last message is kept for late joiners (tf2's tf_static, a task's goal)."""

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
    """For a node's callbacks that publish: an outside ``rclpy.shutdown`` (not run_node's own
    stop, which shuts down after the node) can land under a callback that is publishing, whose
    publish then raises RCLError; that is the shutdown, and the EventsExecutor would log it as
    a FATAL error with a stack. Other errors pass."""

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
    tie_to_launcher()
    if usage is not None:
        check_command_line(usage, args)
    # Until the node spins, SIGINT and SIGTERM raise KeyboardInterrupt: a node still being
    # built (the bridge waits minutes for a starting server's port file) stops at once. With
    # rclpy's handlers the signal shut the context down under the constructor, which went on
    # waiting and then failed with a traceback. (Set for SIGINT too: a shell starts a
    # background job with SIGINT ignored, and rclpy used to take it over regardless.)
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, signal.default_int_handler)
    stop = StopSignals()
    try:
        with rclpy.init(args=args, signal_handler_options=SignalHandlerOptions.NO):
            context = rclpy.get_default_context()
            node = factory()
            spinner = _make_executor(executor, context)
            stop.install()  # after the executor: the EventsExecutor installs its own
            try:
                spinner.add_node(node)
                _spin(spinner, node, context, stop, tolerate_bare_errors=executor == "events")
            finally:
                ignore_further_interrupts()
                _stop_node(spinner, node)
                del spinner  # the EventsExecutor's destructor puts SIGINT back to default
                ignore_further_interrupts()
    except KeyboardInterrupt:
        pass
    finally:
        ignore_further_interrupts()
    return 0


class StopSignals:
    """SIGINT and SIGTERM while the node spins: a request to stop, seen between two spins
    (at most ``SPIN_PERIOD_S`` later). The node then stops in order while its context is
    still valid: the executor lets go of the node's entities, the node's hook runs, the node
    is destroyed, and only then is rclpy shut down. Letting the signal shut the context down
    first (rclpy's handlers, and the EventsExecutor's own) tore the executor down after
    ``rcl_shutdown``: once in a CI run the EventsExecutor's destructor aborted the bridge
    (exit -6)."""

    def __init__(self) -> None:
        self.received: int | None = None

    def install(self) -> None:
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, self._take)

    def _take(self, signum: int, _frame) -> None:
        self.received = signum


SPIN_PERIOD_S = 0.1
"""Longest one spin blocks: how soon a stop request is seen. (The EventsExecutor's
``spin()`` busy-loops and starves timers in rclpy 9.1.2; ``spin_once`` with a timeout works.)"""

EXECUTOR_SHUTDOWN_TIMEOUT_S = 5.0
"""Longest the executor waits for a callback in progress when the node stops."""


def _make_executor(kind: str, context):
    if kind == "events":
        from rclpy.experimental import EventsExecutor

        return EventsExecutor(context=context)
    return SingleThreadedExecutor(context=context)


def _stop_node(spinner, node) -> None:
    """Executor, hooks, node, in that order, while the context is valid. The node's
    ``on_stop`` hook says its last word (the bridge's fallback to the robot), then its
    ``shutdown`` hook releases what it holds."""
    try:
        spinner.shutdown(timeout_sec=EXECUTOR_SHUTDOWN_TIMEOUT_S)
    except RuntimeError as err:  # reported, and the node's own shutdown still runs
        node.get_logger().error(f"executor shutdown failed: {err}")
    on_stop, shutdown = getattr(node, "on_stop", None), getattr(node, "shutdown", None)
    try:
        if callable(on_stop):
            on_stop()
    finally:
        if callable(shutdown):
            shutdown()
    node.destroy_node()


MAX_CONSECUTIVE_EXECUTOR_ERRORS = 10


def _spin(spinner, node, context, stop: StopSignals, *, tolerate_bare_errors: bool) -> None:
    """Until a stop signal or an outside ``rclpy.shutdown``. ``tolerate_bare_errors``: the
    EventsExecutor (experimental in rclpy 9) can raise a bare RuntimeError from pybind11
    ("Unable to convert call argument '0' to Python object"): it ended the bridge in one test
    run of the demo. One such error loses one event, which is logged, and the node keeps
    running unless it happens again and again."""
    errors_in_a_row = 0
    while context.ok() and stop.received is None:
        try:
            spinner.spin_once(timeout_sec=SPIN_PERIOD_S)
            errors_in_a_row = 0
        except ExternalShutdownException:
            return
        except RuntimeError as err:
            if not context.ok():
                return  # shut down from outside while spinning
            if isinstance(err, RCLError) or not tolerate_bare_errors:
                raise
            errors_in_a_row += 1
            node.get_logger().error(
                f"executor dropped an event ({errors_in_a_row} in a row): {err}"
            )
            if errors_in_a_row >= MAX_CONSECUTIVE_EXECUTOR_ERRORS:
                raise
