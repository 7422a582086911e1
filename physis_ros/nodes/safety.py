"""The action gate: what may be published to a controller, and when to fall back.

Pure logic over explicit times (ROS time in ns), so it is tested without ROS:
- a chunk's rows whose time has passed are trimmed; a chunk with no row left, a chunk
  conditioned on an observation older than ``max_observation_age_s``, or a chunk whose
  index is not newer than the last published one, is never published (``expired``);
- when no chunk arrived for ``deadline_s``, the gate goes stale once: the node publishes
  the ``hold`` or ``zeros`` fallback and reports ERROR until chunks arrive again.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np

FALLBACKS = ("hold", "zeros")


@dataclass(frozen=True, kw_only=True)
class SafetyConfig:
    deadline_s: float = 0.0
    """Chunks missing for this long -> stop model actions, publish the fallback.
    0: ``deadline_intervals`` times the stream's interval (known once it streams)."""
    deadline_intervals: float = 2.0
    """Deadline in intervals when ``deadline_s`` is 0."""
    fallback: str = "hold"
    """``hold`` the last measured joint positions, or publish ``zeros``."""
    max_observation_age_s: float = 2.0
    """A chunk conditioned on an observation older than this is not published (0: no check)."""

    def __post_init__(self) -> None:
        if not self.deadline_s >= 0:
            raise ValueError(f"deadline_s must be >= 0, got {self.deadline_s}")
        if not self.deadline_intervals > 0:
            raise ValueError(f"deadline_intervals must be positive, got {self.deadline_intervals}")
        if self.fallback not in FALLBACKS:
            raise ValueError(f"fallback {self.fallback!r} is not one of {FALLBACKS}")
        if self.max_observation_age_s < 0:
            raise ValueError(
                f"max_observation_age_s must be >= 0, got {self.max_observation_age_s}"
            )


@dataclass(frozen=True, kw_only=True)
class GateDecision:
    publish: bool
    reason: str = ""
    """Why not published: expired_rows, stale_observation, out_of_order_chunk."""
    start_ns: int = 0
    """Time of the first published row."""
    actions: np.ndarray | None = None
    """[H', A] rows still in the future."""


class ActionGate:
    def __init__(self, cfg: SafetyConfig) -> None:
        self.cfg = cfg
        self._lock = threading.Lock()
        self._last_chunk_index: int | None = None
        self._last_arrival_ns: int | None = None
        self.stale = False
        # Until the interval is known, a conservative one-second deadline.
        self.deadline_s = cfg.deadline_s or 1.0

    def set_interval(self, interval_s: float) -> None:
        """The stream's interval; sets the deadline unless one was configured."""
        if self.cfg.deadline_s == 0 and interval_s > 0:
            with self._lock:
                self.deadline_s = self.cfg.deadline_intervals * interval_s

    def on_chunk(
        self,
        *,
        now_ns: int,
        chunk_index: int,
        actions: np.ndarray,
        start_ns: int,
        dt_s: float,
        observation_stamp_ns: int,
    ) -> GateDecision:
        """Decide about one arriving chunk; any arrival counts as the link being alive."""
        with self._lock:
            self._last_arrival_ns = now_ns
            self.stale = False
            if self._last_chunk_index is not None and chunk_index <= self._last_chunk_index:
                return GateDecision(publish=False, reason="out_of_order_chunk")
            max_age_ns = int(self.cfg.max_observation_age_s * 1e9)
            if (
                max_age_ns
                and observation_stamp_ns > 0
                and now_ns - observation_stamp_ns > max_age_ns
            ):
                return GateDecision(publish=False, reason="stale_observation")
            dt_ns = max(1, int(dt_s * 1e9))
            # rows at start + i*dt; row i is in the past when start + i*dt < now
            first = 0 if start_ns >= now_ns else -(-(now_ns - start_ns) // dt_ns)
            if first >= len(actions):
                return GateDecision(publish=False, reason="expired_rows")
            self._last_chunk_index = chunk_index
            return GateDecision(
                publish=True, start_ns=start_ns + first * dt_ns, actions=actions[first:]
            )

    def armed(self) -> bool:
        """A chunk with actions came: the deadline runs from now on."""
        with self._lock:
            return self._last_arrival_ns is not None

    def check_deadline(self, now_ns: int) -> bool:
        """True exactly once when chunks have been missing for the deadline (go stale)."""
        with self._lock:
            if self.stale or self._last_arrival_ns is None:
                return False
            if now_ns - self._last_arrival_ns > int(self.deadline_s * 1e9):
                self.stale = True
                return True
            return False

    def restart_deadline(self, now_ns: int) -> None:
        """A stream ended on purpose (a new prompt) and the next opens: its first chunk is
        due a deadline from now, not from the old stream's last chunk. No effect before the
        first chunk (the deadline is not running yet)."""
        with self._lock:
            if self._last_arrival_ns is not None:
                self._last_arrival_ns = max(self._last_arrival_ns, now_ns)

    def reset_stream(self) -> None:
        """A new stream (e.g. after a server restart) restarts chunk numbering."""
        with self._lock:
            self._last_chunk_index = None

    def fallback_actions(self, *, horizon: int, dim: int, held: np.ndarray | None) -> np.ndarray:
        """[H, A] fallback rows: the held joint positions (zeros beyond them) or all zeros."""
        rows = np.zeros((horizon, dim), np.float32)
        if self.cfg.fallback == "hold" and held is not None:
            count = min(dim, held.shape[0])
            rows[:, :count] = held[:count]
        return rows
