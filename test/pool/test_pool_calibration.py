"""The gloo calibration's pieces: the layouts it runs, the fit of the worker's processor time
over them, the pooling over calibrations, and one calibration of a live two-rank job."""

from __future__ import annotations

import itertools

import pytest

from physis_ros.engine.placement import layout_even
from physis_ros.engine.pool.costmodel import Profile, ProfileEntry
from physis_ros.engine.ranks.calibrate import (
    WorkerSample,
    fit_worker_costs,
    layout_strided,
    layout_whole_steps,
)
from physis_ros.tools.experiments.realcheck import pool_message_costs
from physis_ros.tools.gloo_calibration import calibrate_gloo

K, L = 4, 2


def _cross_hops(layout) -> int:
    """Messages per chunk between ranks, the exit to rank 0 included."""
    stages = [r for row in layout for r in row] + [0]
    return sum(a != b for a, b in itertools.pairwise(stages))


@pytest.mark.parametrize("ranks", [2, 3, 4])
def test_calibration_layouts_use_every_rank_and_no_checked_layout(ranks):
    even = [list(row) for row in layout_even(K, L, ranks)]
    strided, steps = layout_strided(K, L, ranks), layout_whole_steps(K, L, ranks)
    for layout in (strided, steps):
        assert layout != even
        assert {r for row in layout for r in row} == set(range(ranks))
    assert steps != strided
    assert all(len(set(row)) == 1 for row in steps)  # a step's blocks stay on one rank
    assert _cross_hops(steps) < _cross_hops(strided) == K * L


def test_whole_steps_needs_a_step_per_rank():
    with pytest.raises(ValueError, match="needs 1 <= ranks <= K = 4"):
        layout_whole_steps(K, L, 5)


def _samples(scale: float, per_message_ms: float, noise: float = 0.0) -> list[WorkerSample]:
    return [
        WorkerSample(modelled_ms=m, messages=n, worker_ms=scale * m + per_message_ms * n + noise)
        for m, n in ((1.1, 8.0), (1.0, 4.0))
    ]


def test_fit_recovers_scale_and_cost_per_message_from_the_medians():
    scale, per_message = fit_worker_costs([_samples(1.1, 0.05)] * 4 + [_samples(3.0, 0.5)])
    assert scale == pytest.approx(1.1) and per_message == pytest.approx(0.05)


def test_fit_outside_the_physical_bounds_is_the_best_fit_on_a_bound():
    # more processor time on the run with fewer messages: no cost per message, one scale
    samples = [WorkerSample(1.0, 8.0, 1.0), WorkerSample(1.0, 4.0, 1.4)]
    assert fit_worker_costs([samples]) == (pytest.approx(1.2), 0.0)
    # a worker faster beside other ranks than alone (scale 0.8): scale 1, and the cost per
    # message that fits both runs best
    scale, per_message = fit_worker_costs([_samples(0.8, 0.1)])
    assert scale == 1.0
    assert per_message == pytest.approx((8 * (1.68 - 1.1) + 4 * (1.2 - 1.0)) / (8**2 + 4**2))


def test_pooling_takes_message_costs_median_and_one_fit_over_all_calibrations():
    def profile(send_ms: float, block_ms: float) -> Profile:
        entry = ProfileEntry(tasks=1, ms_p50=block_ms, ms_p99=block_ms)
        return Profile(
            device="cpu",
            model="tiny",
            steps=K,
            window=2,
            dtype="float32",
            entries=(entry,),
            hop_ms=0.1,
            send_cpu_ms=send_ms,
            rank_work_scale=9.0,
        )

    pooled = pool_message_costs(
        [profile(0.1, 1.0), profile(0.2, 1.5), profile(0.6, 0.8)], [_samples(1.2, 0.04)] * 3
    )
    assert [p.send_cpu_ms for p in pooled] == [0.2] * 3
    assert [p.entries[0].ms_p50 for p in pooled] == [1.0, 1.5, 0.8]  # per calibration
    assert all(p.rank_work_scale == pytest.approx(1.2) for p in pooled)
    assert all(p.worker_message_ms == pytest.approx(0.04) for p in pooled)


@pytest.mark.slow
def test_a_two_rank_calibration_accounts_every_cost():
    entries = [ProfileEntry(tasks=b, ms_p50=0.3 * b, ms_p99=0.4 * b) for b in (1, 2, 4)]
    costs, scaled = calibrate_gloo("tiny", K, 2, entries, chunks=24, repeats=1)
    assert costs["hop_ms"] > 0 and costs["send_cpu_ms"] > 0 and costs["recv_cpu_ms"] > 0
    assert costs["chunk_overhead_ms"] > 0
    assert costs["rank_work_scale"] > 0 and costs["worker_message_ms"] >= 0
    # the block times keep their shape, at the level the worker's forwards ran at
    level = scaled[0].ms_p50 / entries[0].ms_p50
    assert [e.ms_p50 for e in scaled] == pytest.approx([e.ms_p50 * level for e in entries])
    profile = Profile(
        device="cpu",
        model="tiny",
        steps=K,
        window=2,
        dtype="float32",
        entries=tuple(scaled),
        **costs,
    )
    assert profile.worker_message_ms == costs["worker_message_ms"]
