"""Delay-aware execution of action chunks (physis_ros.contract.timeline): what the robot
commands when chunks arrive late, early, out of order, and how consecutive chunks join."""

from __future__ import annotations

import numpy as np
import pytest

from physis_ros.contract.timeline import ChunkExecutor, TimedRows, known_rows, known_until_ns

MS = 1_000_000
DT = 50 * MS


def _ramp(start_ns: int, rows: int, *, at: float = 0.0, slope: float = 0.1) -> TimedRows:
    """Rows of a joint moving at ``slope`` per row: value at start_ns is ``at``."""
    values = at + slope * np.arange(rows)
    return TimedRows(start_ns, DT, np.stack([values, -values], axis=1))


def test_a_chunk_whose_first_row_has_passed_is_trimmed_never_published_whole():
    ex = ChunkExecutor(join="replace")
    ex.seed(0, np.zeros(2))
    chunk = _ramp(1000 * MS, 12)  # rows at 1.0 .. 1.55 s
    now = 1130 * MS  # rows at 1.00, 1.05, 1.10 are past
    report = ex.accept(chunk, now_ns=now, chunk_id=1)
    assert report.accepted and report.skipped_rows == 3
    times, rows = ex.points_from(now)
    assert times[0] == now and np.all(times[1:] > now)
    # what is published after now: the 9 rows still ahead, never the 3 past ones
    assert len(times) - 1 == 9 and times[1] == 1150 * MS
    np.testing.assert_allclose(rows[1:], chunk.rows[3:])
    assert report.switch_ns == 1150 * MS


def test_a_chunk_with_every_row_past_is_refused():
    ex = ChunkExecutor()
    ex.seed(0, np.zeros(2))
    report = ex.accept(_ramp(0, 4), now_ns=500 * MS, chunk_id=1)
    assert not report.accepted and report.reason == "expired" and report.skipped_rows == 4
    np.testing.assert_allclose(ex.target_at(500 * MS), [0.0, 0.0])  # nothing changed


@pytest.mark.parametrize("join", ["replace", "crossfade"])
def test_a_late_chunk_never_reverses_the_committed_trajectory(join):
    """The arm is commanded along a ramp; a chunk planned from an older observation arrives
    late, continuing the same ramp from where it was then. Delay-aware execution keeps
    everything commanded before now and moves on from where the ramp is now; the naive
    baseline executes the late chunk's first row now and sends the arm back."""
    ex = ChunkExecutor(join=join)
    ex.seed(0, np.zeros(2))
    assert ex.accept(_ramp(0, 12, at=0.0), now_ns=0, chunk_id=1).accepted
    before = [ex.target_at(t * MS).copy() for t in range(0, 301, 10)]
    # planned for 0.2 s on, arriving at 0.3 s: rows at 0.20, 0.25 are past
    late = _ramp(200 * MS, 12, at=0.4)
    report = ex.accept(late, now_ns=300 * MS, chunk_id=2)
    assert report.accepted and report.skipped_rows == 2
    after = [ex.target_at(t * MS) for t in range(0, 301, 10)]
    np.testing.assert_array_equal(before, after)  # the past is unchanged
    future = np.array([ex.target_at(t * MS)[0] for t in range(300, 800, 10)])
    assert np.all(np.diff(future) >= -1e-12)  # never back along the ramp
    naive = ChunkExecutor(join=join, delay_aware=False)
    naive.seed(0, np.zeros(2))
    naive.accept(_ramp(0, 12, at=0.0), now_ns=0, chunk_id=1)
    naive.accept(late, now_ns=300 * MS, chunk_id=2)
    naive_future = np.array([naive.target_at(t * MS)[0] for t in range(300, 800, 10)])
    # back towards 0.2 s's value (0.4) from 0.6 (crossfading only softens it)
    assert naive_future.min() < naive.target_at(299 * MS)[0] - 0.03


def test_an_older_chunk_never_replaces_a_newer_one():
    ex = ChunkExecutor(join="replace")  # the newer chunk's own rows, unblended, to compare
    ex.seed(0, np.zeros(2))
    assert ex.accept(_ramp(100 * MS, 8, at=1.0), now_ns=100 * MS, chunk_id=5).accepted
    report = ex.accept(_ramp(150 * MS, 8, at=-1.0), now_ns=120 * MS, chunk_id=4)
    assert not report.accepted and report.reason == "out_of_order"
    assert ex.target_at(200 * MS)[0] == pytest.approx(1.2)


def test_crossfade_spreads_the_join_and_replace_jumps():
    """Two chunks that disagree by 0.5 where they overlap: replace steps to the new rows at
    the first future row; crossfade blends over fade_rows rows."""
    jumps = {}
    for join in ("replace", "crossfade"):
        ex = ChunkExecutor(join=join, fade_rows=4)
        ex.seed(0, np.zeros(2))
        ex.accept(TimedRows(0, DT, np.zeros((12, 2))), now_ns=0, chunk_id=1)
        report = ex.accept(
            TimedRows(200 * MS, DT, np.full((12, 2), 0.5)), now_ns=190 * MS, chunk_id=2
        )
        assert report.overlap_rows == 8 and report.discontinuity == pytest.approx(0.5)
        ticks = np.array([ex.target_at(t * MS)[0] for t in range(180, 500, 10)])
        jumps[join] = np.abs(np.diff(ticks)).max()
        assert ticks[-1] == pytest.approx(0.5)  # both end on the new chunk
    assert jumps["replace"] == pytest.approx(0.5)
    assert jumps["crossfade"] <= jumps["replace"] / 2


def test_crossfade_fades_from_the_held_target_when_the_chunks_do_not_overlap():
    """The first chunk after seed (or one after a gap) starts after the old plan's last row:
    the robot holds that target until then. Crossfade blends from the held target; it used
    to step like replace there, so an episode's largest jump was the same in both modes."""
    jumps = {}
    for join in ("replace", "crossfade"):
        ex = ChunkExecutor(join=join, fade_rows=4)
        ex.seed(0, np.zeros(2))
        report = ex.accept(TimedRows(200 * MS, DT, np.full((12, 2), 0.6)), now_ns=190 * MS,
                           chunk_id=1)  # fmt: skip
        assert report.accepted and report.overlap_rows == 0
        assert report.discontinuity == pytest.approx(0.6)
        np.testing.assert_allclose(ex.target_at(190 * MS), [0.0, 0.0])  # the past: held
        ticks = np.array([ex.target_at(t * MS)[0] for t in range(190, 800, 10)])
        jumps[join] = np.abs(np.diff(ticks)).max()
        assert ticks[-1] == pytest.approx(0.6)
    assert jumps["replace"] == pytest.approx(0.6)
    assert jumps["crossfade"] <= jumps["replace"] / 2


def test_known_rows_are_the_commanded_prefix_up_to_the_latency():
    ex = ChunkExecutor()
    ex.seed(0, np.zeros(2))
    ex.accept(_ramp(0, 12), now_ns=0, chunk_id=1)  # commanded up to 0.55 s
    grid = ex.rows_on_grid(400 * MS, DT, 12)
    assert np.isnan(grid[4:]).all() and np.isfinite(grid[:4]).all()  # beyond 0.55 s: none
    rows = known_rows(grid, row_start_ns=400 * MS, dt_ns=DT, known_until_ns=450 * MS)
    np.testing.assert_allclose(rows[:2, 0], [0.8, 0.9])
    assert np.isnan(rows[2:]).all()


def test_known_until_reaches_the_latency_or_the_commit_floor_if_longer():
    """Rounded up to a row, capped at max_rows_ahead: the floor only ever lengthens it."""
    assert known_until_ns(1000 * MS, 0.0, dt_ns=DT, max_rows_ahead=8) == 1000 * MS
    assert known_until_ns(1000 * MS, 60 * MS, dt_ns=DT, max_rows_ahead=8) == 1100 * MS
    floored = dict(dt_ns=DT, max_rows_ahead=8, min_committed_ns=150 * MS)
    assert known_until_ns(1000 * MS, 0.0, **floored) == 1150 * MS
    assert known_until_ns(1000 * MS, 210 * MS, **floored) == 1250 * MS
    assert known_until_ns(1000 * MS, 0.0, **(floored | {"max_rows_ahead": 2})) == 1100 * MS


def test_a_takeover_replaces_the_plan_and_the_stream_goes_on_after_it():
    """Another controller (a teleoperator; the expert when on-policy data is collected)
    takes over mid-chunk: its rows replace the plan from their first future row, what was
    commanded before stays, and the stream's next chunk still joins, from the takeover's
    rows, though its id is lower than anything the takeover might have used."""
    ex = ChunkExecutor(join="crossfade")
    ex.seed(0, np.zeros(2))
    assert ex.accept(_ramp(0, 12), now_ns=0, chunk_id=5).accepted
    before = [ex.target_at(t * MS).copy() for t in range(0, 101, 10)]
    hold = TimedRows(100 * MS, DT, np.array([[0.2, -0.2], [0.2, -0.2]]))
    report = ex.take_over(hold, now_ns=100 * MS - 1)
    assert report.accepted and report.skipped_rows == 0
    assert [ex.target_at(t * MS).tolist() for t in range(0, 101, 10)] == [
        b.tolist() for b in before
    ]
    np.testing.assert_allclose(ex.target_at(400 * MS), [0.2, -0.2])  # the ramp is gone
    assert not ex.accept(_ramp(200 * MS, 4), now_ns=200 * MS, chunk_id=5).accepted  # stale
    nxt = ex.accept(_ramp(200 * MS, 12, at=0.3), now_ns=200 * MS, chunk_id=6)
    assert nxt.accepted and nxt.discontinuity == pytest.approx(0.1)
    assert ex.join == "crossfade" and ex.delay_aware  # the stream's settings are restored
