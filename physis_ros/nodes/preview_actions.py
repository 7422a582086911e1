"""Acting on a world-action model's previews (bridge parameter ``act_on_previews``).

A stream opened with previews gets, after denoising step k < K of chunk (slot) c, the chunk's
x0 estimate: for a world-action model, timed action rows like the chunk's own
(``Prediction.action_start_ns``). Acted on, a preview's rows are executed when it arrives,
through the same timed execution as chunks (``wam_execution.ActionExecution``: past rows
skipped, joined to the committed rows); a later step's preview replaces what is not yet
executed, and the chunk itself (the final answer for slot c) takes over from it in turn. The
robot so starts on slot c's rows one or more denoising steps sooner: that gain is measured
per slot (first preview acted on vs the chunk's arrival).

Order of execution: the slots in order, within a slot its previews by step, then its chunk
(``execution_order``). What is not newer is ignored and counted by reason: ``after_final``
(its chunk came already), ``older_slot`` (a newer slot was executed or came),
``out_of_order`` (a preview of the same slot at an earlier or the same step); and the timed
execution's own refusals (``expired``: no row left in the future; the safety gate's
``stale_observation``, ``expired_rows``).
"""

from __future__ import annotations

from collections import OrderedDict

from physis_ros.nodes.stats import RollingWindow

FINAL_RANK = 1 << 16
"""Within a slot: previews rank by their step (1..K-1 < FINAL_RANK - 1), the chunk last."""
SLOTS_KEPT = 64
"""Slots whose first acted preview waits for the chunk (older ones are forgotten: lost)."""


def execution_order(chunk_index: int, preview_steps: int = 0) -> int:
    """An increasing key over a stream's chunks and previews (preview_steps 0: the chunk)."""
    if not 0 <= preview_steps < FINAL_RANK - 1:
        raise ValueError(f"preview_steps {preview_steps} out of range")
    return chunk_index * FINAL_RANK + (preview_steps or FINAL_RANK - 1)


class PreviewActing:
    """The bookkeeping of one stream's acted previews (see the module docstring)."""

    def __init__(self) -> None:
        self.acted = 0
        self.ignored: dict[str, int] = {}
        self.sooner_ms = RollingWindow()
        """Per slot: ms from its first acted preview's arrival to the chunk's arrival."""
        self.restart()

    def restart(self) -> None:
        """A new stream: its chunks are numbered afresh (the counts are kept)."""
        self._newest_final: int | None = None
        self._newest_key: int | None = None
        self._first_acted_ns: OrderedDict[int, int] = OrderedDict()

    def why_ignored(self, chunk_index: int, preview_steps: int) -> str:
        """ "" when the preview is newer than anything executed or received; else why not
        (counted)."""
        key = execution_order(chunk_index, preview_steps)
        newest_slot = max(
            -1 if self._newest_final is None else self._newest_final,
            -1 if self._newest_key is None else self._newest_key // FINAL_RANK,
        )
        reason = ""
        if chunk_index == self._newest_final:
            reason = "after_final"
        elif chunk_index < newest_slot:
            reason = "older_slot"
        elif self._newest_key is not None and key <= self._newest_key:
            reason = "out_of_order"
        if reason:
            self.ignore(reason)
        return reason

    def ignore(self, reason: str) -> None:
        self.ignored[reason] = self.ignored.get(reason, 0) + 1

    def executed(self, key: int) -> None:
        """A chunk or preview with this execution_order key was executed."""
        self._newest_key = key if self._newest_key is None else max(self._newest_key, key)

    def acted_on(self, chunk_index: int, received_ns: int) -> None:
        self.acted += 1
        self._first_acted_ns.setdefault(chunk_index, received_ns)
        while len(self._first_acted_ns) > SLOTS_KEPT:
            self._first_acted_ns.popitem(last=False)

    def on_final(self, chunk_index: int, received_ns: int) -> None:
        """Slot chunk_index's chunk came (executed or not): its previews are over."""
        if self._newest_final is None or chunk_index > self._newest_final:
            self._newest_final = chunk_index
        first_ns = self._first_acted_ns.pop(chunk_index, None)
        if first_ns is not None:
            self.sooner_ms.add((received_ns - first_ns) / 1e6)

    def values(self) -> dict[str, float | int]:
        """For /diagnostics (the output status)."""
        sooner = self.sooner_ms.summary()
        out: dict[str, float | int] = {
            "previews_acted": self.acted,
            "previews_ignored": sum(self.ignored.values()),
            "preview_action_sooner_median_ms": sooner["median"],
            "preview_action_sooner_slots": sooner["n"],
        }
        out.update({f"previews_ignored_{k}": v for k, v in sorted(self.ignored.items())})
        return out
