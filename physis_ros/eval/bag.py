"""Reading recorded episodes out of rosbag2 bags (MCAP or sqlite3) with ``rosbags``.

What belongs here: opening a bag (a bag directory or a bare ``.mcap`` / ``.db3`` file),
finding its camera, command, wrench and joint-state topics by type (or by the names given),
decoding them into arrays, and counting every message it could not use with the reason; the
helpers that reading takes (``open_bag``, ``pick_topic``, ``read_messages``, ``decode_image``,
``sorted_unique``), which training's mapped reader shares. It also aligns commanded actions
to chunks — the one definition that training and evaluation share. No rclpy, no torch.

Time: stamps are the messages' header stamps (the robot's clock, ns), not the bag's receive
times, so replays and recordings on another host line up.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from physis_ros.eval.images import ImageDecodeError, decode_compressed, decode_raw, resize_rgb

IMAGE_TYPES = ("sensor_msgs/msg/Image", "sensor_msgs/msg/CompressedImage")
COMMAND_TYPE = "trajectory_msgs/msg/JointTrajectory"
WRENCH_TYPE = "geometry_msgs/msg/WrenchStamped"
JOINT_STATE_TYPE = "sensor_msgs/msg/JointState"


class BagReadError(Exception):
    """A bag that cannot be evaluated at all (unreadable, or a required topic missing)."""


@dataclass(frozen=True, kw_only=True)
class TopicChoice:
    """Topic names to read; None: the first topic of the right type in the bag."""

    image: str | None = None
    command: str | None = None
    wrench: str | None = None
    joint_state: str | None = None


@dataclass
class Episode:
    """One bag's data as arrays, plus what was skipped and why."""

    path: str
    storage: str
    image_topic: str
    frames: np.ndarray
    """[N, H, W, 3] uint8 RGB, in stamp order."""
    frame_stamps_ns: np.ndarray
    """[N] int64 header stamps of the frames."""
    source_size: tuple[int, int]
    """(height, width) of the images in the bag, before any resize."""
    command_topic: str | None = None
    joint_names: tuple[str, ...] = ()
    commands: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), np.float32))
    """[M, A] float32 commanded joint position targets (rad)."""
    command_stamps_ns: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    wrench: np.ndarray = field(default_factory=lambda: np.zeros((0, 6), np.float32))
    wrench_stamps_ns: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    joint_positions: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), np.float32))
    joint_stamps_ns: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    skipped: Counter = field(default_factory=Counter)
    """(topic, reason) -> messages skipped."""
    notes: list[str] = field(default_factory=list)
    """Human-readable notes: missing optional topics, resizes, dropped duplicates."""

    @property
    def frame_hz(self) -> float:
        if len(self.frame_stamps_ns) < 2:
            return 0.0
        return 1e9 / float(np.median(np.diff(self.frame_stamps_ns)))

    @property
    def has_commands(self) -> bool:
        return len(self.command_stamps_ns) > 0

    def subsample(self, stride: int) -> Episode:
        """Every ``stride``-th frame (commands and sensors untouched)."""
        if stride < 1:
            raise ValueError(f"stride must be >= 1, got {stride}")
        if stride == 1:
            return self
        out = dataclasses.replace(
            self, frames=self.frames[::stride], frame_stamps_ns=self.frame_stamps_ns[::stride]
        )
        out.notes = [*self.notes, f"frames subsampled by {stride} to {out.frame_hz:.2f} Hz"]
        return out

    def actions_for_chunk(
        self, first_frame: int, frames_per_chunk: int, horizon: int
    ) -> np.ndarray:
        """[horizon, A] commands that drive the chunk of frames [first_frame, first_frame + F).

        Action j is the newest command stamped strictly before time
        t(first_frame - 1) + (j + 1) / horizon * (t(first_frame + F - 1) - t(first_frame - 1)):
        with horizon == F, action j is the command in force just before frame first_frame + j
        was captured. Before the first command, the first command is used.
        """
        if not self.has_commands:
            raise BagReadError(f"{self.path}: no commanded actions in the bag")
        stamps = self.frame_stamps_ns
        period = int(np.median(np.diff(stamps))) if len(stamps) > 1 else 0
        last = first_frame + frames_per_chunk - 1
        if last >= len(stamps):
            raise IndexError(f"chunk ends at frame {last}, the episode has {len(stamps)}")
        t_prev = stamps[first_frame - 1] if first_frame > 0 else stamps[0] - period
        t_last = stamps[last]
        times = t_prev + (np.arange(1, horizon + 1) / horizon) * (t_last - t_prev)
        idx = (
            np.searchsorted(self.command_stamps_ns, np.round(times).astype(np.int64), side="left")
            - 1
        )
        return self.commands[np.clip(idx, 0, len(self.commands) - 1)]


def pick_topic(conns, wanted: str | None, types: tuple[str, ...], what: str):
    """(the connection of topic ``wanted``, None), or of the first topic of one of ``types``
    when ``wanted`` is None; (None, why not) when there is none, or it has another type."""
    if wanted is not None:
        match = [c for c in conns if c.topic == wanted]
        if not match:
            return None, f"topic {wanted!r} ({what}) is not in the bag"
        if match[0].msgtype not in types:
            return (
                None,
                f"topic {wanted!r} has type {match[0].msgtype}, {what} needs one of {types}",
            )
        return match[0], None
    match = sorted((c for c in conns if c.msgtype in types), key=lambda c: c.topic)
    if not match:
        return None, f"no {what} topic (type {' or '.join(types)}) in the bag"
    return match[0], None


def stamp_ns(msg) -> int:
    """A stamped message's header stamp (ns)."""
    return int(msg.header.stamp.sec) * 1_000_000_000 + int(msg.header.stamp.nanosec)


@contextmanager
def open_bag(path: Path) -> Iterator:
    """The open ``rosbags`` reader of bag ``path`` (closed on exit); BagReadError when it
    cannot be opened."""
    from rosbags.rosbag2 import Reader, ReaderError

    try:
        reader = Reader(path)
        reader.open()
    except (FileNotFoundError, ReaderError, OSError, ValueError, KeyError) as err:
        raise BagReadError(f"{path}: cannot open bag: {err}") from err
    try:
        yield reader
    finally:
        reader.close()


def read_messages(reader, conns: list, skipped: Counter, on_damage: Callable[[Exception], None]):
    """(connection, message) of ``conns`` in the bag's order, decoded; a message that does
    not decode is counted in ``skipped`` as (topic, ``corrupt_message``), and a storage file
    damaged part way ends the messages with ``on_damage(error)`` (what came before is kept)."""
    from rosbags.rosbag2 import ReaderError
    from rosbags.serde import SerdeError

    from physis_ros.sim.record import typestore

    store = typestore()
    try:
        for conn, _log_ns, raw in reader.messages(connections=conns):
            try:
                msg = store.deserialize_cdr(raw, conn.msgtype)
            except (SerdeError, ValueError, IndexError, UnicodeDecodeError):
                # counted by reason; the byte offset rosbags reports is noise to a user
                skipped[(conn.topic, "corrupt_message")] += 1
                continue
            yield conn, msg
    except (ReaderError, OSError, ValueError) as err:
        on_damage(err)


def decode_image(msg, msgtype: str) -> np.ndarray:
    """[H, W, 3] uint8 RGB of an Image or CompressedImage message; ImageDecodeError."""
    if msgtype.endswith("CompressedImage"):
        return decode_compressed(msg.data, msg.format)
    return decode_raw(
        height=msg.height,
        width=msg.width,
        encoding=msg.encoding,
        step=msg.step,
        data=msg.data,
        is_bigendian=msg.is_bigendian,
    )


@dataclass
class _Streams:
    """What ``read_episode`` keeps of each topic as it reads: (stamp, value) per message."""

    frames: list = field(default_factory=list)
    commands: list = field(default_factory=list)
    wrenches: list = field(default_factory=list)
    joints: list = field(default_factory=list)
    joint_names: tuple[str, ...] = ()
    source_size: tuple[int, int] | None = None


def read_episode(
    path: str | Path,
    *,
    topics: TopicChoice = TopicChoice(),
    image_size: tuple[int, int] | None = None,
    require_commands: bool = True,
) -> Episode:
    """Read a bag into an ``Episode``; frames resized to ``image_size`` (H, W) when given.

    Raises ``BagReadError`` when the bag cannot be opened or lacks the camera topic (or the
    command topic, when ``require_commands``). Messages that fail to decode are skipped and
    counted in ``Episode.skipped`` by (topic, reason).
    """
    path = Path(path)
    skipped: Counter = Counter()
    with open_bag(path) as reader:
        conns = reader.connections
        storage = storage_of(path)
        image_conn, why = pick_topic(conns, topics.image, IMAGE_TYPES, "camera image")
        if image_conn is None:
            raise BagReadError(f"{path}: {why}; topics: {sorted(c.topic for c in conns)}")
        cmd_conn, cmd_why = pick_topic(conns, topics.command, (COMMAND_TYPE,), "commanded action")
        if cmd_conn is None and require_commands:
            raise BagReadError(f"{path}: {cmd_why}; an action-conditioned model needs the commands")
        wrench_conn, wrench_why = pick_topic(conns, topics.wrench, (WRENCH_TYPE,), "wrench")
        joint_conn, joint_why = pick_topic(
            conns, topics.joint_state, (JOINT_STATE_TYPE,), "joint state"
        )
        notes = [f"{why} (not used by the model)" for why in (wrench_why, joint_why) if why]
        if cmd_conn is None:
            notes.append(f"{cmd_why}: action metrics skipped")
        read = _Streams()

        def damaged(err: Exception) -> None:
            notes.append(
                f"bag is damaged after {len(read.frames) + len(read.commands)} messages: {err}"
            )
            skipped[(image_conn.topic, "unreadable_rest_of_bag")] += 1

        wanted = [c for c in (image_conn, cmd_conn, wrench_conn, joint_conn) if c is not None]
        for conn, msg in read_messages(reader, wanted, skipped, damaged):
            if conn is image_conn:
                _take_image(read, conn, msg, image_size, skipped)
            elif conn is cmd_conn:
                _take_command(read, conn.topic, msg, skipped)
            elif conn is wrench_conn:
                f, t = msg.wrench.force, msg.wrench.torque
                values = np.array([f.x, f.y, f.z, t.x, t.y, t.z], np.float32)
                read.wrenches.append((stamp_ns(msg), values))
            elif conn is joint_conn:
                read.joints.append((stamp_ns(msg), np.asarray(msg.position, np.float32)))
    return _episode(
        path,
        storage,
        read,
        (image_conn.topic, cmd_conn.topic if cmd_conn else None),
        skipped=skipped,
        notes=notes,
        image_size=image_size,
        require_commands=require_commands,
    )


def _take_image(read: _Streams, conn, msg, image_size, skipped: Counter) -> None:
    try:
        rgb = decode_image(msg, conn.msgtype)
    except ImageDecodeError as err:
        skipped[(conn.topic, err.reason)] += 1
        return
    if read.source_size is None:
        read.source_size = rgb.shape[:2]
    elif rgb.shape[:2] != read.source_size and image_size is None:
        skipped[(conn.topic, "size_changed")] += 1
        return
    read.frames.append((stamp_ns(msg), resize_rgb(rgb, *image_size) if image_size else rgb))


def _take_command(read: _Streams, topic, msg, skipped: Counter) -> None:
    if not msg.points or not np.all(np.isfinite(msg.points[0].positions)):
        skipped[(topic, "empty_or_nonfinite_command")] += 1
        return
    if read.joint_names and tuple(msg.joint_names) != read.joint_names:
        skipped[(topic, "joint_names_changed")] += 1
        return
    read.joint_names = tuple(msg.joint_names)
    read.commands.append((stamp_ns(msg), np.asarray(msg.points[0].positions, np.float32)))


def _episode(
    path: Path,
    storage: str,
    read: _Streams,
    topics: tuple[str, str | None],
    *,
    skipped: Counter,
    notes: list[str],
    image_size: tuple[int, int] | None,
    require_commands: bool,
) -> Episode:
    """The ``Episode`` of what ``read_episode`` read from the (image, command) ``topics``."""
    image_topic, command_topic = topics
    if not read.frames:
        raise BagReadError(
            f"{path}: topic {image_topic} has no decodable image; skipped: {dict(skipped)}"
        )
    frame_stamps, frame_arr, dup = sorted_unique(read.frames)
    if dup:
        skipped[(image_topic, "duplicate_stamp")] += dup
    source_size = read.source_size
    if image_size and source_size and tuple(source_size) != tuple(image_size):
        notes.append(
            f"images resized from {source_size[0]}x{source_size[1]} "
            f"to {image_size[0]}x{image_size[1]}"
        )
    ep = Episode(
        path=str(path),
        storage=storage,
        image_topic=image_topic,
        frames=frame_arr,
        frame_stamps_ns=frame_stamps,
        source_size=tuple(source_size),
        skipped=skipped,
        notes=notes,
    )
    if read.commands:
        ep.command_topic = command_topic
        ep.joint_names = read.joint_names
        ep.command_stamps_ns, ep.commands, dup = sorted_unique(read.commands)
        if dup:
            skipped[(command_topic, "duplicate_stamp")] += dup
    elif require_commands:
        raise BagReadError(
            f"{path}: topic {command_topic} has no usable command; skipped: {dict(skipped)}"
        )
    if read.wrenches:
        ep.wrench_stamps_ns, ep.wrench, _ = sorted_unique(read.wrenches)
    if read.joints and len({len(j) for _, j in read.joints}) == 1:
        ep.joint_stamps_ns, ep.joint_positions, _ = sorted_unique(read.joints)
    return ep


def sorted_unique(items: list[tuple[int, np.ndarray]]) -> tuple[np.ndarray, np.ndarray, int]:
    """(stamps, stacked values, duplicates dropped), ordered by stamp, first of each stamp kept."""
    items = sorted(items, key=lambda it: it[0])
    keep = [it for i, it in enumerate(items) if i == 0 or it[0] != items[i - 1][0]]
    return (
        np.array([s for s, _ in keep], np.int64),
        np.stack([v for _, v in keep]),
        len(items) - len(keep),
    )


def storage_of(path: Path) -> str:
    if path.is_file():
        return {".mcap": "mcap", ".db3": "sqlite3"}.get(path.suffix, "unknown")
    if any(path.glob("*.mcap")):
        return "mcap"
    if any(path.glob("*.db3")):
        return "sqlite3"
    return "unknown"
