"""The demo's summary (cachedrag/demo.py): TTFT and answer time of both systems, hits vs misses."""

from types import SimpleNamespace

from cachedrag.demo import _print_summary


def _r(ttft, total, hit, miss, first=1):
    return SimpleNamespace(ttft_s=ttft, total_s=total, chunks_hit=hit, chunks_missed=miss, token_ids=[first, 2])


def test_summary_reports_ttft_answer_time_and_the_hit_miss_split(capsys):
    rows = [(_r(2.0, 3.0, 0, 5), _r(2.0, 3.0, 0, 0))] + [
        (_r(0.5, 1.5, 5, 0), _r(2.0, 3.0, 0, 0)),
        (_r(0.5, 1.5, 5, 0), _r(2.0, 3.0, 0, 0, first=9)),
        (_r(2.1, 3.1, 3, 2), _r(2.0, 3.0, 0, 0)),
    ]
    _print_summary(rows, no_baseline=False)
    out = capsys.readouterr().out
    assert "3 questions after the first 1" in out and "chunk hit rate 87%" in out
    assert "cachedrag            500 ms             1500 ms" in out
    assert "full prefill        2000 ms             3000 ms" in out
    assert "4.00x" in out and "2.00x" in out and "same first token 67%" in out
    assert "every chunk was cached: 500 ms (2 questions); with misses: 2100 ms (1 questions)" in out


def test_summary_without_baseline(capsys):
    _print_summary([(_r(1.0, 2.0, 1, 1), None)], no_baseline=True)
    out = capsys.readouterr().out
    assert "full prefill" not in out and "cachedrag" in out
