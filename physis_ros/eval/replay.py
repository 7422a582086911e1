"""``physis-replay BAG``: publish a bag's topics into live ROS 2 at the recorded timing.

The ``ros2 bag play`` this machine lacks: messages are published as the raw CDR bytes the bag
holds (no deserialisation), paced by the bag's receive times (scaled by ``--rate``). By default
header stamps are shifted so that the first message carries "now" (ROS wall clock) and the
spacing is kept — nodes that drop stale observations accept a replay; ``--keep-stamps``
publishes them as recorded. The only module of physis_ros.eval that imports rclpy.

The command runs the replay in a child process of its own and reads its result (one JSON
line) before the child tears ROS down: Fast DDS can deadlock in that teardown (a node
destroyed while a peer participant leaves; seen once in CI, the main thread stuck in
``destroy_node`` holding the GIL, so no thread of that process can time it out). A child
whose teardown outlasts ``TEARDOWN_TIMEOUT_S`` is killed, said so, and the replay's result
stands.
"""

from __future__ import annotations

import argparse
import importlib
import json
import signal
import struct
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from physis_ros.children import stop_child
from physis_ros.cli_errors import RuntimeFailure, cli_main, finite_float

HEADER_TYPE = "std_msgs/msg/Header"
ACK_TIMEOUT_S = 5.0
"""At the end, the longest wait for subscribers to acknowledge what was published."""
DISCOVERY_SETTLE_S = 0.5
"""After every publisher has seen its subscriber: discovery is two-sided, and a subscriber
that has not yet matched the publisher drops what comes first (seen once on a loaded host:
the first image of a replay lost), so replay waits this long more before it starts."""
TEARDOWN_TIMEOUT_S = 20.0
"""After the replay's result: the longest wait for its process to destroy its node and end."""
WORKER_FLAG = "--ros-worker"
"""The child process's flag: replay, print the result line, then tear ROS down."""


@dataclass
class ReplayStats:
    published: dict[str, int] = field(default_factory=dict)
    skipped: dict[str, int] = field(default_factory=dict)
    """'topic: reason' -> messages not published."""
    late_ms_max: float = 0.0
    """Largest delay of a publish behind its scheduled time."""
    wall_s: float = 0.0
    unacknowledged: list[str] = field(default_factory=list)
    """Reliable topics whose last messages no subscriber acknowledged within ACK_TIMEOUT_S."""
    unheard: dict[str, str] = field(default_factory=dict)
    """Topic -> why nothing listened to it (no subscriber after the wait; the remap that
    would reach a subscriber of the same type, where one exists)."""

    def skip(self, topic: str, reason: str) -> bool:
        """Counts a message not published; True the first time for this topic and reason."""
        key = f"{topic}: {reason}"
        self.skipped[key] = self.skipped.get(key, 0) + 1
        return self.skipped[key] == 1


def checked_message(raw: bytes, cls) -> str:
    """Why ``raw`` is not a usable message of ``cls`` ("" when it is): it must deserialise
    (a truncated or garbled record would reach every subscriber as garbage or fail in it),
    and an image's data must be step x height bytes."""
    from rclpy._rclpy_pybind11 import RMWError
    from rclpy.serialization import deserialize_message

    try:
        msg = deserialize_message(raw, cls)
    except RMWError as err:
        return f"corrupt message ({' '.join(str(err).split())[:120]})"
    if cls.__name__ == "Image" and len(msg.data) != msg.step * msg.height:
        return f"image of {len(msg.data)} bytes for step {msg.step} x height {msg.height}"
    return ""


def _remap_hint(node, topic: str, msgtype: str) -> str:
    """Why no one subscribes to ``topic``, with the remap to a subscribed topic of the same
    type where one exists (e.g. a bag's /camera/image_raw vs the bridge's /camera/image)."""
    candidates = sorted(
        name
        for name, types in node.get_topic_names_and_types()
        if msgtype in types and name != topic and node.count_subscribers(name) > 0
    )
    if candidates:
        return (
            f"no subscriber; {', '.join(candidates)} has one for {msgtype}: "
            f"--remap {topic}:={candidates[0]}"
        )
    return "no subscriber (is the consumer running, in this ROS_DOMAIN_ID?)"


def message_class(msgtype: str):
    """The generated Python class of ``pkg/msg/Name`` (ImportError/AttributeError if absent)."""
    pkg, kind, name = msgtype.split("/")
    return getattr(importlib.import_module(f"{pkg}.{kind}"), name)


def restamp(raw: bytes, offset_ns: int) -> bytes:
    """CDR of a message whose first field is a std_msgs/Header, with the stamp moved by
    ``offset_ns``. Layout: 4-byte encapsulation (byte 1: 0 big-, 1 little-endian), then
    stamp.sec int32 and stamp.nanosec uint32 at offsets 4 and 8."""
    if len(raw) < 12:
        raise ValueError(f"message of {len(raw)} bytes is too short to carry a header")
    endian = "<" if raw[1] & 1 else ">"
    sec, nsec = struct.unpack_from(f"{endian}iI", raw, 4)
    total = sec * 1_000_000_000 + nsec + offset_ns
    if total < 0:
        raise ValueError("restamped time would be negative")
    sec, nsec = divmod(total, 1_000_000_000)
    if sec > 2**31 - 1:
        raise ValueError("restamped time overflows int32 seconds")
    out = bytearray(raw)
    struct.pack_into(f"{endian}iI", out, 4, sec, nsec)
    return bytes(out)


def _has_header(store, msgtype: str) -> bool:
    try:
        fields = store.get_msgdef(msgtype).fields
    except KeyError:
        return False
    return bool(fields) and fields[0][1][1] == HEADER_TYPE


def replay(
    bag: Path,
    *,
    rate: float = 1.0,
    topics: list[str] | None = None,
    remap: dict[str, str] | None = None,
    keep_stamps: bool = False,
    wait_subscribers_s: float = 0.0,
    reliable: bool = False,
    loops: int = 1,
    on_warning=lambda text: None,
    on_finished=lambda stats: None,
) -> ReplayStats:
    """Publish ``bag`` once (or ``loops`` times); returns what was published and skipped.
    ``on_warning(text)`` hears each problem as it is found (a topic nobody subscribes to,
    the first message of each kind that is skipped); ``on_finished(stats)`` hears the result
    before the node is destroyed."""
    # ROS and the bag reader only here, in the worker process: the supervising command (and
    # restamp) run without them
    import rclpy
    from rosbags.rosbag2 import Reader

    if not rate > 0:
        raise ValueError(f"rate must be > 0, got {rate}")
    stats = ReplayStats()
    remap = remap or {}
    with Reader(bag) as reader:
        conns = [c for c in reader.connections if topics is None or c.topic in topics]
        if topics:
            missing = sorted(set(topics) - {c.topic for c in reader.connections})
            for t in missing:
                stats.skipped[f"{t}: not in the bag"] = 0
        # Not sys.argv: rcl reads an argument like our --remap's FROM:=TO as a (deprecated)
        # ROS remap rule of its own, warns, and applies it to every name of the process.
        rclpy.init(args=[])
        node = rclpy.create_node("physis_replay")
        try:
            outlets = _Outlets.create(node, conns, remap, reliable, stats)
            if wait_subscribers_s:
                _wait_for_subscribers(
                    node,
                    outlets,
                    remap=remap,
                    wait_s=wait_subscribers_s,
                    stats=stats,
                    on_warning=on_warning,
                )
            t0 = time.monotonic()
            for _ in range(loops):
                _play_once(
                    reader,
                    outlets,
                    rate=rate,
                    keep_stamps=keep_stamps,
                    stats=stats,
                    on_warning=on_warning,
                )
            stats.wall_s = time.monotonic() - t0
            _wait_for_acknowledgements(outlets, stats)
            on_finished(stats)
        finally:
            node.destroy_node()
            rclpy.try_shutdown()
    return stats


@dataclass
class _Outlets:
    """The bag's connections that have a publisher, with what publishing them needs."""

    conns: list
    """The connections, in the bag's order."""
    pubs: dict[int, object]
    """Connection id -> its publisher."""
    classes: dict[int, type]
    """Connection id -> the message class its records must deserialise to."""
    headers: dict[int, bool]
    """Connection id -> whether its messages start with a std_msgs/Header (restamped)."""
    by_topic: dict[str, object]
    """Bag topic -> its publisher."""

    @classmethod
    def create(cls, node, conns: list, remap: dict, reliable: bool, stats: ReplayStats):
        """A publisher per connection whose message type has a Python class (the others are
        counted as skipped), on its topic as remapped."""
        # ROS in the worker process only, as in replay()
        from rclpy.qos import QoSProfile, ReliabilityPolicy, qos_profile_sensor_data

        from physis_ros.sim.record import typestore

        store = typestore()
        qos = (
            QoSProfile(depth=10, reliability=ReliabilityPolicy.RELIABLE)
            if reliable
            else qos_profile_sensor_data
        )
        out = cls(conns=[], pubs={}, classes={}, headers={}, by_topic={})
        for c in conns:
            try:
                msg_cls = message_class(c.msgtype)
            except (ImportError, AttributeError, ValueError):
                stats.skipped[f"{c.topic}: no Python class for {c.msgtype}"] = c.msgcount
                continue
            out.pubs[c.id] = node.create_publisher(msg_cls, remap.get(c.topic, c.topic), qos)
            out.by_topic[c.topic] = out.pubs[c.id]
            out.headers[c.id] = _has_header(store, c.msgtype)
            out.classes[c.id] = msg_cls
            out.conns.append(c)
        return out


def _wait_for_subscribers(
    node, outlets: _Outlets, *, remap: dict, wait_s: float, stats: ReplayStats, on_warning
) -> None:
    """Waits up to ``wait_s`` for every publisher to have a subscriber (then
    DISCOVERY_SETTLE_S more); each topic still unheard is said, with the remap that would
    reach a subscriber."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if all(p.get_subscription_count() > 0 for p in outlets.pubs.values()):
            time.sleep(DISCOVERY_SETTLE_S)
            break
        time.sleep(0.02)
    for c in outlets.conns:
        if outlets.pubs[c.id].get_subscription_count() == 0:
            name = remap.get(c.topic, c.topic)
            stats.unheard[name] = _remap_hint(node, name, c.msgtype)
            on_warning(f"{name}: {stats.unheard[name]}")


def _play_once(
    reader, outlets: _Outlets, *, rate: float, keep_stamps: bool, stats: ReplayStats, on_warning
) -> None:
    """One pass over the bag: each message published at its receive time (scaled by
    ``rate``) after the first's, restamped unless ``keep_stamps``; a message that is not
    usable or fails to publish is counted in ``stats.skipped``."""
    # ROS in the worker process only, as in replay()
    from rclpy._rclpy_pybind11 import RCLError

    start_wall = time.monotonic()
    first_log_ns = None
    offset_ns = None
    for c, log_ns, raw in reader.messages(connections=outlets.conns):
        if first_log_ns is None:
            first_log_ns = log_ns
            offset_ns = time.time_ns() - log_ns
        due = start_wall + (log_ns - first_log_ns) / 1e9 / rate
        delay = due - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        else:
            stats.late_ms_max = max(stats.late_ms_max, -delay * 1e3)
        data = bytes(raw)
        why = checked_message(data, outlets.classes[c.id])
        if why:
            if stats.skip(c.topic, why):
                on_warning(f"{c.topic}: skipped a message: {why}")
            continue
        if outlets.headers[c.id] and not keep_stamps:
            try:
                data = restamp(data, offset_ns)
            except ValueError as err:
                if stats.skip(c.topic, str(err)):
                    on_warning(f"{c.topic}: skipped a message: {err}")
                continue
        try:
            outlets.pubs[c.id].publish(data)
        except RCLError as err:  # reliable publish under overload: count it, go on
            key = f"{c.topic}: publish failed ({err})"
            stats.skipped[key] = stats.skipped.get(key, 0) + 1
            continue
        stats.published[c.topic] = stats.published.get(c.topic, 0) + 1


def _wait_for_acknowledgements(outlets: _Outlets, stats: ReplayStats) -> None:
    """Waits up to ACK_TIMEOUT_S per topic for its subscribers to acknowledge what was
    published; the topics whose were not are listed in ``stats.unacknowledged``."""
    # ROS in the worker process only, as in replay()
    from rclpy.duration import Duration

    # Destroying a reliable writer drops what its readers have not acknowledged yet:
    # the last tick's messages were lost that way (1 in 2 test runs on a loaded host).
    for topic, pub in outlets.by_topic.items():
        if not pub.wait_for_all_acked(Duration(seconds=ACK_TIMEOUT_S)):
            stats.unacknowledged.append(topic)


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="physis-replay", description=__doc__.split("\n\n")[0])
    parser.add_argument("bag", type=Path, help="rosbag2 folder, or a .mcap / .db3 file")
    parser.add_argument(
        "--rate", type=finite_float, default=1.0, help="speed factor (2: twice as fast)"
    )
    parser.add_argument("--topics", nargs="*", default=None, help="only these topics")
    parser.add_argument("--remap", nargs="*", default=[], help="FROM:=TO topic remaps")
    parser.add_argument(
        "--keep-stamps", action="store_true", help="publish header stamps as recorded"
    )
    parser.add_argument(
        "--wait-subscribers-s",
        type=finite_float,
        default=2.0,
        help="wait this long for a subscriber on every topic",
    )
    parser.add_argument(
        "--reliable", action="store_true", help="reliable QoS (default: sensor data, best effort)"
    )
    parser.add_argument("--loop", type=int, default=1, help="play the bag this many times")
    parser.add_argument(WORKER_FLAG, action="store_true", help=argparse.SUPPRESS)
    return parser


def _result_line(stats: ReplayStats) -> str:
    return json.dumps(
        {
            "published": stats.published,
            "skipped": stats.skipped,
            "late_ms_max": round(stats.late_ms_max, 3),
            "wall_s": round(stats.wall_s, 3),
            "unacknowledged": stats.unacknowledged,
            "unheard": stats.unheard,
        }
    )


def _worker(parser: argparse.ArgumentParser, args: argparse.Namespace, remap: dict) -> int:
    """The child: replay, print the result line (flushed, before the node is destroyed)."""

    def finished(stats: ReplayStats) -> None:
        print(_result_line(stats), flush=True)

    try:
        replay(
            args.bag,
            rate=args.rate,
            topics=args.topics,
            remap=remap,
            keep_stamps=args.keep_stamps,
            wait_subscribers_s=args.wait_subscribers_s,
            reliable=args.reliable,
            loops=args.loop,
            on_warning=lambda text: print(f"physis-replay: warning: {text}", file=sys.stderr),
            on_finished=finished,
        )
    except ValueError as err:
        parser.error(str(err))
    except KeyboardInterrupt:
        return 130  # stopped by the command, which says so
    return 0


def supervise(cmd: list[str], teardown_timeout_s: float = TEARDOWN_TIMEOUT_S) -> tuple[int, str]:
    """Runs the worker ``cmd`` (its stderr passes through): (its exit status, its result
    line, "" when it printed none). A worker that has printed its result and does not end
    within ``teardown_timeout_s`` is killed and counts as done (status 0)."""
    child = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    try:
        line = child.stdout.readline().strip()
        try:
            return child.wait(teardown_timeout_s if line else None), line
        except subprocess.TimeoutExpired:
            print(
                f"physis-replay: warning: the replay finished, but its ROS teardown did not "
                f"end within {teardown_timeout_s:g} s (a middleware hang); stopped it",
                file=sys.stderr,
                flush=True,
            )
            # SIGKILL at once: a process stuck in a C call that holds the GIL never runs the
            # Python handler a SIGTERM would need
            child.kill()
            child.wait()
            return 0, line
    finally:  # Ctrl-C or SIGTERM here: the worker goes too (it destroys its node on SIGTERM)
        stop_child(child, timeout_s=TEARDOWN_TIMEOUT_S)
        child.stdout.close()


@cli_main("physis-replay")
def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = _parser()
    args = parser.parse_args(argv)
    remap = {}
    for item in args.remap:
        if ":=" not in item:
            parser.error(f"--remap {item!r} is not FROM:=TO")
        src, dst = item.split(":=", 1)
        remap[src] = dst
    if not args.bag.exists():
        parser.error(f"bag {args.bag} does not exist")
    if args.loop < 1:
        parser.error(f"--loop must be >= 1, got {args.loop}")
    # SIGTERM ends the replay like Ctrl-C does (clean rclpy shutdown)
    signal.signal(signal.SIGTERM, _interrupt)
    if args.ros_worker:
        return _worker(parser, args, remap)
    status, line = supervise([sys.executable, "-m", "physis_ros.eval.replay", *argv, WORKER_FLAG])
    if not line:
        return status  # the worker failed before its result; its stderr said why
    print(line, flush=True)
    if not any(json.loads(line)["published"].values()):
        raise RuntimeFailure(
            f"nothing was published from {args.bag}",
            "see the warnings above (topics, --remap, --topics)",
        )
    return status


if __name__ == "__main__":
    sys.exit(main())
