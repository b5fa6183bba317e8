"""Where a cluster's TTFT goes: parts of each request, stranded work, queue spread."""

from __future__ import annotations

import pytest

from cachedrag.cluster.timeline import RequestRecord, summarize


def rec(replica, arrival, ttft, total, load=0.0, prefill=0.0, call=0.0):
    return RequestRecord(replica=replica, arrival=arrival, ttft_s=ttft, total_s=total, load_s=load, prefill_s=prefill,
                         call_s=call)


def test_parts_of_one_request():
    r = rec("a", 10.0, ttft=1.0, total=1.5, load=0.1, prefill=0.3)
    assert r.wait_s == pytest.approx(0.6)
    assert r.prefill_start == pytest.approx(10.6) and r.end == pytest.approx(11.5)
    assert RequestRecord.from_dict({**r.to_dict(), "extra": 1}) == r
    assert rec("a", 0, ttft=0.1, total=1, load=0.2, prefill=0.3).wait_s == 0.0  # never negative
    timed = rec("a", 10.0, ttft=1.0, total=1.5, load=0.1, prefill=0.3, call=0.7)  # 0.3 s planning + storing
    assert timed.wait_s == pytest.approx(0.3) and timed.store_s == pytest.approx(0.3)
    assert r.store_s == 0.0


def test_balanced_replicas_strand_nothing():
    recs = [rec("a", 0, 1, 1, prefill=1), rec("b", 0, 1, 1, prefill=1),
            rec("a", 1, 1, 1, prefill=1), rec("b", 1, 1, 1, prefill=1)]
    s = summarize(recs)
    assert s["stranded_share"] == 0.0 and s["spread_mean"] == 0.0 and s["joined_longer_share"] == 0.0
    assert s["per_replica"] == {"a": 2, "b": 2}
    assert s["wait_p50_s"] == 0.0 and s["compute_p50_s"] == 1.0


def test_work_queued_on_one_replica_while_the_other_idles_is_stranded():
    # a: two requests arrive at 0; the second waits 1 s for the first's prefill; b idles all along
    recs = [rec("a", 0, 1, 1, prefill=1), rec("a", 0, 2, 2, prefill=1)]
    s = summarize(recs, replicas=["a", "b"])
    assert s["stranded_share"] == pytest.approx(0.5)  # waiting during [0, 1] of [0, 2]
    assert s["spread_mean"] == pytest.approx(1.5)     # 2 vs 0 in flight for 1 s, then 1 vs 0
    assert s["per_replica"] == {"a": 2, "b": 0}
    assert s["wait_mean_s"] == pytest.approx(0.5)
    assert s["joined_longer_share"] == pytest.approx(0.5)  # the second joined a (1 in flight) while b had 0


def test_waiting_while_the_other_replica_is_busy_is_not_stranded():
    recs = [rec("a", 0, 1, 1, prefill=1), rec("a", 0, 2, 2, prefill=1), rec("b", 0, 2, 2, prefill=2)]
    assert summarize(recs)["stranded_share"] == 0.0


def test_empty_and_single_replica():
    assert summarize([])["stranded_share"] is None and summarize([])["joined_longer_share"] is None
    assert summarize([rec("a", 0, 1, 2, prefill=0.5)])["stranded_share"] == 0.0
