"""Placement balanced by measured per-stage cost: a contiguous partition of the K*L stages
that minimises the slowest rank's work per chunk (checked against exhaustive search)."""

from __future__ import annotations

import itertools
import random

import pytest

from physis_ros.engine.placement import (
    balanced_group_sizes,
    layout_balanced,
    layout_even,
    slowest_rank_ms,
    stage_costs,
)


def _best_by_search(costs, workers, hop_ms=0.0):
    n = len(costs)
    best = float("inf")
    for g in range(1, min(workers, n) + 1):
        for cuts in itertools.combinations(range(1, n), g - 1):
            bounds = (0, *cuts, n)
            worst = max(sum(costs[a:b]) + hop_ms for a, b in itertools.pairwise(bounds))
            best = min(best, worst)
    return best


def _slowest(costs, sizes, hop_ms=0.0):
    out, start = [], 0
    for n in sizes:
        out.append(sum(costs[start : start + n]) + hop_ms)
        start += n
    return max(out)


def test_unequal_costs_move_the_boundary_where_even_split_would_not():
    # An expensive first stage (embedding-heavy block 0): the even 4/4 split puts 8 ms on
    # rank 0 and 4 ms on rank 1; the balanced split evens them out at 6 ms each.
    costs = [5.0, 1, 1, 1, 1, 1, 1, 1]
    sizes = balanced_group_sizes(costs, 2)
    assert sizes == [2, 6]
    assert _slowest(costs, sizes) == 6.0
    lay = layout_balanced(2, 4, 2, costs)
    assert lay == ((0, 0, 1, 1), (1, 1, 1, 1))
    assert slowest_rank_ms(lay, costs) == 6.0
    assert slowest_rank_ms(layout_even(2, 4, 2), costs) == 8.0
    # a hop per virtual rank is added to the prediction
    assert slowest_rank_ms(lay, costs, hop_ms=0.5) == 6.5


def test_matches_exhaustive_search_on_random_costs():
    rng = random.Random(4)
    for _ in range(150):
        n = rng.randint(1, 9)
        costs = [rng.choice([0.0, rng.uniform(0.1, 10.0)]) for _ in range(n)]
        workers = rng.randint(1, 5)
        hop = rng.choice([0.0, 0.7])
        sizes = balanced_group_sizes(costs, workers, hop_ms=hop)
        assert sum(sizes) == n and all(s >= 1 for s in sizes)
        assert len(sizes) == min(workers, n)  # idle workers are used when stages allow
        assert _slowest(costs, sizes, hop) == pytest.approx(_best_by_search(costs, workers, hop))


def test_stage_costs_repeat_block_costs_per_step_and_bad_input_is_refused():
    assert stage_costs(2, {0: 3.0, 1: 1.0}) == [3.0, 1.0, 3.0, 1.0]
    with pytest.raises(ValueError, match="stage costs"):
        layout_balanced(2, 2, 2, [1.0, 1.0])
    with pytest.raises(ValueError, match=">= 0"):
        balanced_group_sizes([1.0, -1.0], 2)
    with pytest.raises(ValueError, match="at least one worker"):
        balanced_group_sizes([1.0], 0)
    with pytest.raises(ValueError, match="no stages"):
        balanced_group_sizes([], 2)
