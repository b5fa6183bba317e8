from __future__ import annotations

import pytest

from cachedrag.kvcache.policy import (
    GDSF,
    LFU,
    LRU,
    PGDSF,
    POLICY_NAMES,
    CacheCraftFR,
    EntryStats,
    make_policy,
    record_access,
)
from cachedrag.kvcache.simulator import simulate


def st(**kw):
    base = dict(nbytes=100, n_tokens=100, cost=1.0, frequency=1, last_access=0, clock=0.0, reuse_score=1.0)
    base.update(kw)
    return EntryStats(**base)


def lowest(policy, entries):
    return min(entries, key=lambda kv: policy.sort_key(kv[1]))[0]


def test_lru_evicts_least_recent():
    assert lowest(LRU(), [("old", st(last_access=1)), ("new", st(last_access=5))]) == "old"


def test_lfu_evicts_least_frequent_then_oldest():
    entries = [("hot", st(frequency=9, last_access=1)), ("cold_new", st(frequency=1, last_access=9)), ("cold_old", st(frequency=1, last_access=2))]
    assert lowest(LFU(), entries) == "cold_old"


def test_gdsf_keeps_small_popular_over_large():
    small = st(nbytes=10, frequency=2)
    large = st(nbytes=1000, frequency=5)
    assert lowest(GDSF(), [("small", small), ("large", large)]) == "large"


def test_pgdsf_keeps_what_is_expensive_per_byte():
    cheap = st(nbytes=100, frequency=2, cost=1.0)
    costly = st(nbytes=100, frequency=1, cost=5.0)
    assert lowest(PGDSF(), [("cheap", cheap), ("costly", costly)]) == "cheap"
    # GDSF ignores cost: the more frequent one stays
    assert lowest(GDSF(), [("cheap", cheap), ("costly", costly)]) == "costly"


def test_gdsf_clock_ages_old_entries():
    pol = PGDSF()
    old = st(frequency=10, clock=0.0, cost=1.0)  # H = 0 + 10 * 1/100 = 0.1
    clock = pol.clock_after_evict(0.0, st(clock=0.5, cost=1.0))  # evicted H = 0.51
    assert clock == pytest.approx(0.51)
    fresh = st(frequency=1, clock=clock, cost=1.0)  # H = 0.52
    assert lowest(pol, [("old", old), ("fresh", fresh)]) == "old"
    assert pol.clock_after_evict(5.0, old) == 5.0  # never goes down
    assert LRU().clock_after_evict(3.0, old) == 3.0


def test_cachecraft_fr_orders_by_reuse_score():
    a, b = st(), st()
    record_access(a, tick=1, clock=0.0, cfo=0.5, cfo_floor=0.05)  # +2
    record_access(b, tick=2, clock=0.0, cfo=0.9, cfo_floor=0.05)  # +1.11
    assert a.reuse_score == pytest.approx(3.0) and a.frequency == 2 and a.last_access == 1
    assert lowest(CacheCraftFR(), [("a", a), ("b", b)]) == "b"
    c = st()
    record_access(c, tick=3, clock=0.0, cfo=0.0, cfo_floor=0.05)  # guard: +1/0.05
    assert c.reuse_score == pytest.approx(21.0)


@pytest.mark.parametrize("name, cls", [("lru", LRU), ("LFU", LFU), ("gdsf", GDSF), ("pgdsf", PGDSF), ("cachecraft", CacheCraftFR), ("fr", CacheCraftFR), ("cache-craft", CacheCraftFR)])
def test_registry(name, cls):
    assert isinstance(make_policy(name), cls)


def test_registry_rejects_unknown_and_passes_instances():
    with pytest.raises(ValueError, match="belady"):
        make_policy("belady")
    p = LRU()
    assert make_policy(p) is p
    assert POLICY_NAMES == {"lru", "lfu", "gdsf", "pgdsf", "cachecraft_fr"}


# -- ordering on tiny traces (flat structure: each doc is its own leaf) ----------------------

SIZES = {0: 10, 1: 10, 2: 10, 3: 10, 4: 20}


def run(policy, trace, capacity, sizes=None):
    sz = [SIZES[i] for i in range(5)] if sizes is None else sizes
    return simulate([[d] for d in trace], sz, policy, capacity, structure="chunk")


def test_lfu_beats_lru_on_a_scan_over_a_hot_doc():
    # doc 0 is hot; a scan of 1, 2, 3 between its uses flushes it from LRU but not from LFU
    trace = [0, 0, 0, 1, 2, 0, 3, 1, 0, 2, 3, 0] * 3
    lru, lfu = run("lru", trace, 20), run("lfu", trace, 20)
    assert lfu.doc_hits > lru.doc_hits


def test_lru_beats_lfu_after_a_popularity_shift():
    trace = [0] * 10 + [1, 2] * 10  # 0 was hot, then 1 and 2 take over; room for two docs
    lru, lfu = run("lru", trace, 20), run("lfu", trace, 20)
    assert lru.doc_hits > lfu.doc_hits


def test_gdsf_prefers_small_docs_for_doc_hit_rate():
    # a cycle of 50 tokens through a 40-token cache: LRU misses every time; GDSF (cost 1)
    # drops the large doc 4 first and so hits some of the small ones
    trace = [4, 0, 1, 2] * 10
    gdsf, lru = run("gdsf", trace, 40), run("lru", trace, 40)
    assert lru.doc_hits == 0
    assert gdsf.doc_hits > 0
