"""Order-aware exact reuse (``cached_order``) and the question choices' settings: pure policy."""

from __future__ import annotations

import pytest

from cachedrag.errors import ConfigError
from cachedrag.kvcache.config import CacheConfig
from cachedrag.kvcache.planner import cached_order
from cachedrag.kvcache.tree import KnowledgeTree


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
])
def test_question_settings_are_validated(kwargs, field):
    with pytest.raises(ConfigError, match=field):
        CacheConfig(**kwargs)


def test_question_layers_are_normalised():
    assert CacheConfig(question_layers=[2, 1, 2]).question_layers == (1, 2)
