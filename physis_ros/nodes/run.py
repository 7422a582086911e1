"""``run_node``: the one ``main`` of every node here: init, spin, clean exit on Ctrl-C or
SIGTERM (rclpy shuts the context down; a callback caught mid-publish then fails with
RCLError, which is the shutdown, not a fault), and the node's own ``shutdown`` hook.

``executor="events"`` uses rclpy's EventsExecutor, whose per-message overhead is a fraction
of the SingleThreadedExecutor's (it matters at hundreds of sensor messages a second). In
rclpy 9.1.2 its ``spin()`` busy-loops and starves timers, so it is driven by ``spin_once``
with a timeout, which works.
"""

from __future__ import annotations

import rclpy
from rclpy._rclpy_pybind11 import RCLError  # rclpy 9 exports it only here
from rclpy.executors import ExternalShutdownException

EXECUTORS = ("single", "events")


def run_node(factory, args=None, *, executor: str = "single") -> int:
    if executor not in EXECUTORS:
        raise ValueError(f"executor {executor!r} is not one of {EXECUTORS}")
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
                hook = getattr(node, "shutdown", None)
                if callable(hook):
                    hook()
    except (KeyboardInterrupt, ExternalShutdownException):
        pass
    return 0


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
