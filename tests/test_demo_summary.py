"""The demo's summary (cachedrag/demo.py): it leads with the share of cached chunks and the median TTFT
of chunk reuse against full prefill and prefix caching; then hits vs misses and the first token."""

from types import SimpleNamespace

from cachedrag.demo import _print_summary


def _r(ttft, hit=0, miss=0, first=1, total=None):
    return SimpleNamespace(ttft_s=ttft, total_s=total or ttft + 1, chunks_hit=hit, chunks_missed=miss,
                           token_ids=[first, 2])


def test_summary_leads_with_reuse_against_both_baselines(capsys):
    rows = [(_r(0.5, 5, 0), _r(2.0), _r(1.5)),
            (_r(0.5, 5, 0), _r(2.0, first=9), _r(2.0)),
            (_r(2.1, 3, 2), _r(2.2), _r(2.0))]
    _print_summary(rows, no_baseline=False)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "summary over 3 questions after the warm-up: 87% of retrieved chunks were already cached"
    assert lines[2].split() == ["cachedrag", "(chunk", "reuse)", "500", "ms", "4.00x"]
    assert lines[3].split() == ["prefix", "caching", "2000", "ms", "1.00x"]
    assert lines[4].split() == ["full", "prefill", "2000", "ms", "1.00x"]
    assert "every chunk was cached: 500 ms (2 questions); with misses: 2100 ms (1 questions)" in lines[5]
    assert lines[6].endswith("first token equal to full prefill's: 67%")
    assert lines[7].endswith("median 1500 ms")


def test_summary_without_baseline(capsys):
    _print_summary([(_r(1.0, 1, 1), None, None)], no_baseline=True)
    out = capsys.readouterr().out
    assert "full prefill" not in out and "prefix caching" not in out and "1000 ms" in out
