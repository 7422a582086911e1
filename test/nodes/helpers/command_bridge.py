"""Child process for the commanded-action test: the real server front end (``run_frontend``,
as physis-serve runs it) over a fake engine that records what it is given, for a world model
with action_mode "condition", and the real bridge node linked to it on 127.0.0.1.

    command_bridge.py PORT_FILE --ros-args -p name:=value ...   (the bridge's parameters)

Prints ``ready`` once the bridge streams. Each ``state`` line on stdin is answered with a JSON
line of the bridge's counts and drops and the number of context chunks the engine got (the
test waits on these instead of sleeping, so a busy machine cannot reorder its steps); any
other line ends it: one JSON line (what the engine received, the bridge's counts and drops)
and exit 0. The test process publishes the bridge's inputs on real topics in between.
"""

import json
import queue
import sys
import threading
import time
from pathlib import Path

import numpy as np
import rclpy

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "link"))
from link_fake_engine import FakeEngine

from physis_ros.nodes.bridge import Bridge
from physis_ros.serve.frontend_config import FrontendConfig, ServerDescription
from physis_ros.serve.main import run_frontend

HEIGHT = WIDTH = 16
ACTION_HORIZON, ACTION_DIM = 4, 2


def _listed(actions) -> list | None:
    return None if actions is None else np.asarray(actions).tolist()


class RecordingEngine(FakeEngine):
    """FakeEngine that also logs, in order, each context chunk (its newest frame's pixel
    value and its actions) and each generate request (its actions)."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.events: list[tuple] = []  # ("context", pixel, [H, A] | None) | ("generate", ...)

    def submit_context(self, stream_id, frames, actions=None, *, slot=None) -> int:
        chunk = super().submit_context(stream_id, frames, actions, slot=slot)
        with self._lock:
            self.events.append(("context", float(frames[-1].mean()), _listed(actions)))
        return chunk

    def submit_generate(self, stream_id, actions=None) -> int:
        chunk = super().submit_generate(stream_id, actions)
        with self._lock:
            self.events.append(("generate", None, _listed(actions)))
        return chunk


def main() -> int:
    port_file = sys.argv[1]
    engine = RecordingEngine(
        slots=1,
        chunk_ms=10.0,
        height=HEIGHT,
        width=WIDTH,
        action_horizon=ACTION_HORIZON,
        action_dim=ACTION_DIM,
        action_mode="condition",  # a world model conditioned on the commanded actions
    )
    stop = threading.Event()
    server = threading.Thread(
        target=run_frontend,
        args=(
            engine,
            ServerDescription(model="fake", steps=2, blocks=2, action_mode="condition"),
            FrontendConfig(port=0),
        ),
        kwargs={"port_file": port_file, "stop": stop},
        daemon=True,
    )
    server.start()
    rclpy.init(args=sys.argv)
    node = Bridge()  # its server_port_file parameter names port_file
    done = threading.Event()
    asked = queue.SimpleQueue()

    def read_stdin() -> None:
        for line in sys.stdin:
            if line.strip() != "state":
                break
            asked.put(None)
        done.set()

    threading.Thread(target=read_stdin, daemon=True).start()
    ready = False
    deadline = time.monotonic() + 300.0
    while not done.is_set() and time.monotonic() < deadline:
        rclpy.spin_once(node, timeout_sec=0.02)
        if not ready and node.link.stats().state == "streaming":
            print("ready", flush=True)
            ready = True
        while not asked.empty():
            asked.get()
            with engine._lock:
                contexts = sum(kind == "context" for kind, _, _ in engine.events)
            state = {
                "counts": node.snapshot().counts,
                "drops": node.drops.snapshot(),
                "contexts": contexts,
            }
            print(json.dumps(state), flush=True)
    # let the last observations reach the engine before reporting
    end = time.monotonic() + 0.5
    while time.monotonic() < end:
        rclpy.spin_once(node, timeout_sec=0.02)
    with engine._lock:
        events = list(engine.events)
    report = {
        "events": events,
        "counts": node.snapshot().counts,
        "drops": node.drops.snapshot(),
    }
    node.shutdown()
    node.destroy_node()
    rclpy.shutdown()
    stop.set()
    server.join(timeout=10)
    print(json.dumps(report), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
