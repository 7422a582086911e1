"""Small thread-safe measurement helpers for the nodes: sliding-window percentiles, input
rates, and drop counters with reasons. Plain Python and numpy; no ROS types here."""

from __future__ import annotations

import threading
import time
from collections import Counter, deque

import numpy as np


class RollingWindow:
    """The last ``size`` samples of one quantity (e.g. milliseconds) with median/p99/std."""

    def __init__(self, size: int = 200) -> None:
        if size <= 0:
            raise ValueError(f"size must be positive, got {size}")
        self._samples: deque[float] = deque(maxlen=size)
        self._lock = threading.Lock()

    def add(self, value: float) -> None:
        with self._lock:
            self._samples.append(float(value))

    def __len__(self) -> int:
        return len(self._samples)

    def summary(self) -> dict[str, float]:
        """median, mean, p99, std and n; zeros when nothing was measured yet."""
        with self._lock:
            values = np.asarray(self._samples, dtype=np.float64)
        if values.size == 0:
            return {"median": 0.0, "mean": 0.0, "p99": 0.0, "std": 0.0, "n": 0}
        return {
            "median": float(np.median(values)),
            "mean": float(values.mean()),
            "p99": float(np.percentile(values, 99)),
            "std": float(values.std()),
            "n": int(values.size),
        }


class RateMeter:
    """Events per second over the last ``window_s`` seconds (monotonic clock)."""

    def __init__(self, window_s: float = 2.0) -> None:
        if window_s <= 0:
            raise ValueError(f"window_s must be positive, got {window_s}")
        self._window_s = window_s
        self._times: deque[float] = deque()
        self._lock = threading.Lock()
        self.total = 0

    def tick(self, now_s: float | None = None) -> None:
        now_s = time.monotonic() if now_s is None else now_s
        with self._lock:
            self._times.append(now_s)
            self.total += 1
            self._trim(now_s)

    def _trim(self, now_s: float) -> None:
        while self._times and self._times[0] < now_s - self._window_s:
            self._times.popleft()

    def rate_hz(self, now_s: float | None = None) -> float:
        now_s = time.monotonic() if now_s is None else now_s
        with self._lock:
            self._trim(now_s)
            count = len(self._times)
        return count / self._window_s

    def age_s(self, now_s: float | None = None) -> float | None:
        """Seconds since the last event, None if there was none."""
        now_s = time.monotonic() if now_s is None else now_s
        with self._lock:
            return None if not self._times else now_s - self._times[-1]


class DropCounter:
    """Counts dropped inputs by reason, so every drop is reported rather than silent."""

    def __init__(self) -> None:
        self._counts: Counter[str] = Counter()
        self._lock = threading.Lock()

    def add(self, reason: str, count: int = 1) -> None:
        with self._lock:
            self._counts[reason] += count

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(sorted(self._counts.items()))

    def total(self) -> int:
        with self._lock:
            return sum(self._counts.values())


class Deliveries:
    """Which predictions are deliveries: the first chunk from a new observation (anchor).
    With rollouts the other chunks of an anchor are the rest of its rollout; the response to
    that observation came with the first, and the interval is between deliveries. A
    prediction without an anchor (-1) is always one."""

    def __init__(self) -> None:
        self._last: tuple[int, int] | None = None

    def is_new(self, stream_id: int, anchor_slot: int) -> bool:
        anchor = (stream_id, anchor_slot)
        new = anchor != self._last or anchor_slot < 0
        self._last = anchor
        return new


class ChunkOverlap:
    """Share of a stream's chunks that entered the server's pipeline before the stream's
    previous chunk left it (server stamps of consecutive predictions): 0 when chunks run one
    at a time, near 1 when the assembly line carries several at once. Over the last ``size``
    chunks; a new stream starts afresh."""

    def __init__(self, size: int = 200) -> None:
        self._window = RollingWindow(size)
        self._last: tuple[int, int] | None = None  # (stream id, left_ns of its last chunk)
        self._lock = threading.Lock()

    def add(self, stream_id: int, entered_ns: int, left_ns: int) -> None:
        with self._lock:
            last, self._last = self._last, (stream_id, left_ns)
        if last is not None and last[0] == stream_id and entered_ns and last[1]:
            self._window.add(1.0 if entered_ns < last[1] else 0.0)

    def share(self) -> float:
        """0..1 (0 before two chunks of one stream)."""
        return self._window.summary()["mean"]

    def __len__(self) -> int:
        return len(self._window)


class ChunkTiming:
    """When a stream's chunks come: per delivery (``Deliveries``) the interval since the
    previous one, the response latency and each hop the chunk reports; the delivery rate; how
    much the server's pipeline overlaps consecutive chunks (``ChunkOverlap``)."""

    def __init__(self) -> None:
        self.rate = RateMeter()
        self.interval_ms = RollingWindow()
        self.response_ms = RollingWindow()
        self.hop_ms: dict[str, RollingWindow] = {}
        self.overlap = ChunkOverlap()
        self._deliveries = Deliveries()
        self._last_delivery_s: float | None = None

    def add(
        self,
        *,
        stream_id: int,
        anchor_slot: int,
        hop_ms: dict[str, float],
        server_times_ns: dict[str, int],
        now_s: float,
    ) -> None:
        """A chunk came at ``now_s`` (monotonic): a delivery is timed, every chunk overlapped."""
        if self._deliveries.is_new(stream_id, anchor_slot):
            self.rate.tick(now_s)
            if self._last_delivery_s is not None:
                self.interval_ms.add((now_s - self._last_delivery_s) * 1e3)
            self._last_delivery_s = now_s
            for name, value in hop_ms.items():
                self.hop_ms.setdefault(name, RollingWindow()).add(value)
            if "capture_to_received" in hop_ms:
                self.response_ms.add(hop_ms["capture_to_received"])
        self.overlap.add(
            stream_id, server_times_ns.get("entered", 0), server_times_ns.get("left", 0)
        )

    def seconds_since_delivery(self) -> float:
        """Since the last delivery came (0 before the first)."""
        last = self._last_delivery_s
        return time.monotonic() - last if last is not None else 0.0

    def hop_medians_ms(self) -> dict[str, float]:
        """Each hop's median (ms), by name, sorted."""
        return {name: window.summary()["median"] for name, window in sorted(self.hop_ms.items())}
