"""Where a teacher-forced answer first leaves the reference (``bench.metrics.divergence``) and
the summary over requests (``divergence_summary``), on hand-made readings."""

from __future__ import annotations

import pytest

from cachedrag_bench.metrics import divergence, divergence_summary
from cachedrag_bench.ttft import parting_line


def test_equal_answers_never_part_and_report_their_smallest_gap():
    d = divergence([5, 6, 7], [5, 6, 7], [1.0, 0.5, 2.0], [0.9, 0.3, 1.5])
    assert d == {"position": None, "reference_gap": None, "mode_gap": None, "mode_gap_min": 0.3}


def test_the_first_differing_top1_is_where_the_answers_part():
    d = divergence([5, 6, 7, 8], [5, 9, 7, 1], [1.0, 0.05, 2.0, 0.1], [0.8, 0.02, 0.01, 0.0])
    assert d["position"] == 1 and d["reference_gap"] == 0.05 and d["mode_gap"] == 0.02
    assert d["mode_gap_min"] == 0.02  # only up to the parting: later steps never run on this path


def test_a_first_token_parting():
    d = divergence([5, 6], [4, 6], [0.2, 1.0], [0.1, 0.0])
    assert d["position"] == 0 and d["mode_gap_min"] == 0.1


def test_summary_counts_partings_near_ties_and_what_a_step_guard_would_do():
    records = [
        {"position": None, "reference_gap": None, "mode_gap": None, "mode_gap_min": 0.1, "approximate": True},
        {"position": None, "reference_gap": None, "mode_gap": None, "mode_gap_min": 0.05, "approximate": False},
        {"position": 0, "reference_gap": 0.03, "mode_gap": 0.02, "mode_gap_min": 0.02, "approximate": True},
        {"position": 6, "reference_gap": 0.4, "mode_gap": 0.5, "mode_gap_min": 0.3, "approximate": True},
        {"position": 10, "reference_gap": 0.1, "mode_gap": 0.2, "mode_gap_min": 0.2, "approximate": True},
    ]
    s = divergence_summary(records, near_tie=0.25)
    assert s["answers"] == 5 and s["approximate"] == 4
    assert s["parted"] == 3 and s["first_token_parted"] == 1 and s["position_median"] == 6
    assert s["reference_gap_median"] == pytest.approx(0.1)
    assert s["parted_at_reference_near_tie"] == 2  # 0.03 and 0.1; 0.4 is a real shift
    # a guard at 0.25 on every step: the first (not parted) and the two partings under it; the exact
    # answer (not approximate) is never checked
    assert s["step_guard_prefills"] == 3 and s["step_guard_prevents"] == 2


def test_summary_of_answers_that_never_part():
    s = divergence_summary([{"position": None, "reference_gap": None, "mode_gap": None, "mode_gap_min": 1.0}])
    assert s["parted"] == 0 and s["position_median"] is None and s["reference_gap_median"] is None
    assert s["step_guard_prefills"] == 0


def test_the_printed_line_says_each_figure():
    records = [divergence([5, 6], [4, 6], [0.03, 1.0], [0.02, 0.0]) | {"approximate": True},
               divergence([5, 6], [5, 6], [1.0, 1.0], [0.9, 0.8]) | {"approximate": True}]
    line = parting_line("cachedrag", divergence_summary(records))
    assert line == ("answers parting from full, cachedrag: 1 of 2 (first token 1), median position 0, full's own "
                    "top-2 gap there 0.030 nats (under 0.25: 1); a gap guard at 0.25 on every step would prefill 1 "
                    "of 2 approximate answers again, preventing 1")


def test_bench_metric_and_spec_examples_run():
    """The docstring examples of the benchmarks' metrics (``first_token_matches``: the first token as
    decoded, not as a rewind left it) and of ``bench ttft``'s row specs."""
    import doctest

    import cachedrag_bench.metrics
    import cachedrag_bench.ttft

    for mod in (cachedrag_bench.metrics, cachedrag_bench.ttft):
        result = doctest.testmod(mod, optionflags=doctest.ELLIPSIS)
        assert result.attempted > 0 and result.failed == 0, f"{mod.__name__}: {result}"
