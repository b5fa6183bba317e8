from __future__ import annotations

import json

import pytest

from cachedrag.errors import ConfigError, CorruptCacheError
from cachedrag.kvcache.profile import PrefillProfile

CG = (0, 100, 300)
NG = (10, 50, 250)


def bilinear_fn(c, n):  # reproduced exactly by bilinear interpolation, also when extrapolated
    return 0.01 + 0.002 * c + 0.003 * n + 1e-5 * c * n


@pytest.fixture
def prof():
    return PrefillProfile.measure(bilinear_fn, CG, NG)


@pytest.mark.parametrize("c, n", [(0, 10), (100, 50), (300, 250), (50, 30), (200, 100), (17, 249)])
def test_inside_grid_exact_for_bilinear_functions(prof, c, n):
    assert prof.time(c, n) == pytest.approx(bilinear_fn(c, n))


@pytest.mark.parametrize("c, n", [(600, 100), (100, 1000), (1000, 2000), (150, 5)])
def test_extrapolation_continues_edge_cells_linearly(prof, c, n):
    assert prof.time(c, n) == pytest.approx(bilinear_fn(c, n))


def test_midpoint_is_average_of_corners():
    p = PrefillProfile([0, 10], [10, 20], [[1.0, 2.0], [3.0, 10.0]])
    assert p.time(5, 15) == pytest.approx((1 + 2 + 3 + 10) / 4)


def test_clamped_at_zero_and_zero_work_is_free():
    p = PrefillProfile([0, 10], [10, 20], [[1.0, 0.0], [1.0, 0.0]])
    assert p.time(0, 100) == 0.0  # linear extrapolation would go negative
    assert p.time(5, 0) == 0.0
    with pytest.raises(ValueError):
        p.time(-1, 5)


def test_single_point_axes_are_constant():
    p = PrefillProfile([0], [16, 32], [[1.0, 2.0]])
    assert p.time(1000, 24) == pytest.approx(1.5)
    q = PrefillProfile([0], [16], [[0.7]])
    assert q.time(5, 999) == pytest.approx(0.7)


def test_saved_and_marginal(prof):
    assert prof.saved_time(0, 100) == 0.0
    assert prof.saved_time(100, 50) == pytest.approx(bilinear_fn(0, 150) - bilinear_fn(100, 50))
    assert prof.marginal_cost(100, 50) == pytest.approx(bilinear_fn(100, 50))
    tail = prof.marginal_cost(100, 50, tail_tokens=20)
    assert tail == pytest.approx(bilinear_fn(100, 70) - bilinear_fn(150, 20))
    assert tail == pytest.approx(prof.saved_time(150, 20) - prof.saved_time(100, 70))
    assert prof.marginal_cost(100, 0) == 0.0


def test_analytic_profile_is_prefill_shaped():
    p = PrefillProfile.analytic()
    assert 1.5 < p.time(0, 1525) < 2.2  # ~ the default model's measured 1.9 s
    # deeper segments cost more per token (prefix-aware PGDSF cost)
    assert p.marginal_cost(1000, 200) / 200 > p.marginal_cost(0, 200) / 200
    # quadratic-ish: doubling length more than doubles time
    assert p.time(0, 2048) > 2 * p.time(0, 1024)


def test_measure_uses_repeats_and_reducer():
    calls = []

    def fn(c, n):
        calls.append((c, n))
        return float(len(calls))

    p = PrefillProfile.measure(fn, [0], [8], repeats=3)
    assert len(calls) == 3 and p.times[0][0] == 1.0
    p = PrefillProfile.measure(fn, [0], [8], repeats=2, reduce=max)
    assert p.times[0][0] == 5.0


@pytest.mark.parametrize(
    "args",
    [
        ([0, 0], [1], [[1.0], [1.0]]),
        ([10, 5], [1], [[1.0], [1.0]]),
        ([], [1], []),
        ([0], [1, 2], [[1.0]]),
        ([0], [1], [[-1.0]]),
        ([0], [1], [[float("inf")]]),
        ([-5], [1], [[1.0]]),
    ],
)
def test_bad_grids_rejected(args):
    with pytest.raises(ConfigError):
        PrefillProfile(*args)


def test_json_round_trip(tmp_path, prof):
    path = prof.save(tmp_path / "sub" / "profile.json")
    back = PrefillProfile.load(path)
    assert back.cached_grid == prof.cached_grid and back.times == prof.times
    assert back.time(123, 45) == prof.time(123, 45)
    assert not list(path.parent.glob("*.tmp"))


@pytest.mark.parametrize(
    "content",
    ["{not json", json.dumps({"format": "other"}), json.dumps({"format": "cachedrag-prefill-profile", "version": 1, "cached_grid": [0]})],
)
def test_corrupt_file(tmp_path, content):
    path = tmp_path / "p.json"
    path.write_text(content)
    with pytest.raises(CorruptCacheError):
        PrefillProfile.load(path)
