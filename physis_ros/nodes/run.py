"""``run_node``: the one ``main`` of every node here: init, spin, clean exit on Ctrl-C or
SIGTERM (rclpy shuts the context down; a callback caught mid-publish then fails with
RCLError, which is the shutdown, not a fault), and the node's own ``shutdown`` hook."""

from __future__ import annotations

import rclpy
from rclpy._rclpy_pybind11 import RCLError  # rclpy 9 exports it only here
from rclpy.executors import ExternalShutdownException


def run_node(factory, args=None) -> int:
    try:
        with rclpy.init(args=args):
            context = rclpy.get_default_context()
            node = factory()
            try:
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
