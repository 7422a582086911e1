"""Logging that a flood cannot turn into a flood of log lines: each key (a drop reason, a
refused call) is logged the first time, then at most once per interval, with the count of
those not logged in between."""

from __future__ import annotations

import collections
import threading
import time


class RateLimit:
    """``due(key)`` says whether to log now, and how many were held back since the last."""

    def __init__(self, interval_s: float) -> None:
        if not interval_s >= 0:
            raise ValueError(f"interval_s must be >= 0, got {interval_s}")
        self.interval_s = interval_s
        self._lock = threading.Lock()
        self._next_s: dict[str, float] = {}
        self._held: collections.Counter[str] = collections.Counter()

    def due(self, key: str) -> int | None:
        """None: not now (counted); else log now, and the int is how many were held back."""
        now_s = time.monotonic()
        with self._lock:
            if now_s < self._next_s.get(key, 0.0):
                self._held[key] += 1
                return None
            self._next_s[key] = now_s + self.interval_s
            return self._held.pop(key, 0)


def held_note(held: int) -> str:
    """ " (+N more since the last report)" or ""."""
    return f" (+{held} more since the last report)" if held else ""
