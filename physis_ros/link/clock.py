"""Robot <-> server clock offset, NTP style, best of N by the smallest round trip.

A probe carries four stamps: t1 robot send, t2 server receive, t3 server send, t4 robot
receive (robot stamps on the robot clock, server stamps on the server's wall clock). With
symmetric one-way delays, ``offset = ((t2 - t1) + (t3 - t4)) / 2`` (server minus robot) and
``round_trip = (t4 - t1) - (t3 - t2)``. Asymmetry errs by at most round_trip / 2, so the probe
with the smallest round trip among the last N wins and half its round trip is the
uncertainty.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class ClockSample:
    offset_ns: int
    """Server clock minus robot clock."""
    round_trip_ns: int


def clock_sample(t1: int, t2: int, t3: int, t4: int) -> ClockSample:
    """One probe's offset and round trip (see the module docstring)."""
    return ClockSample(offset_ns=((t2 - t1) + (t3 - t4)) // 2, round_trip_ns=(t4 - t1) - (t3 - t2))


class ClockOffsetEstimator:
    """Keeps the last ``window`` probes; the one with the smallest round trip gives the offset."""

    def __init__(self, window: int = 16) -> None:
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self._samples: deque[ClockSample] = deque(maxlen=window)
        self._lock = threading.Lock()

    def add(self, t1: int, t2: int, t3: int, t4: int) -> ClockSample | None:
        """Adds a probe; returns it, or None when its stamps are impossible (t4 < t1 or the
        server held it longer than the round trip), which is not kept."""
        sample = clock_sample(t1, t2, t3, t4)
        if t4 < t1 or sample.round_trip_ns < 0:
            return None
        with self._lock:
            self._samples.append(sample)
        return sample

    def reset(self) -> None:
        """Forget every probe (the server, hence its clock, may have changed)."""
        with self._lock:
            self._samples.clear()

    def best(self) -> ClockSample | None:
        with self._lock:
            if not self._samples:
                return None
            return min(self._samples, key=lambda s: s.round_trip_ns)

    @property
    def offset_ns(self) -> int | None:
        """Server minus robot clock, ns (None before the first probe)."""
        best = self.best()
        return None if best is None else best.offset_ns

    @property
    def uncertainty_ns(self) -> int | None:
        """Half the best round trip: bound on the offset's error from delay asymmetry."""
        best = self.best()
        return None if best is None else best.round_trip_ns // 2

    def __len__(self) -> int:
        with self._lock:
            return len(self._samples)
