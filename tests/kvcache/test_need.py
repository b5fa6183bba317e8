"""Budget by need (``allocate_by_need``) and order-aware exact reuse (``cached_order``): pure policy."""

from __future__ import annotations

import pytest

from cachedrag.errors import ConfigError
from cachedrag.kvcache.config import CacheConfig
from cachedrag.kvcache.planner import allocate_by_need, allocate_full_chunks, cached_order
from cachedrag.kvcache.tree import KnowledgeTree


@pytest.mark.parametrize("counts, needs, sizes, weight, expected", [
    ([10, 10, 10], [8.0, 1.0, 1.0], [100, 100, 100], 1.0, [24, 3, 3]),
    ([10, 10, 10], [8.0, 1.0, 1.0], [100, 100, 100], 0.5, [17, 7, 6]),
    ([10, 10, 10], [8.0, 1.0, 1.0], [12, 100, 100], 1.0, [12, 9, 9]),  # capped chunk: excess goes by need
    ([10, 10, 10], [1.0, 1.0, 1.0], [100, 100, 100], 1.0, [10, 10, 10]),
    ([10, 10, 10], [0.0, 0.0, 0.0], [100, 100, 100], 1.0, [10, 10, 10]),  # no signal: as planned
    ([5, 5], [1.0, 0.0], [6, 6], 1.0, [6, 4]),
    ([6, 6], [1.0, 1.0], [6, 6], 1.0, [6, 6]),  # every chunk full
    ([], [], [], 1.0, []),
])
def test_allocate_by_need(counts, needs, sizes, weight, expected):
    got = allocate_by_need(counts, needs, sizes, weight)
    assert got == expected
    assert sum(got) == min(sum(counts), sum(sizes))
    assert all(0 <= g <= s for g, s in zip(got, sizes))


def test_allocate_by_need_refuses_bad_input():
    with pytest.raises(ValueError):
        allocate_by_need([1, 2], [1.0], [3, 3], 1.0)
    with pytest.raises(ValueError):
        allocate_by_need([1], [1.0], [3], 1.5)


def _tree(*paths):
    tree = KnowledgeTree("lru")
    for path in paths:
        tree.insert(list(path), [None] * len(path), [4] * len(path), [16] * len(path))
    return tree


@pytest.mark.parametrize("paths, chunks, expected", [
    ([("s", "a", "b", "c")], ["c", "a", "b"], [1, 2, 0]),
    ([("s", "a", "b", "c")], ["a", "b", "c"], None),  # already the exact prefix
    ([("s", "a", "b")], ["b", "x", "a"], [2, 0, 1]),  # cached part leads, the new chunk follows
    ([("s", "a", "x"), ("s", "b", "c", "a")], ["a", "c", "b"], [2, 1, 0]),  # the longer path wins
    ([("s", "x", "y")], ["a", "b"], None),
    ([("t", "a", "b")], ["b", "a"], None),  # another system prefix
])
def test_cached_order(paths, chunks, expected):
    assert cached_order(_tree(*paths), ["s"], chunks) == expected


@pytest.mark.parametrize("kwargs, field", [
    ({"token_choice": "prophet"}, "token_choice"),
    ({"question_layers": ()}, "question_layers"),
    ({"question_layers": (-1,)}, "question_layers"),
    ({"question_weight": 1.5}, "question_weight"),
    ({"need_weight": -0.1}, "need_weight"),
    ({"refine_layer": 1, "question_layers": (1,)}, "refine_layer"),
    ({"refine_factor": 0.5}, "refine_factor"),
    ({"full_chunks": -1}, "full_chunks"),
    ({"full_chunks": 1.5}, "full_chunks"),
    ({"full_chunk_pick": "first"}, "full_chunk_pick"),
])
def test_question_settings_are_validated(kwargs, field):
    with pytest.raises(ConfigError, match=field):
        CacheConfig(**kwargs)


def test_question_layers_are_normalised():
    assert CacheConfig(question_layers=[2, 1, 2]).question_layers == (1, 2)


@pytest.mark.parametrize("counts, sizes, priority, n_full, expected", [
    ([30, 30, 30], [100, 100, 100], [1, 0, 2], 1, [0, 90, 0]),  # the budget is less than a chunk
    ([30, 30, 30, 30], [100, 100, 100, 100], [3, 0, 1, 2], 1, [7, 7, 6, 100]),
    ([40, 40, 40], [50, 100, 100], [0, 1, 2], 1, [50, 35, 35]),
    ([40, 40, 40], [50, 60, 100], [0, 1, 2], 2, [50, 60, 10]),
    ([10, 0, 10], [100, 100, 100], [1, 0, 2], 1, [0, 20, 0]),  # a chunk planned at 0 can still be picked
    ([20, 20], [10, 100], [1, 0], 1, [0, 40]),
    ([20, 20], [10, 15], [1, 0], 1, [10, 15]),  # more budget than tokens: everything
    ([5, 5, 5], [10, 10, 10], [0, 1, 2], 0, [5, 5, 5]),
])
def test_allocate_full_chunks(counts, sizes, priority, n_full, expected):
    out = allocate_full_chunks(counts, sizes, priority, n_full)
    assert out == expected
    assert sum(out) == min(sum(counts), sum(sizes)) and all(0 <= o <= s for o, s in zip(out, sizes))


def test_allocate_full_chunks_refuses_bad_input():
    with pytest.raises(ValueError):
        allocate_full_chunks([1, 2], [3, 4], [0, 0], 1)
    with pytest.raises(ValueError):
        allocate_full_chunks([1, 2], [3, 4], [0, 1], -1)
