"""ChunkCacheManager on a fake store (pure Python): references, persistence, drops, priorities.

The fake store keeps entries as plain objects carrying the same string metadata the engine
writes (``engine.entry_payload``), so a second manager over it is a "restarted process".
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import pytest

from cachedrag.kvcache.config import CacheConfig
from cachedrag.kvcache.keys import path_key
from cachedrag.kvcache.manager import ChunkCacheManager, NewEntry
from cachedrag.kvcache.planner import Action, PlanRequest, Segment
from cachedrag.kvcache.variants import AttentionMetadata

TOKENS = {"S": 8, "A": 10, "B": 10, "C": 20, "D": 12, "Q": 8}


class FakeTensor(list):
    def tolist(self) -> list[float]:
        return list(self)


@dataclass
class FakeEntry:
    meta: dict[str, str]
    nbytes: int
    n_tokens: int
    token_inter: list[float] | None = None


@dataclass
class FakeInfo:
    meta: dict[str, str]
    nbytes: int
    n_layers: int
    n_tokens: int


@dataclass
class FakeStore:
    """Dict store with the optional TieredStore extras (placement, header reads, drop log)."""

    persistent: bool = True
    entries: dict[str, FakeEntry] = field(default_factory=dict)
    priorities: dict[str, float] = field(default_factory=dict)
    parents: dict[str, str] = field(default_factory=dict)
    drop_log: list[str] = field(default_factory=list)
    gets: int = 0
    info_reads: int = 0

    def put(self, key, entry, *, priority=0.0, parent=None):
        self.entries.setdefault(key, entry)
        self.priorities[key] = priority
        if parent is not None:
            self.parents[key] = parent
        return True

    def set_priority(self, key, priority, *, parent=None):
        if key not in self.entries:
            return False
        self.priorities[key] = priority
        if parent is not None:
            self.parents[key] = parent
        return True

    def get(self, key):
        self.gets += 1
        return self.entries.get(key)

    def contains(self, key):
        return key in self.entries

    def remove(self, key):
        return self.entries.pop(key, None) is not None

    def keys(self, *, shared=False):
        return list(self.entries)

    def info(self, key):
        self.info_reads += 1
        e = self.entries.get(key)
        return None if e is None else FakeInfo(dict(e.meta), e.nbytes, 2, e.n_tokens)

    def extras(self, key):
        e = self.entries.get(key)
        if e is None:
            return None
        return {} if e.token_inter is None else {"token_inter": FakeTensor(e.token_inter)}

    def drop(self, key):  # the store deleting for lack of room
        del self.entries[key]
        self.drop_log.append(key)

    def drops_since(self, cursor):
        return self.drop_log[cursor:], len(self.drop_log), True


class PlainStore:
    """Only the narrow interface (contains / get / put / remove / keys): no placement, no headers."""

    def __init__(self):
        self.entries = {}

    def put(self, key, entry):
        self.entries[key] = entry
        return True

    def get(self, key):
        return self.entries.get(key)

    def contains(self, key):
        return key in self.entries

    def remove(self, key):
        return self.entries.pop(key, None) is not None

    def keys(self):
        return list(self.entries)


def request(*chunks: str, system: str = "S") -> PlanRequest:
    return PlanRequest((Segment(system, TOKENS[system]),), tuple(Segment(c, TOKENS[c]) for c in chunks),
                       question_tokens=5)


def run(manager: ChunkCacheManager, req: PlanRequest, mode: str = "cachedrag", *, lose=()):
    """What the engine does: plan, load, release, admit entries for fresh segments (with the
    engine's self-describing metadata). ``lose``: handles whose load fails (computed fresh)."""
    plan = manager.plan(req, mode)
    keys = [s.key for s in plan.segments]
    actions = []
    for sp in plan.segments:
        action = sp.action
        if action in (Action.TREE, Action.REUSE) and (sp.handle in lose or manager.load(sp.handle) is None):
            action = Action.FRESH
        actions.append(action)
    manager.release(plan, used=True)
    exact = plan.exact_prefix_segments
    n_system = len(req.system)
    new = []
    for i, (sp, action) in enumerate(zip(plan.segments, actions)):
        if action is not Action.FRESH or mode == "full":
            continue
        path = keys[: i + 1]
        meta = None
        info = {"namespace": "ns", "segment_key": sp.key, "path": json.dumps(path), "role": sp.role,
                "exact": "1" if i < exact else "0", "n_tokens": str(sp.n_tokens)}
        if sp.role == "chunk" and mode in ("naive", "random", "cachedrag"):
            prior = tuple(keys[n_system:i])
            ti = [0.01 * ((t * 7 + i) % 13) for t in range(sp.n_tokens)]
            meta = AttentionMetadata(prior, {k: 0.2 for k in prior}, 1.0, ti)
            info["variant"] = json.dumps({"prefix_keys": list(prior), "inter": dict(meta.inter), "intra": meta.intra})
        entry = FakeEntry(info, 100 * sp.n_tokens, sp.n_tokens, list(meta.token_inter) if meta else None)
        new.append(NewEntry(segment=i, handle=path_key(path), entry=entry, nbytes=entry.nbytes, meta=meta))
    if new:
        manager.admit(plan, keys, new)
    return plan, actions


def tree_paths(manager: ChunkCacheManager) -> set[tuple[str, ...]]:
    return {tuple(n.path_keys()) for n in manager.tree.nodes()}


def variant_set(manager: ChunkCacheManager) -> set[tuple[str, tuple[str, ...], str]]:
    return {(v.chunk_key, v.meta.prefix_keys, v.handle) for v in manager.index.all_variants()}


def populate(manager: ChunkCacheManager) -> None:
    for req in (request("A", "B", "C"), request("A", "B", "D"), request("C", "A"), request("B", "D", "C")):
        run(manager, req)


# ------------------------------------------------------------------------------ references
def test_admit_references_and_refcounts():
    store = FakeStore(persistent=False)
    m = ChunkCacheManager(store, CacheConfig())
    run(m, request("A", "B", "C"))
    assert tree_paths(m) == {("S",), ("S", "A"), ("S", "A", "B"), ("S", "A", "B", "C")}
    assert {c for c, _, _ in variant_set(m)} == {"A", "B", "C"}
    h_abc = path_key(["S", "A", "B", "C"])
    assert m.refcount(h_abc) == 2 and m.refcount(path_key(["S"])) == 1  # tree + variant / tree only
    assert set(store.entries) == set(m.handles()) and m.check() == []
    # tree parents go to the store with the entries
    assert store.parents[h_abc] == path_key(["S", "A", "B"]) and path_key(["S"]) not in store.parents


def test_plain_store_without_extras_still_works():
    store = PlainStore()
    m = ChunkCacheManager(store, CacheConfig(), capacity_bytes=None)
    assert m.last_refresh is None  # not persistent, nothing to rebuild
    run(m, request("A", "B"))
    plan, actions = run(m, request("A", "B"))
    assert actions[:3] == [Action.TREE] * 3 and m.check() == []
    assert m.refresh().listed == 0  # no header reads: nothing to adopt


# ------------------------------------------------------------------------------ restart
def test_rebuild_restores_tree_variants_and_refcounts():
    store = FakeStore()
    m1 = ChunkCacheManager(store, CacheConfig())
    populate(m1)
    m2 = ChunkCacheManager(store, CacheConfig())  # a restarted process on the same store
    r = m2.last_refresh
    assert r is not None and r.listed == len(store.entries) and r.unreferenced == 0 and r.not_engine == 0
    assert tree_paths(m2) == tree_paths(m1) and variant_set(m2) == variant_set(m1)
    assert {h: m2.refcount(h) for h in m2.handles()} == {h: m1.refcount(h) for h in m1.handles()}
    assert m2.check() == [] and m2.used_bytes == m1.used_bytes
    # the first request of the new process is planned like it would be in the old one
    for req in (request("A", "B", "C"), request("D", "C")):
        p1, p2 = m1.plan(req, "cachedrag"), m2.plan(req, "cachedrag")
        assert [(s.action, s.handle, s.recompute) for s in p1.segments] == [
            (s.action, s.handle, s.recompute) for s in p2.segments]
        m1.release(p1, used=False)
        m2.release(p2, used=False)
    # the store received the priorities and tree parents of what was adopted
    node = m2.tree.find(["S", "A", "B"])
    assert store.parents[node.handle] == path_key(["S", "A"]) and store.priorities[node.handle] > 0


def test_rebuild_reads_headers_only_and_no_entry():
    store = FakeStore()
    populate(ChunkCacheManager(store, CacheConfig()))
    store.gets = 0
    ChunkCacheManager(store, CacheConfig())
    assert store.gets == 0 and store.info_reads == len(store.entries)


def test_rebuild_inserts_longest_present_chain_and_leaves_orphans():
    store = FakeStore()
    m1 = ChunkCacheManager(store, CacheConfig(), rebuild=False)
    run(m1, request("A", "B", "C"), mode="prefix")
    del store.entries[path_key(["S", "A", "B"])]  # a middle node is gone (e.g. evicted by another process)
    m2 = ChunkCacheManager(store, CacheConfig())
    assert tree_paths(m2) == {("S",), ("S", "A")}
    assert m2.last_refresh.unreferenced == 1 and m2.check() == []
    assert path_key(["S", "A", "B", "C"]) in store.entries  # left alone: the store evicts it first
    assert m2.refresh().read == 0  # not re-read by later scans


def test_rebuild_skips_foreign_and_damaged_metadata():
    store = FakeStore()
    populate(ChunkCacheManager(store, CacheConfig()))
    h = path_key(["S", "A"])
    store.entries["ab" * 32] = FakeEntry({"namespace": "ns"}, 10, 1)  # not an engine entry
    store.entries[h].meta = dict(store.entries[h].meta, path=json.dumps(["S", "X"]))  # path does not hash to h
    m = ChunkCacheManager(store, CacheConfig())
    assert m.last_refresh.not_engine == 2 and h not in m.handles()
    assert ("S", "A", "B") not in tree_paths(m)  # its ancestor was rejected
    assert "ab" * 32 in store.entries and m.check() == []


def test_rebuild_respects_variant_caps():
    store = FakeStore()
    populate(ChunkCacheManager(store, CacheConfig()))
    m = ChunkCacheManager(store, CacheConfig(max_chunks=2, max_variants_per_chunk=1))
    assert len(m.index) <= 2 and m.check() == []
    assert set(m.handles()) <= set(store.entries)


def test_refresh_picks_up_entries_written_by_another_process():
    store = FakeStore()
    b = ChunkCacheManager(store, CacheConfig())  # started first, empty
    a = ChunkCacheManager(store, CacheConfig())
    populate(a)
    assert b.plan(request("A", "B", "C"), "prefix").prefix_hit_segments == 0
    r = b.refresh()
    assert r.tree_nodes == len(a.tree) and r.variants == len(a.index)
    plan, actions = run(b, request("A", "B", "C"), mode="prefix")
    assert actions == [Action.TREE] * 4 and b.check() == []


# ------------------------------------------------------------------------------ lost entries
def test_lost_tree_entry_is_stored_again_and_keeps_its_subtree():
    store = FakeStore(persistent=False)
    m = ChunkCacheManager(store, CacheConfig())
    run(m, request("A", "B", "C"), mode="prefix")
    h_a = path_key(["S", "A"])
    del store.entries[h_a]  # lost behind the manager's back (another process, TTL, corrupt file)
    plan, actions = run(m, request("A", "B", "C"), mode="prefix")
    assert actions == [Action.TREE, Action.FRESH, Action.TREE, Action.TREE]  # B, C: still exact behind A
    assert m.counters["restored"] == 1 and h_a in store.entries and m.check() == []
    assert tree_paths(m) == {("S",), ("S", "A"), ("S", "A", "B"), ("S", "A", "B", "C")}
    plan, actions = run(m, request("A", "B", "C"), mode="prefix")
    assert actions == [Action.TREE] * 4


@pytest.mark.parametrize("through_load", [True, False])
def test_lost_variant_is_forgotten(through_load):
    """Through ``load`` (the engine's whole-entry path) or noticed at admission (an engine that
    reads through the store's layer loaders and only reports a fresh segment)."""
    store = FakeStore(persistent=False)
    m = ChunkCacheManager(store, CacheConfig())
    run(m, request("C"))
    h_c = path_key(["S", "C"])
    del store.entries[h_c]
    plan, actions = run(m, request("A", "C"), lose=() if through_load else {h_c})
    assert plan.segments[2].action is Action.REUSE and actions[2] is Action.FRESH
    assert m.counters["lost"] == 1 and m.check() == []
    assert m.refcount(h_c) == 1  # still the tree node at (S, C): stored again when that path is computed
    assert [v.handle for v in m.index.variants("C")] == [path_key(["S", "A", "C"])]  # the fresh one


def test_admit_keeps_a_variant_that_was_only_late():
    """A variant skipped because it was not ready in time (still stored) is not forgotten."""
    store = FakeStore(persistent=False)
    m = ChunkCacheManager(store, CacheConfig())
    run(m, request("C"))
    h_c = path_key(["S", "C"])
    run(m, request("A", "C"), lose={h_c})
    assert h_c in m.handles() and m.counters["lost"] == 0 and m.check() == []


def test_store_drops_are_forgotten():
    store = FakeStore(persistent=False)
    m = ChunkCacheManager(store, CacheConfig())
    populate(m)
    victim = path_key(["S", "A", "B"])
    store.drop(victim)
    plan = m.plan(request("A", "B", "C"), "prefix")  # syncs the drop log first
    assert plan.prefix_hit_segments == 2 and m.counters["store_drops"] == 1
    m.release(plan, used=False)
    assert victim not in m.handles() and m.check() == []
    assert ("S", "A", "B", "C") not in tree_paths(m)


def test_invalidate_is_idempotent():
    store = FakeStore(persistent=False)
    m = ChunkCacheManager(store, CacheConfig())
    populate(m)
    h = path_key(["S", "A"])
    assert m.invalidate(h) is True and m.invalidate(h) is False and m.check() == []


# ------------------------------------------------------------------------------ priorities, budget
def test_hits_raise_store_priority():
    store = FakeStore(persistent=False)
    m = ChunkCacheManager(store, CacheConfig())
    run(m, request("A", "B"), mode="prefix")
    h = path_key(["S", "A", "B"])
    before = store.priorities[h]
    run(m, request("A", "B"), mode="prefix")
    assert store.priorities[h] > before and store.priorities[h] == pytest.approx(m.priority(h))


def test_variant_priority_uses_reuse_score():
    store = FakeStore(persistent=False)
    m = ChunkCacheManager(store, CacheConfig())
    run(m, request("C"))
    h_c = path_key(["S", "C"])
    run(m, request("A", "C"))  # C reused behind A (variant), f_r grows
    variant = m.index.variants("C")[0]
    assert variant.reuse_score > 1 and m.priority(h_c) >= m.tree.clock + variant.reuse_score * 20 / (100 * 20)


class BudgetStore(PlainStore):
    """A memory tier's behaviour: a byte budget, and a full store makes room by itself, least
    recently used first, with no drop log for the manager to read."""

    def __init__(self, budget: int):
        super().__init__()
        self.budget = budget
        self.self_evictions = 0

    def put(self, key, entry):
        while self.entries and sum(e.nbytes for k, e in self.entries.items() if k != key) + entry.nbytes > self.budget:
            del self.entries[next(iter(self.entries))]
            self.self_evictions += 1
        self.entries.pop(key, None)
        self.entries[key] = entry
        return True

    def get(self, key):
        entry = self.entries.pop(key, None)
        if entry is not None:
            self.entries[key] = entry  # most recently used last
        return entry


@pytest.mark.parametrize("capacity", [3000, 4500, 6000])
def test_room_is_made_by_the_policy_before_a_budgeted_store_would_make_it(capacity):
    """With the manager's cap equal to a self-evicting store's budget (the engine's default
    memory tier), the manager evicts first, by its policy, so the store never drops an entry on
    its own: everything the manager references (and plans hits on) is really stored."""
    store = BudgetStore(capacity)
    m = ChunkCacheManager(store, CacheConfig(), capacity_bytes=capacity)
    for req in (request("A", "B", "C"), request("D", "C"), request("B", "A"), request("C", "D", "A"),
                request("A", "D"), request("B", "C", "D")):
        run(m, req)
        assert set(store.entries) == set(m.handles()) and m.check() == []
        assert m.used_bytes == sum(e.nbytes for e in store.entries.values()) <= capacity
    assert store.self_evictions == 0


@pytest.mark.parametrize("capacity", [3000, 6000])
def test_capacity_is_respected_and_evicted_entries_leave_the_store(capacity):
    store = FakeStore(persistent=False)
    m = ChunkCacheManager(store, CacheConfig(), capacity_bytes=capacity)
    for req in (request("A", "B", "C"), request("D", "C"), request("B", "A"), request("C", "D", "A")):
        run(m, req)
        assert m.used_bytes <= capacity and m.check() == []
        assert set(store.entries) == set(m.handles())


def test_held_chunks_are_evicted_last():
    """``hold``: eviction passes over the held chunks' variants and tree nodes while anything else
    can go, and takes them when nothing else is left (a hold never overfills the budget)."""
    sizes = {k: 100 * TOKENS[k] for k in ("S", "A", "B", "C", "D")}
    capacity = sizes["S"] + sizes["A"] + sizes["D"]  # S plus two chunks
    store = FakeStore(persistent=False)
    m = ChunkCacheManager(store, CacheConfig(), capacity_bytes=capacity)
    run(m, request("A"))
    run(m, request("B"))
    m.hold({"A"})  # a waiting request will read A: the older B goes instead
    run(m, request("D"))
    assert m.index.variants("A") and not m.index.variants("B") and m.index.variants("D")
    assert m.used_bytes <= capacity and m.check() == [] and set(store.entries) == set(m.handles())
    m.hold({"A", "D"})  # every chunk is held: held chunks go too, by the policy's order
    run(m, request("C"))
    assert m.index.variants("C") and not m.index.variants("A") and not m.index.variants("D")  # C is 2000
    assert m.used_bytes <= capacity and m.check() == []
    m.hold(())
    run(m, request("B"))
    assert m.index.variants("B") and m.used_bytes <= capacity


def test_without_a_hold_the_policy_order_stands():
    store = FakeStore(persistent=False)
    sizes = {k: 100 * TOKENS[k] for k in ("S", "A", "B", "D")}
    m = ChunkCacheManager(store, CacheConfig(), capacity_bytes=sum(sizes.values()) - 1)  # one chunk too many
    run(m, request("A"))
    run(m, request("B"))
    run(m, request("D"))
    assert not m.index.variants("A") and m.index.variants("B") and m.index.variants("D")  # the oldest went


def test_a_store_that_places_by_itself_gets_the_held_chunks_entries():
    """With a placing store (TieredStore) the manager has no cap of its own; ``hold`` hands the
    store the handles of the held chunks' variants and tree nodes, which its tiers move out last."""

    class HoldingStore(FakeStore):
        held: frozenset = frozenset()

        def hold(self, keys):
            self.held = frozenset(keys)

    store = HoldingStore(persistent=False)
    m = ChunkCacheManager(store, CacheConfig())
    run(m, request("A", "B"))
    run(m, request("B", "A"), mode="prefix")  # A computed again behind B: a second tree node of A
    m.hold({"A"})
    assert store.held == {path_key(["S", "A"]), path_key(["S", "B", "A"])}  # the variant shares the first
    m.hold(())
    assert store.held == frozenset()
