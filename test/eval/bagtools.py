"""Test helpers: record small bags and derive damaged copies of them (rosbags, no rclpy)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from physis_ros.sim.record import RecordConfig, record_episode, typestore


def record_small(path: Path, **overrides) -> Path:
    """A short episode (default 3 s, 32x32 rgb8 MCAP) recorded into ``path``."""
    cfg = dict(duration_s=3.0, image_height=32, image_width=32)
    cfg.update(overrides)
    record_episode(path, RecordConfig(**cfg))
    return path


def rewrite_bag(
    src: Path,
    dst: Path,
    *,
    storage: str = "mcap",
    drop_topics: tuple[str, ...] = (),
    edit: Callable[[str, int, bytes, object], bytes | None] | None = None,
) -> Path:
    """Copy ``src`` into a new bag ``dst``; ``edit(topic, index, raw, store)`` may replace a
    message's bytes (or drop it with None); ``drop_topics`` are left out entirely."""
    from rosbags.rosbag2 import Reader, StoragePlugin, Writer

    store = typestore()
    plugin = StoragePlugin.MCAP if storage == "mcap" else StoragePlugin.SQLITE3
    counts: dict[str, int] = {}
    with Reader(src) as reader, Writer(dst, version=9, storage_plugin=plugin) as writer:
        conns = {}
        for c in reader.connections:
            if c.topic not in drop_topics:
                conns[c.id] = writer.add_connection(c.topic, c.msgtype, typestore=store)
        for c, t, raw in reader.messages():
            if c.id not in conns:
                continue
            i = counts.get(c.topic, 0)
            counts[c.topic] = i + 1
            data = edit(c.topic, i, bytes(raw), store) if edit else bytes(raw)
            if data is not None:
                writer.write(conns[c.id], t, data)
    return dst
