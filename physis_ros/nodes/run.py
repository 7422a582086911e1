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

                    events = EventsExecutor(context=context)
                    events.add_node(node)
                    while context.ok():
                        events.spin_once(timeout_sec=0.1)
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
