"""A world-action model's training episodes from a robot's rosbag2 bags (MCAP or sqlite3),
read through a mapping file (``physis_ros.train.bag_mapping``) onto the model's contract.

Each bag is read whole: the camera, the commands, and the topics the contract's inputs need
(a bag that lacks one, or has it with another type, is refused, naming it). The camera is
brought to the model's frame rate; each frame is paired with the nearest sample of each
sensor within the mapping's ``slop_s`` and with the newest task message (at most ``slop_s``
after it); between two frames come the contract's action rows at its rate, each the command
in force at its time (the newest stamped before it). A bag becomes one episode or
several: an episode ends where the camera pauses (more than 1.5 frame periods), where a frame
cannot be paired (counted by reason) and where the task values change (a new goal, a new
episode). An episode holds what a training window reads of a simulated one
(``physis_ros.sim.base.Episode``: frames, the named state per frame, rows, task values);
no row counts as perturbed. Messages that cannot be used are counted by topic and reason
(``BagReport``).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from tqdm import tqdm

from physis_ros.contract.model import WRENCH_KEYS, WamContract
from physis_ros.eval.bag import (
    COMMAND_TYPE,
    IMAGE_TYPES,
    JOINT_STATE_TYPE,
    WRENCH_TYPE,
    BagReadError,
    decode_image,
    open_bag,
    pick_topic,
    read_messages,
    sorted_unique,
    stamp_ns,
)
from physis_ros.eval.images import ImageDecodeError, resize_rgb
from physis_ros.train.bag_mapping import BagMapping
from physis_ros.train.data import find_bags

POINT_TYPE = "geometry_msgs/msg/PointStamped"
MAX_GAP_PERIODS = 1.5
"""A camera pause longer than this many frame periods (a dropped frame) ends an episode."""


@dataclass
class RecordedEpisode:
    """One episode cut from a bag, in the fields a training window reads."""

    frames: np.ndarray
    """[N, H, W, 3] uint8 at the model's image size, one per frame period."""
    state: np.ndarray
    """[N, S] float32 the contract's robot inputs (columns ``state_names``) at each frame."""
    state_names: tuple[str, ...]
    rows: np.ndarray
    """[rows_per_frame * (N - 1) + 1, A] float32 commands in the action order; row
    rows_per_frame * n is frame n's time."""
    perturbed: np.ndarray
    """[M] bool, all False: every recorded row is trained on."""
    task_values: dict[str, float]
    source: str
    """The bag and the frames the episode spans."""
    reached_s: None = None
    """Whether a recorded episode reached its goal is not known."""

    def values(self, names) -> np.ndarray:
        return self.state[:, [self.state_names.index(n) for n in names]]


@dataclass
class BagReport:
    """What reading the bags gave, and everything that could not be used."""

    bags: int = 0
    episodes: int = 0
    frames: int = 0
    refused: list[str] = field(default_factory=list)
    """Bags not used at all, each with the reason."""
    skipped_messages: Counter = field(default_factory=Counter)
    """(topic, reason) -> messages that could not be used."""
    unpaired_frames: Counter = field(default_factory=Counter)
    """reason -> camera frames (at the model's rate) left out of every episode."""
    short_episodes: int = 0
    """Episodes too short for one training window, left out."""

    def as_dict(self) -> dict:
        return {
            "bags": self.bags,
            "episodes": self.episodes,
            "frames": self.frames,
            "refused": self.refused,
            "skipped_messages": {
                f"{t}: {r}": n for (t, r), n in sorted(self.skipped_messages.items())
            },
            "unpaired_frames": dict(sorted(self.unpaired_frames.items())),
            "short_episodes": self.short_episodes,
        }

    def lines(self) -> list[str]:
        """What a user is told after reading."""
        out = [f"{self.bags} bags: {self.episodes} episodes, {self.frames} frames"]
        out += [f"refused {why}" for why in self.refused]
        for (topic, reason), n in sorted(self.skipped_messages.items()):
            out.append(f"{n} messages of {topic} not used: {reason}")
        for reason, n in sorted(self.unpaired_frames.items()):
            out.append(f"{n} frames not used: {reason}")
        if self.short_episodes:
            out.append(f"{self.short_episodes} episodes shorter than a training window not used")
        return out


class _Unusable(Exception):
    """A message that cannot be used; its text is the reason counted."""


@dataclass(frozen=True)
class _Stream:
    """One topic the contract needs: what its messages must be and what is taken of them."""

    name: str
    """``camera``, ``command``, ``joint_states``, ``wrench``, ``object:<name>``, ``task``."""
    topic: str
    types: tuple[str, ...]
    what: str


def _streams(mapping: BagMapping, contract: WamContract) -> list[_Stream]:
    """The topics a bag must have for ``contract``, by the mapping's names."""
    sources = {s.source for s in contract.robot_state}
    streams = [
        _Stream("camera", mapping.camera, IMAGE_TYPES, "camera image"),
        _Stream("command", mapping.command.topic, (COMMAND_TYPE,), "commanded joint targets"),
    ]
    if sources & {"joint_position", "joint_velocity"}:
        streams.append(
            _Stream("joint_states", mapping.joint_states, (JOINT_STATE_TYPE,), "joint states")
        )
    if "wrench" in sources:
        streams.append(_Stream("wrench", mapping.wrench, (WRENCH_TYPE,), "wrench"))
    for name in contract.objects:
        streams.append(_Stream(f"object:{name}", mapping.objects[name], (POINT_TYPE,), name))
    if contract.task_names:
        streams.append(_Stream("task", mapping.task.topic, (POINT_TYPE,), "task values"))
    return streams


class _Decoder:
    """A needed topic's message to what is kept of it: the image at the model's size, the
    command's positions in the action order, a sensor's values (the joint inputs' columns,
    the six wrench values, a point's x, y, z); ``_Unusable`` says why not."""

    def __init__(self, mapping: BagMapping, contract: WamContract, image_size) -> None:
        self.mapping, self.image_size = mapping, image_size
        self.joint_columns = [
            (s.source, s.key)
            for s in contract.robot_state
            if s.source in ("joint_position", "joint_velocity")
        ]

    def __call__(self, stream: str, msgtype: str, msg) -> np.ndarray:
        if stream == "camera":
            try:
                rgb = decode_image(msg, msgtype)
            except ImageDecodeError as err:
                raise _Unusable(err.reason) from None
            return resize_rgb(rgb, *self.image_size)
        if stream == "command":
            return self._command(msg)
        if stream == "joint_states":
            values = self._joints(msg)
        elif stream == "wrench":
            f, t = msg.wrench.force, msg.wrench.torque
            values = np.array([f.x, f.y, f.z, t.x, t.y, t.z], np.float64)
        else:  # an object's position or the task's point
            values = np.array([msg.point.x, msg.point.y, msg.point.z], np.float64)
        if not np.isfinite(values).all():
            raise _Unusable("nonfinite_values")
        return values

    def _command(self, msg) -> np.ndarray:
        if not msg.points:
            raise _Unusable("empty_command")
        names = list(msg.joint_names)
        positions = msg.points[0].positions
        out = []
        for joint in self.mapping.command.joints:
            if joint not in names or names.index(joint) >= len(positions):
                raise _Unusable(f"missing_joint {joint}")
            out.append(positions[names.index(joint)])
        values = np.asarray(out, np.float64)
        if not np.isfinite(values).all():
            raise _Unusable("nonfinite_command")
        return values

    def _joints(self, msg) -> np.ndarray:
        names = list(msg.name)
        out = []
        for source, joint in self.joint_columns:
            field_values = msg.position if source == "joint_position" else msg.velocity
            if joint not in names:
                raise _Unusable(f"missing_joint {joint}")
            if names.index(joint) >= len(field_values):
                raise _Unusable(f"missing_{source.removeprefix('joint_')}")
            out.append(field_values[names.index(joint)])
        return np.asarray(out, np.float64)


def read_bag_streams(
    path: Path, mapping: BagMapping, contract: WamContract, *, image_size, skipped: Counter
) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """stream name -> (stamps [n] int64 ns, values [n, ...]) of bag ``path``, ordered by stamp
    (a repeated stamp kept once); BagReadError (naming the topic) when the bag lacks a topic
    the contract needs or has it with another type."""
    streams = _streams(mapping, contract)
    decode = _Decoder(mapping, contract, image_size)
    with open_bag(path) as reader:
        conns = {}
        for stream in streams:
            conn, why = pick_topic(reader.connections, stream.topic, stream.types, stream.what)
            if conn is None:
                raise BagReadError(f"{path}: {why}")
            conns[conn.id] = (stream.name, conn)
        series: dict[str, list] = {s.name: [] for s in streams}

        def damaged(_err: Exception) -> None:
            skipped[(mapping.camera, "unreadable_rest_of_bag")] += 1

        picked = [conn for _, conn in conns.values()]
        for conn, msg in read_messages(reader, picked, skipped, damaged):
            name = conns[conn.id][0]
            try:
                series[name].append((stamp_ns(msg), decode(name, conn.msgtype, msg)))
            except _Unusable as why:
                skipped[(conn.topic, str(why))] += 1
    out = {}
    for stream in streams:
        if not series[stream.name]:
            raise BagReadError(
                f"{path}: topic {stream.topic} ({stream.what}) has no usable message"
            )
        stamps, values, dup = sorted_unique(series[stream.name])
        if dup:
            skipped[(stream.topic, "duplicate_stamp")] += dup
        out[stream.name] = (stamps, values)
    return out


@dataclass(frozen=True, kw_only=True)
class Timing:
    """The model's clock: frames per second and action rows per frame."""

    frame_hz: float
    rows_per_frame: int
    min_frames: int
    """Frames one training window spans: a shorter episode is not used."""


def _frame_picks(stamps: np.ndarray, frame_hz: float, path: Path) -> np.ndarray:
    """Indices of the camera frames kept at ``frame_hz`` (BagReadError when the camera's
    rate cannot be brought to it): about every stride-th frame, robust to a dropped one."""
    if len(stamps) < 2:
        return np.arange(len(stamps))
    camera_hz = 1e9 / float(np.median(np.diff(stamps)))
    stride = max(1, round(camera_hz / frame_hz))
    if abs(camera_hz / stride - frame_hz) > 0.1 * frame_hz:
        raise BagReadError(
            f"{path}: camera at {camera_hz:.2f} Hz cannot be brought to the model's {frame_hz} Hz"
        )
    least_ns = (stride - 0.5) * 1e9 / camera_hz
    picks = [0]
    for i in range(1, len(stamps)):
        if stamps[i] - stamps[picks[-1]] >= least_ns:
            picks.append(i)
    return np.asarray(picks)


def _nearest(stamps: np.ndarray, times: np.ndarray, slop_ns: float) -> np.ndarray:
    """[len(times)] index of the sample nearest each time, -1 where none is within slop."""
    right = np.clip(np.searchsorted(stamps, times), 0, len(stamps) - 1)
    left = np.clip(right - 1, 0, len(stamps) - 1)
    pick = np.where(np.abs(stamps[left] - times) <= np.abs(stamps[right] - times), left, right)
    return np.where(np.abs(stamps[pick] - times) <= slop_ns, pick, -1)


def _state_columns(contract: WamContract) -> list[tuple[str, int]]:
    """Per robot input of the contract: (stream, column of that stream's values)."""
    joint = 0
    out = []
    for s in contract.robot_state:
        if s.source in ("joint_position", "joint_velocity"):
            out.append(("joint_states", joint))
            joint += 1
        elif s.source == "wrench":
            out.append(("wrench", WRENCH_KEYS.index(s.key)))
        else:
            out.append((f"object:{s.object_name}", "xyz".index(s.key[-1])))
    return out


def _pair_frames(series, contract: WamContract, mapping: BagMapping, times: np.ndarray, report):
    """(usable [N] bool, state [N, S], task [N, T]) of the frames at ``times``; each unusable
    frame counted by its first reason."""
    n = len(times)
    usable = np.ones(n, bool)
    slop_ns = mapping.slop_s * 1e9

    def drop(bad: np.ndarray, reason: str) -> None:
        count = int((bad & usable).sum())
        if count:
            report.unpaired_frames[reason] += count
        usable[bad] = False

    drop(times <= series["command"][0][0], "before the first command")
    state = np.zeros((n, len(contract.robot_state)), np.float32)
    for i, (stream, column) in enumerate(_state_columns(contract)):
        stamps, values = series[stream]
        idx = _nearest(stamps, times, slop_ns)
        topic = _topic_of(stream, mapping)
        drop(idx < 0, f"no {topic} message within slop_s ({mapping.slop_s} s)")
        state[:, i] = values[np.maximum(idx, 0), column]
    task = np.zeros((n, 0))
    if "task" in series:
        stamps, values = series["task"]
        idx = np.searchsorted(stamps, times + slop_ns, side="right") - 1
        drop(idx < 0, "before the first task message")
        task = values[np.maximum(idx, 0)]
    return usable, state, task


def _topic_of(stream: str, mapping: BagMapping) -> str:
    if stream.startswith("object:"):
        return mapping.objects[stream.removeprefix("object:")]
    return getattr(mapping, stream)


def _runs(keep: np.ndarray, breaks: np.ndarray) -> list[tuple[int, int]]:
    """[start, end) of each run of kept frames; ``breaks[i]``: frame i starts a new run."""
    runs, start = [], None
    for i, ok in enumerate(keep):
        if start is not None and (not ok or breaks[i]):
            runs.append((start, i))
            start = None
        if ok and start is None:
            start = i
    if start is not None:
        runs.append((start, len(keep)))
    return runs


def bag_episodes(
    path: Path, mapping: BagMapping, contract: WamContract, timing: Timing, *, image_size, report
) -> list[RecordedEpisode]:
    """The episodes of one bag (module docstring); what is left out goes to ``report``."""
    series = read_bag_streams(
        path, mapping, contract, image_size=image_size, skipped=report.skipped_messages
    )
    frame_stamps, frames = series["camera"]
    picks = _frame_picks(frame_stamps, timing.frame_hz, path)
    times, frames = frame_stamps[picks], frames[picks]
    usable, state, task = _pair_frames(series, contract, mapping, times, report)
    period_ns = 1e9 / timing.frame_hz
    breaks = np.zeros(len(times), bool)
    breaks[1:] = np.diff(times) > MAX_GAP_PERIODS * period_ns
    breaks[1:] |= np.abs(np.diff(task, axis=0)).max(axis=1, initial=0.0) > 1e-9
    names = mapping.task.names if mapping.task else ()
    episodes = []
    for start, end in _runs(usable, breaks):
        if end - start < timing.min_frames:
            report.short_episodes += 1
            continue
        values = dict(zip(names, map(float, task[start]), strict=False))  # x, y (, z)
        episodes.append(
            RecordedEpisode(
                frames=frames[start:end],
                state=state[start:end],
                state_names=tuple(s.name for s in contract.robot_state),
                rows=_rows(series["command"], times[start:end], timing.rows_per_frame),
                perturbed=np.zeros(timing.rows_per_frame * (end - start - 1) + 1, bool),
                task_values={k: values[k] for k in contract.task_names},
                source=f"{path} frames {picks[start]}..{picks[end - 1]}",
            )
        )
    return episodes


def _rows(commands, times: np.ndarray, rows_per_frame: int) -> np.ndarray:
    """[R (N - 1) + 1, A] float32: the command in force at each row's time (the newest
    stamped strictly before it: a command is applied after its stamp, as
    ``eval.bag.Episode.actions_for_chunk`` pairs them), R rows from each frame's time to the
    next one's."""
    stamps, values = commands
    steps = np.arange(rows_per_frame)
    between = times[:-1, None] + (np.diff(times)[:, None] * steps) // rows_per_frame
    row_times = np.concatenate([between.reshape(-1), times[-1:]])
    idx = np.searchsorted(stamps, row_times, side="left") - 1
    return values[np.maximum(idx, 0)].astype(np.float32)


def read_bags(
    paths: list[str | Path],
    mapping: BagMapping,
    contract: WamContract,
    timing: Timing,
    *,
    image_size: tuple[int, int],
    progress: bool = True,
) -> tuple[list[RecordedEpisode], BagReport]:
    """The episodes of every bag under ``paths`` and the report of what was left out;
    ValueError (with every bag's reason) when none gives an episode."""
    # tqdm: an optional dependency (the ``eval`` extra), only for the progress bar

    report = BagReport()
    episodes: list[RecordedEpisode] = []
    for bag in tqdm(find_bags(paths), desc="reading bags", unit="bag", disable=not progress):
        report.bags += 1
        try:
            episodes += bag_episodes(
                bag, mapping, contract, timing, image_size=image_size, report=report
            )
        except BagReadError as err:
            report.refused.append(str(err))
    report.episodes = len(episodes)
    report.frames = sum(len(e.frames) for e in episodes)
    if not episodes:
        raise ValueError(
            f"no usable episode in the bags under {[str(p) for p in paths]}: "
            + "; ".join(report.lines()[1:] or ["no bag found"])
        )
    return episodes, report
