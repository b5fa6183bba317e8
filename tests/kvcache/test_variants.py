from __future__ import annotations

import math
import random

import pytest

from cachedrag.kvcache.variants import (
    AttentionMetadata,
    context_impact,
    kendall_tau_distance,
    prefix_overlap,
    recompute_count,
    score,
    select_random_tokens,
    select_tokens,
)


def meta(prefix, inter, intra=1.0, n=10, token_inter=None):
    return AttentionMetadata(tuple(prefix), inter, intra, token_inter if token_inter is not None else [0.0] * n)


@pytest.mark.parametrize(
    "inter, intra, expected",
    [
        ({"a": 1.0}, 1.0, 0.5),
        ({"a": 3.0}, 1.0, 0.75),
        ({"a": 1.0, "b": 2.0}, 1.0, 0.75),
        ({}, 1.0, 0.0),
        ({"a": 0.0}, 0.0, 0.0),
        ({"a": 2.0}, 0.0, 1.0),
    ],
)
def test_cci(inter, intra, expected):
    assert context_impact(meta(["a", "b"], inter, intra)) == pytest.approx(expected)


@pytest.mark.parametrize(
    "old, new, expected",
    [
        (["a", "b", "c"], ["a", "b", "c"], 0.0),
        (["a", "b", "c"], ["c", "b", "a"], 1.0),
        (["a", "b", "c", "d"], ["d", "c", "b", "a"], 1.0),
        (["a", "b", "c"], ["b", "a", "c"], 1 / 3),
        (["a", "b"], ["x", "y"], 0.0),  # empty common set
        ([], [], 0.0),
        (["a"], ["a"], 0.0),  # one common chunk: no pairs
        (["a", "x", "b"], ["b", "y", "a"], 1.0),  # non-common chunks ignored
        (["a", "b", "c"], ["c", "a", "z", "b"], 2 / 3),
        (["a", "b"], ["b", "a", "b"], 1.0),  # first occurrence counts
    ],
)
def test_kendall_tau_distance(old, new, expected):
    assert kendall_tau_distance(old, new) == pytest.approx(expected)


def test_prefix_overlap():
    m = meta(["a", "b", "c"], {"a": 1.0, "b": 3.0})
    assert prefix_overlap(m, ["b"]) == pytest.approx(0.75)
    assert prefix_overlap(m, ["c", "a", "b"]) == pytest.approx(1.0)
    assert prefix_overlap(m, ["c"]) == 0.0  # c was there but got no attention
    assert prefix_overlap(meta(["a"], {"a": 0.0}), []) == 1.0  # nothing to lose


@pytest.mark.parametrize(
    "prefix, inter, intra, new, alpha, expected_cfo",
    [
        # same context as the variant: beta' = 1 -> CFO 0
        (["a", "b"], {"a": 1.0, "b": 1.0}, 2.0, ["a", "b"], 1.0, 0.0),
        # no overlap at all: CFO = alpha x CCI
        (["a", "b"], {"a": 1.0, "b": 1.0}, 2.0, ["x"], 1.0, 0.5),
        (["a", "b"], {"a": 1.0, "b": 1.0}, 2.0, [], 1.0, 0.5),
        # full overlap, reversed order: beta' = 0
        (["a", "b"], {"a": 1.0, "b": 1.0}, 2.0, ["b", "a"], 1.0, 0.5),
        # half the inter mass present, same order
        (["a", "b"], {"a": 1.0, "b": 1.0}, 2.0, ["a"], 1.0, 0.25),
        # CCI = 1 and nothing overlapping: CFO = 1 (boundary)
        (["a"], {"a": 1.0}, 0.0, ["z"], 1.0, 1.0),
        # clipping to 1
        (["a"], {"a": 1.0}, 1.0, [], 5.0, 1.0),
        # alpha 0 disables recompute
        (["a"], {"a": 1.0}, 1.0, [], 0.0, 0.0),
        # CCI 0 (all attention on itself): CFO 0 whatever the context
        (["a"], {"a": 0.0}, 1.0, ["z"], 1.0, 0.0),
    ],
)
def test_cfo_table(prefix, inter, intra, new, alpha, expected_cfo):
    s = score(meta(prefix, inter, intra), new, alpha=alpha)
    assert s.cfo == pytest.approx(expected_cfo)
    assert 0.0 <= s.cfo <= 1.0
    assert s.beta_prime == pytest.approx(s.beta * (1 - s.order_penalty))


def test_cold_variant():
    m = AttentionMetadata.standalone(8)
    assert m.is_cold
    same = score(m, [], alpha=1.0, cold_cci=0.2)
    assert same.cfo == 0.0 and same.cold
    behind = score(m, ["a"], alpha=2.0, cold_cci=0.2)
    assert behind.cfo == pytest.approx(0.4) and behind.cold and behind.beta_prime == 0.0


@pytest.mark.parametrize(
    "fraction, n, expected",
    [(0.0, 10, 0), (1.0, 10, 10), (0.1, 30, 3), (0.15, 256, 39), (0.001, 10, 1), (0.5, 0, 0), (1.5, 4, 4), (-1, 4, 0)],
)
def test_recompute_count(fraction, n, expected):
    assert recompute_count(fraction, n) == expected


def test_planted_outliers_are_selected():
    ti = [0.01] * 20
    for pos, v in [(7, 0.9), (2, 0.8), (15, 0.7)]:
        ti[pos] = v
    ti[11] = 0.5  # fourth
    m = meta(["a"], {"a": 1.0}, token_inter=ti)
    assert select_tokens(m, 3) == (2, 7, 15)
    assert select_tokens(m, 4) == (2, 7, 11, 15)
    assert select_tokens(m, 0) == ()
    assert select_tokens(m, 99) == tuple(range(20))


def test_ties_break_by_position():
    m = meta(["a"], {"a": 1.0}, token_inter=[0.5, 0.1, 0.5, 0.1, 0.5, 0.1])
    assert select_tokens(m, 2) == (0, 2)
    assert select_tokens(m, 4) == (0, 1, 2, 4)
    assert select_tokens(AttentionMetadata.standalone(10), 3) == (0, 1, 2)  # cold: first tokens


def test_random_tokens_are_seeded_distinct_sorted():
    a = select_random_tokens(100, 15, random.Random("x"))
    b = select_random_tokens(100, 15, random.Random("x"))
    assert a == b and len(set(a)) == 15 and list(a) == sorted(a)
    assert select_random_tokens(5, 9, random.Random(0)) == (0, 1, 2, 3, 4)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(prefix_keys=("a",), inter={"b": 1.0}, intra=1.0, token_inter=[0.0]), "prefix_keys"),
        (dict(prefix_keys=("a",), inter={"a": -1.0}, intra=1.0, token_inter=[0.0]), "inter"),
        (dict(prefix_keys=("a",), inter={"a": math.nan}, intra=1.0, token_inter=[0.0]), "inter"),
        (dict(prefix_keys=("a",), inter={}, intra=-1.0, token_inter=[0.0]), "intra"),
        (dict(prefix_keys=("a",), inter={}, intra=1.0, token_inter=[]), "token_inter"),
    ],
)
def test_metadata_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        AttentionMetadata(**kwargs)


def test_metadata_is_immutable_copy():
    inter = {"a": 1.0}
    m = AttentionMetadata(["a"], inter, 1.0, [0.0])
    inter["a"] = 5.0
    assert m.inter["a"] == 1.0 and m.prefix_keys == ("a",)
    with pytest.raises(TypeError):
        m.inter["a"] = 2.0  # type: ignore[index]
