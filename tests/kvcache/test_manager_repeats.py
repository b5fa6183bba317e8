"""Exact repeats in the manager (pure Python, fake store): sightings per chunk sequence, and
exactness of stored entries: an exact entry replaces approximate KV under the same handle, and
approximate KV never takes the place of a lost exact entry."""

from __future__ import annotations

import json

from cachedrag.kvcache.config import CacheConfig
from cachedrag.kvcache.keys import path_key
from cachedrag.kvcache.manager import ChunkCacheManager, NewEntry
from cachedrag.kvcache.planner import Action
from cachedrag.kvcache.repeats import RepeatTracker
from tests.kvcache.test_manager import FakeEntry, FakeStore, request, run, tree_paths


def test_tracker_counts_and_forgets_the_least_recent():
    t = RepeatTracker(capacity=2)
    assert [t.sight("x"), t.sight("x"), t.sight("y")] == [1, 2, 1]
    t.sight("x")  # x is now the most recent: y goes first
    t.sight("z")
    assert (t.count("x"), t.count("y"), t.count("z"), len(t)) == (3, 0, 1, 2)


def test_plan_counts_only_reuse_served_sightings():
    m = ChunkCacheManager(FakeStore(persistent=False), CacheConfig())
    run(m, request("B", "A"))  # fresh: variants of B and A, tree path S-B-A
    assert run(m, request("B", "A"))[0].repeat == 0  # an exact hit is not served from reuse
    assert [run(m, request("A", "B"))[0].repeat for _ in range(3)] == [1, 2, 3]  # stores no exact path
    assert run(m, request("A", "B"), mode="prefix")[0].repeat == 0
    off = ChunkCacheManager(FakeStore(persistent=False), CacheConfig(exact={"repeats": 0}))
    run(off, request("B", "A"))
    assert run(off, request("A", "B"))[0].repeat == 0 and off.stats()["repeat_fingerprints"] == 0


def test_an_exact_entry_replaces_approximate_kv_under_the_same_handle():
    store = FakeStore(persistent=False)
    m = ChunkCacheManager(store, CacheConfig())
    run(m, request("B", "A"))
    plan, actions = run(m, request("A", "B", "C"))  # A, B reused: C computed behind approximate KV
    assert [a.value for a in actions] == ["tree", "reuse", "reuse", "fresh"]
    h = path_key(["S", "A", "B", "C"])
    assert store.entries[h].meta["exact"] == "0" and ("S", "A", "B", "C") not in tree_paths(m)
    run(m, request("A", "B", "C"), mode="prefix")  # the exact path, as a promotion computes it
    assert ("S", "A", "B", "C") in tree_paths(m)
    assert store.entries[h].meta["exact"] == "1"  # the tree node's entry is the exact one
    assert m.counters["replaced_approximate"] == 1 and m.check() == []
    plan, actions = run(m, request("A", "B", "C"))
    assert actions == [Action.TREE] * 4


def test_approximate_kv_never_restores_a_lost_exact_entry():
    """A race: X plans A, B reused and C fresh; before X admits, the exact path S-A-B-C is stored
    (a promotion) and then its C entry is lost. X's approximate C must not fill the tree node."""
    store = FakeStore(persistent=False)
    m = ChunkCacheManager(store, CacheConfig())
    run(m, request("B", "A"))
    x = m.plan(request("A", "B", "C"), "cachedrag")
    m.release(x, used=True)
    run(m, request("A", "B", "C"), mode="prefix")
    h = path_key(["S", "A", "B", "C"])
    assert ("S", "A", "B", "C") in tree_paths(m)
    store.remove(h)  # lost behind the manager's back
    keys = [s.key for s in x.segments]
    info = {"namespace": "ns", "segment_key": "C", "path": json.dumps(keys), "role": "chunk", "exact": "0",
            "n_tokens": "20"}
    approx = FakeEntry(info, 2000, 20)
    m.admit(x, keys, [NewEntry(segment=3, handle=h, entry=approx, nbytes=2000, meta=None)])
    assert h not in store.entries  # not restored with approximate KV
    assert ("S", "A", "B", "C") not in tree_paths(m) and m.check() == []
    plan, actions = run(m, request("A", "B", "C"), mode="prefix")  # the next exact request stores it again
    assert store.entries[h].meta["exact"] == "1" and ("S", "A", "B", "C") in tree_paths(m)
