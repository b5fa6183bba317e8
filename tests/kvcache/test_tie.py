"""The tie guard's trend decision (``kvcache/tie.py``), on hand-made readings."""

import pytest

from cachedrag.kvcache.tie import predicted_margin


def test_the_closest_rival_after_the_trend_decides():
    # rival 1 is nearer, but the recompute opened its gap; rival 2 is farther and closing fast
    approx, reverted = [3.0, 2.8, 2.5], [3.0, 3.2, 1.0]
    assert predicted_margin(approx, reverted, 0.0) == pytest.approx(0.2)
    # rival 1: 0.2 + 0.5 * (0.2 - (-0.2)) = 0.4; rival 2: 0.5 + 0.5 * (0.5 - 2.0) = -0.25
    assert predicted_margin(approx, reverted, 0.5) == pytest.approx(-0.25)


def test_a_margin_the_recompute_left_alone_is_kept():
    assert predicted_margin([1.0, 0.9], [5.0, 4.9], 100.0) == pytest.approx(0.1)


@pytest.mark.parametrize("approx, reverted, trend", [([1.0], [1.0], 0.5), ([1.0, 0.5], [1.0], 0.5),
                                                      ([1.0, 0.5], [1.0, 0.2], -1.0)])
def test_bad_readings_are_refused(approx, reverted, trend):
    with pytest.raises(ValueError):
        predicted_margin(approx, reverted, trend)
