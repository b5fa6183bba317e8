from __future__ import annotations

import pytest

from cachedrag.kvcache.config import CacheConfig, FocusConfig
from cachedrag.kvcache.focus import FocusTracker, detect_focus, focused_set


@pytest.mark.parametrize(
    "cumulative, threshold, expected",
    [
        ([0.7, 0.2, 0.1], 0.8, (0, 1)),
        ([0.7, 0.2, 0.1], 0.7, (0,)),  # exactly the threshold
        ([0.1, 0.1, 0.8], 0.8, (2,)),
        ([0.25, 0.25, 0.25, 0.25], 0.5, (0, 1)),  # ties: lower index first
        ([0.0, 0.0], 0.8, (0, 1)),  # no mass: nothing can be excluded
        ([0.5, 0.5, 0.0], 1.0, (0, 1)),
        ([], 0.8, ()),
    ],
)
def test_focused_set(cumulative, threshold, expected):
    assert focused_set(cumulative, threshold) == expected


def test_stable_focus_decides_after_min_layers_and_window():
    layers = [[0.8, 0.1, 0.1]] * 10
    d = detect_focus(layers, window=3, min_layers=4, mass_threshold=0.75)
    assert d.chunks == (0,) and d.layer == 3  # set stable since layer 0; min_layers binds
    d = detect_focus(layers, window=3, min_layers=1, mass_threshold=0.75)
    assert d.layer == 2  # the window binds: layers 0, 1, 2 agree


def test_shift_in_focus_restarts_the_window():
    # early layers look at chunk 0, later layers at chunk 2. {0} is stable over layers 0-2 but
    # min_layers=4 holds the decision; at layer 3 chunk 2 ties chunk 0 and joins, at layer 4 it
    # alone holds 60%, and {2} then needs three layers (4, 5, 6) of agreement
    layers = [[1.0, 0.0, 0.0]] * 2 + [[0.0, 0.0, 1.0]] * 8
    t = FocusTracker(3, window=3, min_layers=4, mass_threshold=0.6)
    sets, decision = [], None
    for layer in layers:
        decision = t.update(layer)
        sets.append(t.current)
        if decision:
            break
    assert sets == [(0,), (0,), (0,), (0, 2), (2,), (2,), (2,)]
    assert decision.layer == 6 and decision.chunks == (2,)
    assert decision.shares[2] == pytest.approx(5 / 7)


def test_early_window_can_settle_before_a_late_shift():
    # the same sequence with min_layers=2 settles on {0} at layer 2: min_layers guards this
    layers = [[1.0, 0.0, 0.0]] * 2 + [[0.0, 0.0, 1.0]] * 8
    d = detect_focus(layers, window=3, min_layers=2, mass_threshold=0.6)
    assert d.layer == 2 and d.chunks == (0,)


def test_never_stable_returns_none():
    layers = [[1.0, 0.0], [0.0, 3.0], [5.0, 0.0], [0.0, 9.0]]
    assert detect_focus(layers, window=2, min_layers=1, mass_threshold=0.6) is None  # {0},{1},{0},{1}


def test_decision_is_final_and_is_focused():
    t = FocusTracker(2, window=1, min_layers=1, mass_threshold=0.5)
    assert t.is_focused(1)  # undecided: everything recomputes
    d = t.update([0.9, 0.1])
    assert d.chunks == (0,) and t.decision is d
    assert t.update([0.0, 100.0]) is d  # later layers do not reopen it
    assert t.is_focused(0) and not t.is_focused(1)
    assert t.layers_seen == 1


def test_all_zero_mass_keeps_every_chunk():
    d = detect_focus([[0.0, 0.0, 0.0]] * 5, window=2, min_layers=3)
    assert d.chunks == (0, 1, 2)


def test_from_config_and_validation():
    cfg = CacheConfig(focus=FocusConfig(window=2, min_layers=5, mass_threshold=0.9))
    t = FocusTracker.from_config(4, cfg)
    assert (t.window, t.min_layers, t.mass_threshold) == (2, 5, 0.9)
    with pytest.raises(ValueError):
        t.update([1.0, 2.0])
    with pytest.raises(ValueError):
        t.update([1.0, -2.0, 0.0, 0.0])
    with pytest.raises(ValueError):
        FocusTracker(2, window=0)
    with pytest.raises(ValueError):
        FocusTracker(2, mass_threshold=0.0)
