"""Approximate-time pairing of a camera with wrench, joint states and a tracked object's
position, latest-only.

The camera is the pivot: each image is paired with the wrench, joint and object sample
nearest to its stamp within ``slop_s``. Auxiliary streams keep a short history (they run
faster than the camera); at most one image waits for a partner, and a newer image replaces
it (the older one is counted as ``unpaired``). Stamps must increase per stream: an older or
equal stamp is dropped as ``out_of_order_stamp``. All drops go to the shared DropCounter.
A paired observation becomes the link's ``Observation`` (``PairedObservation.observation``);
``SentImages`` keeps the recent ones' images by observation seq.
"""

from __future__ import annotations

import threading
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from physis_ros.link.client import CameraImage, Observation


@dataclass(frozen=True, kw_only=True)
class Sample:
    stamp_ns: int
    value: Any
    received_s: float
    """time.perf_counter() when the callback got it (for callback -> send latency)."""


@dataclass(frozen=True, kw_only=True)
class PairedObservation:
    image: Sample
    wrench: Sample | None
    joints: Sample | None
    objects: dict[str, Sample] = field(default_factory=dict)
    """Tracked object name -> its position sample."""

    def observation(
        self,
        seq: int,
        image,
        *,
        action: np.ndarray | None,
        timeline: tuple[np.ndarray, int, int] | None,
        state: dict[str, float] | None = None,
    ) -> Observation:
        """The link's observation ``seq`` of this pairing with ``image`` (the camera's
        ``ImageFields``, resized for the model or not), the commanded ``action``, the
        command ``timeline`` (commands, start_ns, dt_ns) and the model's named ``state``."""
        names, positions, velocities = self.joints.value if self.joints else ((), None, None)
        return Observation(
            seq=seq,
            capture_stamp_ns=self.image.stamp_ns,
            image=CameraImage(
                encoding=image.encoding,
                height=image.height,
                width=image.width,
                step=image.step,
                data=image.data,
            ),
            wrench=self.wrench.value if self.wrench else None,
            joint_names=names,
            joint_positions=positions,
            joint_velocities=velocities,
            action=action,
            commands=None if timeline is None else timeline[0],
            commands_start_ns=0 if timeline is None else timeline[1],
            commands_dt_ns=0 if timeline is None else timeline[2],
            state=state or {},
        )


class SentImages:
    """The images of the last ``kept`` observations, by their seq (numbered here, from 1);
    thread-safe (the receive thread reads what the callbacks sent)."""

    def __init__(self, kept: int) -> None:
        self._kept = kept
        self._seq = 0
        self._images: OrderedDict[int, Any] = OrderedDict()
        self._lock = threading.Lock()

    def add(self, image) -> int:
        """The next observation's seq, with its image kept."""
        with self._lock:
            self._seq += 1
            self._images[self._seq] = image
            while len(self._images) > self._kept:
                self._images.popitem(last=False)
            return self._seq

    def get(self, seq: int):
        """Observation ``seq``'s image, while it is among the recent ones (else None)."""
        with self._lock:
            return self._images.get(seq)


class ApproxTimePairer:
    """Pairs images with the nearest wrench/joint/object samples (aux streams ``wrench``,
    ``joints``, ``object:<name>`` per tracked object); thread-safe."""

    def __init__(
        self,
        *,
        slop_s: float,
        require_wrench: bool,
        require_joints: bool,
        objects: tuple[str, ...] = (),
        require_object: bool = False,
        drops,
        history: int = 64,
    ) -> None:
        if slop_s <= 0:
            raise ValueError(f"slop_s must be positive, got {slop_s}")
        if history <= 0:
            raise ValueError(f"history must be positive, got {history}")
        self._slop_ns = int(slop_s * 1e9)
        self._require = {
            "wrench": require_wrench,
            "joints": require_joints,
            **{f"object:{name}": require_object for name in objects},
        }
        self._drops = drops
        self._aux: dict[str, deque[Sample]] = {
            name: deque(maxlen=history) for name in self._require
        }
        self._last_stamp_ns: dict[str, int] = {}
        self._pending: Sample | None = None
        self._lock = threading.Lock()

    def _accept_stamp(self, stream: str, stamp_ns: int) -> bool:
        last = self._last_stamp_ns.get(stream)
        if last is not None and stamp_ns <= last:
            self._drops.add("out_of_order_stamp")
            return False
        self._last_stamp_ns[stream] = stamp_ns
        return True

    def _nearest(self, stream: str, stamp_ns: int) -> Sample | None:
        best = None
        for sample in self._aux[stream]:
            gap = abs(sample.stamp_ns - stamp_ns)
            if gap <= self._slop_ns and (best is None or gap < abs(best.stamp_ns - stamp_ns)):
                best = sample
        return best

    def _try_pair(self, image: Sample) -> PairedObservation | None:
        found = {name: self._nearest(name, image.stamp_ns) for name in self._aux}
        if any(self._require[name] and found[name] is None for name in found):
            return None
        objects = {
            name.split(":", 1)[1]: sample
            for name, sample in found.items()
            if name.startswith("object:") and sample is not None
        }
        return PairedObservation(
            image=image, wrench=found["wrench"], joints=found["joints"], objects=objects
        )

    def add_image(self, sample: Sample) -> PairedObservation | None:
        """A paired observation if one is complete now, else None (image waits or dropped)."""
        with self._lock:
            if not self._accept_stamp("image", sample.stamp_ns):
                return None
            paired = self._try_pair(sample)
            if paired is not None:
                if self._pending is not None:
                    self._drops.add("unpaired")
                    self._pending = None
                return paired
            if self._pending is not None:
                self._drops.add("unpaired")
            self._pending = sample
            return None

    def add_aux(self, stream: str, sample: Sample) -> PairedObservation | None:
        """Adds a wrench/joints/object sample; returns the waiting image if it is now
        complete."""
        with self._lock:
            if not self._accept_stamp(stream, sample.stamp_ns):
                return None
            self._aux[stream].append(sample)
            if self._pending is None:
                return None
            paired = self._try_pair(self._pending)
            if paired is not None:
                self._pending = None
                return paired
            # The waiting image can no longer be matched once the partner is past the slop.
            if sample.stamp_ns - self._pending.stamp_ns > self._slop_ns and self._require[stream]:
                self._drops.add("unpaired")
                self._pending = None
            return None

    def latest(self, stream: str) -> Sample | None:
        with self._lock:
            return self._aux[stream][-1] if self._aux[stream] else None


class CommandHistory:
    """Commanded actions by stamp, to attach the command in force when an image was taken.

    Unlike the wrench and joint states (nearest within a slop), a command is paired
    causally: the newest command stamped *strictly before* the image, because that is the
    command that moved the robot to what the image shows. It is also how the world model
    was trained (``physis_ros.eval.bag.Episode.actions_for_chunk``): in a recorded bag the
    command of a control tick carries the same stamp as that tick's image but is applied
    after it, so "at or before" would pair each frame with the command one tick later.
    Stamps must increase; an older or equal one is refused (the caller counts it).
    """

    def __init__(self, *, max_age_s: float, history: int = 256) -> None:
        if max_age_s <= 0:
            raise ValueError(f"max_age_s must be positive, got {max_age_s}")
        if history <= 0:
            raise ValueError(f"history must be positive, got {history}")
        self.max_age_ns = int(max_age_s * 1e9)
        # 256 commands: 2.5 s at the sim's 100 Hz, so an image that waited for its partners
        # still finds the command that was in force when it was taken.
        self._commands: deque[tuple[int, Any]] = deque(maxlen=history)
        self._lock = threading.Lock()

    def add(self, stamp_ns: int, value: Any) -> bool:
        """Keeps ``value`` stamped ``stamp_ns``; False (not kept) if the stamp does not increase."""
        with self._lock:
            if self._commands and stamp_ns <= self._commands[-1][0]:
                return False
            self._commands.append((stamp_ns, value))
            return True

    def newest_stamp_ns(self) -> int | None:
        """The stamp of the newest command kept (None: none yet)."""
        with self._lock:
            return self._commands[-1][0] if self._commands else None

    def before(self, image_stamp_ns: int) -> tuple[Any | None, str]:
        """(the newest command stamped before ``image_stamp_ns``, "") or (None, why not):
        ``none_before_image`` (no such command kept) or ``stale`` (older than max_age_s)."""
        with self._lock:
            for stamp_ns, value in reversed(self._commands):
                if stamp_ns < image_stamp_ns:
                    if image_stamp_ns - stamp_ns > self.max_age_ns:
                        return None, "stale"
                    return value, ""
        return None, "none_before_image"

    def on_grid(self, start_ns: int, dt_ns: int, count: int) -> np.ndarray:
        """The commands at start_ns + i * dt_ns, [count, A] float32: linear between the kept
        commands, NaN before the first and after the last one kept."""
        with self._lock:
            kept = list(self._commands)
        if not kept:
            return np.full((count, 0), np.nan, np.float32)
        stamps = np.array([s for s, _ in kept], np.float64)
        values = np.array([v for _, v in kept], np.float64)
        t = start_ns + dt_ns * np.arange(count, dtype=np.float64)
        out = np.stack([np.interp(t, stamps, values[:, j]) for j in range(values.shape[1])], -1)
        out[(t < stamps[0]) | (t > stamps[-1])] = np.nan
        return out.astype(np.float32)
