"""Prefetch plan, profile-guided budget and stage split (pure Python)."""

from __future__ import annotations

import pytest

from cachedrag.errors import ConfigError, EmptyInputError
from cachedrag.retrieval.policy import hit_fraction, plan_prefetch, prefetch_budget, stage_bounds

SIZES = {0: 100, 1: 300, 2: 50, 3: 200}


@pytest.mark.parametrize(
    "order, budget, resident, clusters, to_copy, to_evict",
    [
        ([2, 0, 1, 3], 0, [], (), (), ()),
        ([2, 0, 1, 3], 49, [], (), (), ()),
        ([2, 0, 1, 3], 50, [], (2,), (2,), ()),
        ([2, 0, 1, 3], 449, [], (2, 0), (2, 0), ()),  # stops at cluster 1 (does not fit); 3 is not tried
        ([2, 0, 1, 3], 450, [0], (2, 0, 1), (2, 1), ()),  # resident clusters are kept, not copied
        ([1, 3, 0, 2], 10_000, [], (1, 3, 0, 2), (1, 3, 0, 2), ()),
        ([3, 1, 0, 2], 250, [0, 1], (3,), (3,), (0, 1)),  # resident clusters outside the plan are evicted
    ],
)
def test_plan_prefetch(order, budget, resident, clusters, to_copy, to_evict):
    plan = plan_prefetch(order, SIZES, budget, resident)
    assert (plan.clusters, plan.to_copy, plan.to_evict) == (clusters, to_copy, to_evict)
    assert plan.planned_bytes == sum(SIZES[c] for c in clusters) <= budget


def test_plan_rejects_negative_budget():
    with pytest.raises(ConfigError):
        plan_prefetch([0], SIZES, -1)


def test_prefetch_budget_is_bandwidth_times_mean_llm_time():
    assert prefetch_budget(1e9, [0.1, 0.3]) == int(1e9 * 0.2)
    with pytest.raises(EmptyInputError):
        prefetch_budget(1e9, [])
    with pytest.raises(ConfigError):
        prefetch_budget(0, [0.1])


@pytest.mark.parametrize(
    "n, stages, expected",
    [
        (8, 1, [(0, 8)]),
        (8, 3, [(0, 3), (3, 6), (6, 8)]),
        (4, 4, [(0, 1), (1, 2), (2, 3), (3, 4)]),
        (3, 10, [(0, 1), (1, 2), (2, 3)]),
    ],
)
def test_stage_bounds(n, stages, expected):
    assert stage_bounds(n, stages) == expected


def test_stage_bounds_rejects_zero_stages():
    with pytest.raises(ConfigError):
        stage_bounds(4, 0)


def test_hit_fraction():
    assert hit_fraction([1, 2, 3, 4], {2, 4, 9}) == 0.5
    assert hit_fraction([], set()) == 1.0
