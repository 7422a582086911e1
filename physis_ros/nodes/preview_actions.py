"""Acting on a world-action model's previews (bridge parameter ``act_on_previews``).

A stream opened with previews gets, after denoising step k < K of chunk (slot) c, the chunk's
x0 estimate: for a world-action model, timed action rows like the chunk's own
(``Prediction.action_start_ns``). Acted on, a preview's rows are executed when it arrives,
through the same timed execution as chunks (``wam_execution.ActionExecution``: past rows
skipped, joined to the committed rows); a later step's preview replaces what is not yet
executed, and the chunk itself (the final answer for slot c) takes over from it in turn. The
robot so starts on slot c's rows one or more denoising steps sooner: that gain is measured
per slot (first preview acted on vs the chunk's arrival).

What may be executed, in arrival order: a chunk newer than every chunk that came (else
``out_of_order_chunk``, a chunk's refusal as before); a preview of a slot whose chunk has not
come and that is not older than the newest preview executed, at a later step when of the
same slot. In an assembly line chunk c+1's first steps are done before chunk c's last, so
c+1's early previews may come before c itself: c is then still executed (from its arrival
on; c+1's later previews and c+1 take over again). What is ignored is counted by reason:
``after_final`` (its chunk came already), ``older_slot`` (a newer slot's chunk came or
preview was executed), ``out_of_order`` (a preview of the same slot at an earlier or the
same step); and the timed execution's own refusals (``expired``: no row left in the future;
the safety gate's ``stale_observation``, ``expired_rows``).
"""

from __future__ import annotations

from collections import OrderedDict

from physis_ros.nodes.stats import RollingWindow

SLOTS_KEPT = 64
"""Slots whose first acted preview waits for the chunk (older ones are forgotten: lost)."""


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
        self._newest_preview: tuple[int, int] | None = None  # (slot, step) last executed
        self._first_acted_ns: OrderedDict[int, int] = OrderedDict()

    def admit(self, chunk_index: int, preview_steps: int, received_ns: int) -> str:
        """A chunk (preview_steps 0) or a preview came: "" when it may be executed, else why
        not (a preview's reason is counted here, a chunk's by the caller)."""
        newest_final = -1 if self._newest_final is None else self._newest_final
        if not preview_steps:
            if chunk_index <= newest_final:
                return "out_of_order_chunk"
            self._newest_final = chunk_index
            first_ns = self._first_acted_ns.pop(chunk_index, None)
            if first_ns is not None:
                self.sooner_ms.add((received_ns - first_ns) / 1e6)
            return ""
        newest = self._newest_preview
        reason = ""
        if chunk_index == newest_final:
            reason = "after_final"
        elif chunk_index < newest_final or (newest is not None and chunk_index < newest[0]):
            reason = "older_slot"
        elif newest is not None and (chunk_index, preview_steps) <= newest:
            reason = "out_of_order"
        if reason:
            self.ignore(reason)
        return reason

    def ignore(self, reason: str) -> None:
        self.ignored[reason] = self.ignored.get(reason, 0) + 1

    def acted_on(self, chunk_index: int, preview_steps: int, received_ns: int) -> None:
        """The preview was executed."""
        self.acted += 1
        self._newest_preview = max(self._newest_preview or (-1, 0), (chunk_index, preview_steps))
        self._first_acted_ns.setdefault(chunk_index, received_ns)
        while len(self._first_acted_ns) > SLOTS_KEPT:
            self._first_acted_ns.popitem(last=False)

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
