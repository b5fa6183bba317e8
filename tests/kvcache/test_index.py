from __future__ import annotations

import random
import threading

import pytest

from cachedrag.kvcache.config import CacheConfig
from cachedrag.kvcache.index import VariantIndex
from cachedrag.kvcache.variants import AttentionMetadata


def m(*prefix):
    return AttentionMetadata(tuple(prefix), {}, 1.0, [0.0] * 4)


def test_add_and_lookup():
    idx = VariantIndex(max_chunks=10, max_variants_per_chunk=2)
    r = idx.add("c", "h1", m())
    assert r.admitted and r.evicted == ()
    idx.add("c", "h2", m("x"))
    assert [v.handle for v in idx.variants("c")] == ["h1", "h2"]
    assert "c" in idx and "z" not in idx and idx.variants("z") == ()
    assert len(idx) == 2 and idx.n_chunks == 1
    assert idx.get(r.variant.variant_id) is r.variant


def test_duplicate_context_keeps_existing_and_returns_new_handle():
    idx = VariantIndex()
    first = idx.add("c", "h1", m("x", "y"))
    again = idx.add("c", "h2", m("x", "y"))
    assert again.duplicate and not again.admitted
    assert again.variant is first.variant and again.evicted == ("h2",)
    assert len(idx) == 1


def test_per_chunk_cap_evicts_lowest_fr():
    idx = VariantIndex(max_chunks=10, max_variants_per_chunk=2)
    a = idx.add("c", "ha", m("a")).variant
    b = idx.add("c", "hb", m("b")).variant
    idx.record_reuse(a, 0.5)  # a: f_r 1 + 2 = 3 ; b: 1
    r = idx.add("c", "hc", m("c"))
    assert r.evicted == ("hb",) and r.admitted
    assert not b.attached
    assert [v.handle for v in idx.variants("c")] == ["ha", "hc"]


def test_per_chunk_ties_evict_least_recent():
    idx = VariantIndex(max_chunks=10, max_variants_per_chunk=2)
    idx.add("c", "ha", m("a"))
    idx.add("c", "hb", m("b"))
    assert idx.add("c", "hc", m("c")).evicted == ("ha",)


def test_total_cap_evicts_globally_lowest_fr_and_drops_empty_chunks():
    idx = VariantIndex(max_chunks=2, max_variants_per_chunk=2)  # 4 in all
    v1 = idx.add("c1", "h1", m("a")).variant
    v2 = idx.add("c1", "h2", m("b")).variant
    v3 = idx.add("c2", "h3", m("a")).variant
    v4 = idx.add("c3", "h4", m("a")).variant
    for v, cfo in [(v1, 0.1), (v2, 0.2), (v3, 0.5)]:
        idx.record_reuse(v, cfo)
    r = idx.add("c4", "h5", m())
    assert r.evicted == ("h4",)  # v4 never reused: f_r 1
    assert "c3" not in idx and idx.n_chunks == 3
    idx.record_reuse(r.variant, 0.01)  # guarded: + 1/0.05 = 20
    assert r.variant.reuse_score == pytest.approx(21.0)
    assert idx.add("c5", "h6", m()).evicted == ("h3",)  # 1 + 2 = 3 is now the lowest
    assert len(idx) == idx.capacity == 4


def test_fr_formula_and_cfo_zero_guard():
    idx = VariantIndex(cfo_floor=0.05)
    v = idx.add("c", "h", m()).variant
    assert idx.record_reuse(v, 0.25) == pytest.approx(1 + 4)
    assert idx.record_reuse(v, 0.0) == pytest.approx(1 + 4 + 20)
    assert v.uses == 2


def test_pinned_variants_are_not_evicted():
    idx = VariantIndex(max_chunks=1, max_variants_per_chunk=2)
    a = idx.add("c", "ha", m("a")).variant
    b = idx.add("c", "hb", m("b")).variant
    assert idx.pin(a) and idx.pin(b)
    r = idx.add("c", "hc", m("c"))
    assert r.variant is None and r.evicted == ("hc",)  # no room: the new one is refused
    assert idx.add("d", "hd", m()).variant is None
    idx.unpin(a)
    r = idx.add("d", "hd", m())
    assert r.admitted and r.evicted == ("ha",)
    idx.unpin(b)
    with pytest.raises(ValueError):
        idx.unpin(b)


def test_remove_and_evict():
    idx = VariantIndex()
    v = idx.add("c", "h1", m("a")).variant
    idx.add("c", "h2", m("b"))
    idx.add("d", "h3", m())
    assert idx.remove(v) == "h1" and idx.remove(v) is None
    assert not idx.pin(v)
    assert idx.remove_chunk("c") == ["h2"] and "c" not in idx
    assert idx.evict(5) == ["h3"] and len(idx) == 0


def test_spared_chunks_are_passed_over_and_stay_evictable():
    idx = VariantIndex()
    idx.add("c", "h1", m("a"))
    idx.add("d", "h2", m())
    idx.add("c", "h3", m("b"))
    assert idx.evict(1, spare={"c"}) == ["h2"]  # the oldest is c's, but c is spared
    assert idx.evict(2, spare={"c"}) == []
    assert idx.evict(2) == ["h1", "h3"]  # lowest f_r, then least recent, as before


def test_evict_while_stops_when_told_and_puts_the_spared_back():
    idx = VariantIndex()
    for i in range(6):
        idx.add(f"c{i}", f"h{i}", m())
    seen = []
    assert idx.evict_while(lambda h: seen.append(h) or len(seen) < 2, spare={"c0", "c2"}) == 2
    assert seen == ["h1", "h3"]  # oldest first, the spared ones passed over
    assert idx.evict_while(lambda h: True) == 4 and len(idx) == 0  # the spared ones are still there
    assert idx.evict(0) == []


def test_from_config():
    idx = VariantIndex.from_config(CacheConfig(max_chunks=3, max_variants_per_chunk=2, cfo_floor=0.1))
    assert idx.capacity == 6 and idx.cfo_floor == 0.1


def test_heap_stays_bounded():
    idx = VariantIndex()
    v = idx.add("c", "h", m()).variant
    for _ in range(3000):
        idx.record_reuse(v, 0.5)
    assert len(idx._heap) <= 4 * len(idx) + 1024 + 1


def test_thread_safety_smoke():
    idx = VariantIndex(max_chunks=20, max_variants_per_chunk=3)
    freed: list = []
    errors = []
    lock = threading.Lock()

    def worker(seed):
        rng = random.Random(seed)
        try:
            for i in range(400):
                key = f"c{rng.randrange(40)}"
                r = idx.add(key, (seed, i), m(f"p{rng.randrange(5)}"))
                with lock:
                    freed.extend(r.evicted)
                for v in idx.variants(key):
                    if idx.pin(v):
                        idx.record_reuse(v, rng.random())
                        idx.unpin(v)
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors
    assert len(idx) <= idx.capacity
    live = {v.handle for v in idx.all_variants()}
    assert len(live) + len(freed) == 4 * 400  # every handle is either live or handed back once
    assert not live & set(freed)
    assert all(len(idx.variants(k)) <= 3 for k in (f"c{i}" for i in range(40)))
