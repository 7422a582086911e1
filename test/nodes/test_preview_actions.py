"""Acting on a world-action model's previews (nodes/preview_actions.py through
wam_execution.ActionExecution, the calls the bridge makes), without ROS: a preview's rows are
executed when it arrives; the chunk of the same slot takes over the rows not yet executed
and never changes what was commanded before it came; a preview after its chunk, for an older
slot, or with no row left in the future is ignored and counted; the time gained is measured
per slot."""

from __future__ import annotations

import numpy as np
import pytest

from physis_ros.nodes.pairing import CommandHistory
from physis_ros.nodes.wam_execution import ActionExecution, ExecutionConfig

MS = 1_000_000
ROW_NS = 50 * MS
ROWS = 12


def _execution(join: str = "crossfade") -> ActionExecution:
    history = CommandHistory(max_age_s=0.25)
    history.add(0, np.zeros(2))
    return ActionExecution(ExecutionConfig(join=join), history)


def _rows(start_ms: int, value) -> np.ndarray:
    """[ROWS, 2]: ``value(t_ms)`` in both columns at the rows' times."""
    t = start_ms + 50 * np.arange(ROWS)
    col = np.asarray([value(x) for x in t], np.float64)
    return np.stack([col, -col], axis=1)


def _arrive(ex, *, slot: int, steps: int, start_ms: int, now_ms: int, value):
    """What the bridge does with one arrival (the safety gate aside): a refused preview is
    counted, a newer one joined to the plan."""
    refused, order = ex.arrived(chunk_index=slot, preview_steps=steps, received_ns=now_ms * MS)
    if refused:
        return refused
    return ex.accept(
        actions=_rows(start_ms, value),
        start_ns=start_ms * MS,
        dt_ns=ROW_NS,
        chunk_index=slot,
        now_ns=now_ms * MS,
        order=order,
        preview_steps=steps,
        received_ns=now_ms * MS,
    )


def _commanded(ex, times_ms) -> np.ndarray:
    return np.asarray([ex.executor.target_at(t * MS)[0] for t in times_ms])


def test_a_chunk_after_the_next_slots_first_previews_is_still_executed():
    """The assembly line: chunk 2's first steps are done before chunk 1's last, so its
    previews may come first. Chunk 1 is executed when it comes; chunk 2's later previews and
    chunk 2 take over again; an older chunk than one that came is refused."""
    ex = _execution(join="replace")
    assert _arrive(ex, slot=1, steps=1, start_ms=200, now_ms=100, value=lambda t: 0.1).accepted
    assert _arrive(ex, slot=2, steps=1, start_ms=400, now_ms=150, value=lambda t: 0.2).accepted
    # slot 1's next preview is older than what is executed now; its chunk is not
    older = _arrive(ex, slot=1, steps=2, start_ms=200, now_ms=160, value=lambda t: 9.0)
    assert older == "older_slot"
    assert _arrive(ex, slot=1, steps=0, start_ms=200, now_ms=200, value=lambda t: 0.3).accepted
    assert ex.executor.target_at(300 * MS)[0] == pytest.approx(0.3)
    assert _arrive(ex, slot=1, steps=2, start_ms=200, now_ms=210, value=lambda t: 9.0) == (
        "after_final"
    )
    assert _arrive(ex, slot=2, steps=2, start_ms=400, now_ms=250, value=lambda t: 0.4).accepted
    assert ex.executor.target_at(500 * MS)[0] == pytest.approx(0.4)
    assert _arrive(ex, slot=2, steps=0, start_ms=400, now_ms=300, value=lambda t: 0.5).accepted
    assert _arrive(ex, slot=1, steps=0, start_ms=200, now_ms=310, value=lambda t: 9.0) == (
        "out_of_order_chunk"
    )
    assert ex.executor.target_at(500 * MS)[0] == pytest.approx(0.5)
    assert ex.stats.accepted == 2 and ex.previews.acted == 3
    # slot 1's rows were started 100 ms before its chunk came, slot 2's 150 ms
    assert ex.previews.values()["preview_action_sooner_median_ms"] == pytest.approx(125.0)


def test_a_previews_rows_are_executed_when_it_arrives_and_a_later_step_replaces_them():
    ex = _execution(join="replace")
    # slot 0's chunk: hold 0.1; slot 1's preview after step 1 (0.3), then after step 2 (0.5)
    assert _arrive(ex, slot=0, steps=0, start_ms=0, now_ms=0, value=lambda t: 0.1).accepted
    report = _arrive(ex, slot=1, steps=1, start_ms=200, now_ms=150, value=lambda t: 0.3)
    assert report.accepted and report.skipped_rows == 0
    assert ex.executor.target_at(200 * MS)[0] == pytest.approx(0.3)  # the preview's rows
    assert ex.executor.target_at(700 * MS)[0] == pytest.approx(0.3)
    report = _arrive(ex, slot=1, steps=2, start_ms=200, now_ms=250, value=lambda t: 0.5)
    assert report.accepted and report.skipped_rows == 1  # row at 200 ms had passed
    assert ex.executor.target_at(300 * MS)[0] == pytest.approx(0.5)
    assert ex.executor.target_at(220 * MS)[0] < 0.5  # before now: as it was commanded
    assert ex.previews.acted == 2 and ex.stats.accepted == 1  # previews counted apart
    assert ex.previews.values()["previews_ignored"] == 0


def test_the_chunk_supersedes_its_preview_without_reversing_committed_rows():
    """A ramp (1 rad/s): the preview overshoots it by 0.2 rad (an x0 estimate after one
    step), the chunk is on it. What the preview commanded before the chunk came stays; from
    the chunk's arrival the plan blends to the chunk's rows and ends on them."""
    ex = _execution(join="crossfade")
    ramp = lambda t: t / 1000.0  # noqa: E731
    assert _arrive(ex, slot=0, steps=0, start_ms=0, now_ms=0, value=ramp).accepted
    assert _arrive(ex, slot=1, steps=1, start_ms=300, now_ms=280, value=lambda t: ramp(t) + 0.2)
    before = _commanded(ex, range(280, 420, 10))
    report = _arrive(ex, slot=1, steps=0, start_ms=300, now_ms=420, value=ramp)
    assert report.accepted and report.skipped_rows == 3  # 300, 350, 400 ms had passed
    np.testing.assert_allclose(_commanded(ex, range(280, 420, 10)), before)  # kept
    after = _commanded(ex, range(420, 850, 10))
    assert after[-1] == pytest.approx(ramp(840))  # the chunk's rows once the fade is over
    # the overshoot is taken back over the fade rows, never at once
    assert ex.stats.max_discontinuity == pytest.approx(0.2, abs=1e-9)
    assert ex.stats.max_join_step < 0.05 + 0.2 / 2  # the ramp's step plus part of 0.2
    # the robot started on slot 1 at the preview: 140 ms before its chunk came
    assert ex.previews.values()["preview_action_sooner_median_ms"] == pytest.approx(140.0)
    assert ex.previews.values()["preview_action_sooner_slots"] == 1


def test_stale_previews_are_ignored_and_counted_and_change_nothing():
    ex = _execution()
    assert _arrive(ex, slot=0, steps=0, start_ms=0, now_ms=0, value=lambda t: 0.1).accepted
    assert _arrive(ex, slot=2, steps=1, start_ms=400, now_ms=300, value=lambda t: 0.2).accepted
    assert _arrive(ex, slot=2, steps=0, start_ms=400, now_ms=400, value=lambda t: 0.3).accepted
    plan = _commanded(ex, range(400, 1000, 10))
    # after its chunk; an older slot's; an earlier step of the slot after a later one
    assert (
        _arrive(ex, slot=2, steps=2, start_ms=400, now_ms=410, value=lambda t: 9.0) == "after_final"
    )
    assert (
        _arrive(ex, slot=1, steps=3, start_ms=300, now_ms=420, value=lambda t: 9.0) == "older_slot"
    )
    assert _arrive(ex, slot=3, steps=2, start_ms=500, now_ms=430, value=lambda t: 0.3).accepted
    assert (
        _arrive(ex, slot=3, steps=1, start_ms=500, now_ms=440, value=lambda t: 9.0)
        == "out_of_order"
    )
    # slot 4's preview with all its rows past: refused by the execution
    report = _arrive(ex, slot=4, steps=1, start_ms=0, now_ms=1000, value=lambda t: 9.0)
    assert not report.accepted and report.reason == "expired"
    values = ex.previews.values()
    assert values["previews_ignored_after_final"] == 1
    assert values["previews_ignored_older_slot"] == 1
    assert values["previews_ignored_out_of_order"] == 1
    assert values["previews_ignored_expired"] == 1
    assert values["previews_ignored"] == 4 and values["previews_acted"] == 2
    assert np.abs(_commanded(ex, range(400, 1000, 10))).max() < 1.0  # no 9.0 ever executed
    assert plan.max() == pytest.approx(0.3)
    assert ex.stats.refused == {}  # a preview's refusal is not a chunk's


def test_a_new_stream_forgets_the_old_ones_slots():
    ex = _execution()
    assert _arrive(ex, slot=5, steps=0, start_ms=0, now_ms=0, value=lambda t: 0.1).accepted
    ex.restart()
    assert _arrive(ex, slot=0, steps=1, start_ms=100, now_ms=50, value=lambda t: 0.2).accepted
    assert ex.previews.acted == 1


def test_chunks_and_commands_from_two_threads_never_see_a_half_joined_plan():
    """The bridge's receive thread joins chunks and previews while its callbacks read the plan
    (each command the robot reports, each observation's timeline): one at a time."""
    import threading

    ex = _execution()
    errors: list[BaseException] = []
    done = threading.Event()

    def read() -> None:
        try:
            t = 0
            while not done.is_set():
                t += 1
                ex.on_command(t * MS, np.zeros(2))
                ex.command_timeline(t * MS)
        except BaseException as err:  # noqa: BLE001 - handed to the test thread
            errors.append(err)

    reader = threading.Thread(target=read)
    reader.start()
    try:
        for i in range(3000):
            ex.arrived(chunk_index=i, preview_steps=0, received_ns=i * MS)
            ex.accept(actions=_rows(i, lambda t: 0.0), start_ns=i * MS, dt_ns=ROW_NS,
                      chunk_index=i, now_ns=i * MS)  # fmt: skip
    finally:
        done.set()
        reader.join()
    assert not errors, errors[0]
    assert ex.stats.accepted == 3000


@pytest.mark.parametrize("join", ["replace", "crossfade"])
def test_a_jump_a_join_makes_is_measured_after_the_rows_the_model_kept(join):
    """The new chunk keeps the committed rows up to 100 ms ahead (known rows: exactly the
    plan) and then sits 0.3 rad higher: at its first future row nothing jumps, one row later
    a replace jumps the whole 0.3, a crossfade a part of it."""
    ex = _execution(join=join)
    assert _arrive(ex, slot=0, steps=0, start_ms=0, now_ms=0, value=lambda t: 0.0).accepted
    assert _arrive(
        ex, slot=1, steps=0, start_ms=50, now_ms=40, value=lambda t: 0.0 if t <= 100 else 0.3
    ).accepted
    assert ex.stats.max_discontinuity == 0.0  # blind to it: the first row is a kept one
    assert ex.stats.max_chunk_step == pytest.approx(0.3)
    if join == "replace":
        assert ex.stats.max_join_step == pytest.approx(0.3)
    else:
        assert 0.0 < ex.stats.max_join_step <= 0.3 * 0.6 + 1e-9  # weights 0.2 .. 0.8, 1
