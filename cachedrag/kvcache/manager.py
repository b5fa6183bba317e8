"""The chunk-cache manager: one knowledge tree, one variant index, one store of entries.

Owns: planning requests (through ``Planner``), admitting what a request computed (exact
prefix paths into the tree, fresh chunks as variants), and the lifetime of stored entries.
An entry (one segment's raw K + V, stored under its handle ``path_key(path)``) may be
referenced by the tree node at its path and by a variant at once; it is removed from the
store when neither references it (``refcount``). The manager keeps those references true to
the store: entries the store dropped for lack of room (``drops_since``) are forgotten with their
tree subtree; a tree entry a request could not load (lost to another process or a TTL, found
damaged) is stored again when that request recomputes it (same path, same handle: ``admit``),
a variant that could not be loaded is forgotten; entries written by an earlier run or by
another process are adopted from their headers (``refresh`` / ``rebuild``). It hands
the store the policy's view of each entry: a priority (PGDSF value of a tree node, Cache-Craft
f_r of a variant, on one scale) and the tree parent, when the store takes them (``TieredStore``).
Exactness. A handle is ``path_key(path)`` whether its KV is exact (computed on an exact prefix:
a tree node may reference it) or approximate (a chunk computed fresh behind reused chunks of the
same sequence: a variant only). The manager remembers which referenced handles are exact: an
exact entry replaces an approximate one under the same handle (``CacheConfig.exact.repeats`` promotions
compute exactly such paths), and approximate KV never restores a lost exact entry, so no tree
node ever references approximate KV. ``plan`` also counts, per chunk sequence, the requests
served from reuse (``repeats.RepeatTracker``, ``Plan.repeat``) for ``CacheConfig.exact.repeats``.
Pure Python: entries and tensors are opaque objects; never imports torch.

Does not own: tensors (the engine makes entries), tier placement and byte budgets of tiers
(the store), parsing entry metadata (``catalog``), reading what a store already holds
(``adoption``, a base of the manager), what a store offers (``features``), or the thresholds
(``CacheConfig``).

Persistence: with a store that has a persistent tier (disk, Redis) the constructor adopts what
the store holds (``rebuild``; ``adoption`` describes entries from their headers), and
``refresh()`` picks up entries other processes wrote since (shared Redis).

Budgets. ``capacity_bytes`` caps the bytes the manager references (tensor bytes, as the
engine reports them): before each put the tree evicts leaves by its policy and the index evicts
lowest-f_r variants until the entry fits (else it is not stored), and their entries are removed
from the store, so a store with the same budget never evicts by its own order. Chunks passed to
``hold`` (what waiting requests will read) are evicted last. ``None`` = no cap: the
store's own tier budgets govern, and what the store drops is forgotten here. With a
``TieredStore`` pass ``None`` (the tiers' budgets are the real limits; a cap below them only
deletes entries the slower tiers could have kept).

Priority scale (higher = keep in a faster tier): a tree node's PGDSF value
``H = L + F x C / S`` (clock L, hits F, prefill cost C of the segment at its position, bytes S);
a variant's ``L + f_r x C / S`` with C the cost of its tokens at position 0; an entry that is
both takes the larger. Updated in the store on admission and on every hit.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from cachedrag.kvcache.adoption import RefreshReport, StoreAdoption
from cachedrag.kvcache.config import CacheConfig
from cachedrag.kvcache.features import StoreFeatures
from cachedrag.kvcache.index import Variant, VariantIndex
from cachedrag.kvcache.keys import path_key
from cachedrag.kvcache.planner import Action, Mode, Plan, Planner, PlanRequest, cached_order
from cachedrag.kvcache.policy import PGDSF
from cachedrag.kvcache.profile import PrefillProfile
from cachedrag.kvcache.repeats import RepeatTracker
from cachedrag.kvcache.tree import KnowledgeTree, TreeNode
from cachedrag.kvcache.variants import AttentionMetadata

_VALUE = PGDSF()


@dataclass(frozen=True)
class NewEntry:
    """A segment the request computed fresh: its store handle, entry, size and metadata."""

    segment: int  # index into plan.segments
    handle: str
    entry: Any
    nbytes: int
    meta: AttentionMetadata | None  # None for system segments (never variants)


class ChunkCacheManager(StoreAdoption):
    """Tree + variants + refcounted store handles, safe for concurrent requests.

    ``rebuild``: adopt what the store already holds at construction; None (default) = when
    the store has a persistent tier. See the module docstring for ``capacity_bytes``.
    """

    def __init__(self, store, config: CacheConfig | None = None, capacity_bytes: int | None = None,
                 profile: PrefillProfile | None = None, *, rebuild: bool | None = None):
        self.config = config or CacheConfig()
        self.store = store
        self.capacity_bytes = capacity_bytes
        self.tree = KnowledgeTree(self.config.policy, profile=profile, cfo_floor=self.config.cfo_floor)
        self.index = VariantIndex.from_config(self.config)
        self.planner = Planner(self.tree, self.index, self.config)
        self.features = StoreFeatures.of(store)
        self._sizes: dict[str, int] = {}  # referenced handles -> entry bytes
        self._bytes = 0
        self._held: frozenset[str] = frozenset()  # chunk keys waiting requests need (``hold``)
        self._nodes: dict[str, TreeNode] = {}  # handle -> its (attached) tree node
        self._variants: dict[str, Variant] = {}  # handle -> its (attached) variant
        self._ignored: set[str] = set()  # read by refresh, nothing could reference them
        self._exact: set[str] = set()  # referenced handles whose KV equals full prefill of their path
        self._repeats = RepeatTracker(self.config.exact.repeat_memory)  # reuse-served sightings per chunk sequence
        self._drop_cursor = 0
        self._lock = threading.RLock()
        self.counters = {"stored": 0, "restored": 0, "lost": 0, "invalidated": 0, "store_drops": 0, "adopted": 0,
                         "refreshes": 0, "replaced_approximate": 0}
        self.last_refresh: RefreshReport | None = None
        if rebuild or (rebuild is None and self.features.persistent):
            self.rebuild()

    # ---------------------------------------------------------------- planning
    def plan(self, request: PlanRequest, mode: str | Mode) -> Plan:
        """The planner's plan; with ``CacheConfig.exact.repeats`` on, a plan that reuses chunk
        variants also counts one sighting of its chunk sequence (``Plan.repeat``, ``repeats.py``)."""
        if self.features.drops:
            with self._lock:
                self._sync_drops()
        plan = self.planner.plan(request, mode)
        if self.config.exact.repeats and any(s.action is Action.REUSE for s in plan.segments):
            fingerprint = path_key([s.key for s in request.system + request.chunks])
            with self._lock:
                plan.repeat = self._repeats.sight(fingerprint)
        return plan

    def cached_order(self, system_keys: Sequence[str], chunk_keys: Sequence[str]) -> list[int] | None:
        """Order-aware exact reuse: see ``planner.cached_order`` (read-only)."""
        with self._lock:
            return cached_order(self.tree, system_keys, chunk_keys)

    def release(self, plan: Plan, used: bool = True) -> None:
        """Record the plan's hits (tree touches, f_r) and push the new priorities to the store."""
        self.planner.release(plan, used=used)
        if not (used and self.features.placement):
            return
        hit = [s.handle for s in plan.segments if s.action in (Action.TREE, Action.REUSE) and s.handle is not None]
        with self._lock:
            for h in hit:
                if h in self._sizes:
                    self.store.set_priority(h, self._priority(h))

    def prefetch(self, plan: Plan):
        """Start moving the plan's cached entries toward the fastest tier (a store with
        ``prefetch``); returns the store's handle, or None."""
        fn = getattr(self.store, "prefetch", None)
        handles = [s.handle for s in plan.segments if s.action in (Action.TREE, Action.REUSE) and s.handle is not None]
        return fn(handles) if fn is not None and handles else None

    def load(self, handle: str):
        """The stored entry of ``handle`` or None (evicted, corrupt, foreign: always a miss).
        On a miss the request computes the segment fresh; see ``admit`` for how the
        references heal."""
        entry = self.store.get(handle)
        if entry is None:
            with self._lock:
                self._lost(handle)
        return entry

    def open_layers(self, handle: str, device: Any, depth: int | None = None):
        """A layer-wise loader of ``handle`` from a store with ``open_layers`` (``TieredStore``),
        or None on a miss (handled like a ``load`` miss)."""
        loader = self.store.open_layers(handle, device, depth)
        if loader is None:
            with self._lock:
                self._lost(handle)
        return loader

    def invalidate(self, handle: str) -> bool:
        """Forget ``handle`` and, if it is a tree node, its subtree (that KV was computed behind
        it): for an entry that proved unusable in a way the store could not see (e.g. a wrong
        shape). Returns whether it was referenced."""
        with self._lock:
            return self._invalidate(handle)

    # ---------------------------------------------------------------- admission
    def admit(self, plan: Plan, keys: Sequence[str], new: Sequence[NewEntry],
              priority: float | None = None, exact: int | None = None) -> dict[str, int]:
        """Store what ``plan``'s request computed and reference it from the tree and the index.

        ``keys`` are the plan's segment keys in order. Exact leading segments
        (``plan.exact_prefix_segments``, or the first ``exact`` of them where the request computed
        fewer exactly, e.g. fresh chunks on bfloat16 copies) become a tree path (stored with their
        tree parent); fresh chunks with metadata become variants. ``priority`` overrides the
        policy's initial store priority. Returns counts for stats.
        """
        by_segment = {n.segment: n for n in new}
        exact = plan.exact_prefix_segments if exact is None else min(exact, plan.exact_prefix_segments)
        with self._lock:
            self._sync_drops()
            # room is made by the policy before each put (``_make_room``); the tree nodes this
            # request took its prefix from stay meanwhile (the path it stores goes through them)
            prefix = [self._nodes[sp.handle] for sp in plan.segments
                      if sp.action is Action.TREE and sp.handle in self._nodes]
            self.tree.pin(prefix)
            try:
                stored = self._store_new(plan, keys, new, exact, priority)
            finally:
                self.tree.unpin(prefix)
            path_len = 0
            for i in range(exact):  # the tree path stops at the first segment with no stored entry
                seg = plan.segments[i]
                handle = seg.handle if seg.handle is not None else (by_segment[i].handle if i in by_segment else None)
                if handle is None or handle not in self._sizes:
                    break
                path_len += 1
            if path_len:
                handles = [plan.segments[i].handle or by_segment[i].handle for i in range(path_len)]
                result = self.tree.insert(
                    list(keys[:path_len]), handles, [plan.segments[i].n_tokens for i in range(path_len)],
                    [self._sizes[h] for h in handles],
                )
                for node in result.nodes:
                    self._nodes[node.handle] = node
            for n in new:
                if n.meta is None or n.handle not in self._sizes or n.handle in self._variants:
                    continue
                added = self.index.add(keys[n.segment], n.handle, n.meta)
                if added.admitted:
                    self._variants[n.handle] = added.variant
                self._unref(added.evicted)
            self._unref([n.handle for n in new])  # stored but referenced by nothing
            self._enforce_capacity()
            self._sync_drops()  # the puts may have made the store drop others
            self.counters["stored"] += stored
        return {"stored": stored}

    def _store_new(self, plan: Plan, keys: Sequence[str], new: Sequence[NewEntry], exact: int,
                   priority: float | None) -> int:
        """``admit``'s puts (lock held): each new entry stored under its handle, room made for it
        by the policy first; returns how many were stored."""
        stored = 0
        for n in new:
            sp = plan.segments[n.segment]
            if (sp.action is not Action.FRESH and sp.handle is not None and sp.handle != n.handle
                    and sp.handle in self._sizes and not self.store.contains(sp.handle)):
                self._lost(sp.handle)  # a planned variant could not be loaded: it is gone
            in_tree = n.segment < exact  # computed on an exact prefix: its KV equals full prefill
            parent = path_key(keys[:n.segment]) if in_tree and n.segment > 0 else None
            p = priority if priority is not None else self._initial_priority(
                sp.start if in_tree else 0, sp.n_tokens, n.nbytes)
            if n.handle in self._sizes and in_tree and n.handle not in self._exact:
                # the handle (= path) holds approximate KV: a variant computed behind reused
                # chunks of the same sequence. The exact entry replaces it; approximate KV
                # never becomes a tree node (the tree path below would reference it)
                self._invalidate(n.handle)
                self.counters["replaced_approximate"] += 1
            if n.handle in self._sizes:  # the same segment in the same context is referenced:
                if self.store.contains(n.handle):  # stored (another request admitted it first)
                    continue
                if not in_tree and n.handle in self._exact:  # an exact entry was lost: approximate
                    self._invalidate(n.handle)  # KV never takes its place (the tree node goes)
                    continue
                # lost since it was planned (its load missed): store it again; the tree node
                # and its subtree stay valid, the KV is the same
                if self._put(n.handle, n.entry, p, parent):
                    self.counters["restored"] += 1
                    stored += 1
                else:
                    self._invalidate(n.handle)
                continue
            if self._make_room(n.nbytes) and self._put(n.handle, n.entry, p, parent):
                self._track(n.handle, n.nbytes, exact=in_tree)
                stored += 1
        return stored

    # ---------------------------------------------------------------- references (lock held)
    def _track(self, handle: str, nbytes: int, exact: bool) -> None:
        if handle not in self._sizes:
            self._sizes[handle] = nbytes
            self._bytes += nbytes
            if exact:
                self._exact.add(handle)

    def _put(self, handle: str, entry: Any, priority: float, parent: str | None) -> bool:
        if self.features.placement:
            return bool(self.store.put(handle, entry, priority=priority, parent=parent))
        return bool(self.store.put(handle, entry))

    def _unref(self, handles) -> None:
        """Drop detached tree nodes / variants from the maps; remove entries nothing references."""
        for h in handles:
            node = self._nodes.get(h)
            if node is not None and not node.attached:
                del self._nodes[h]
            variant = self._variants.get(h)
            if variant is not None and not variant.attached:
                del self._variants[h]
            if h in self._sizes and h not in self._nodes and h not in self._variants:
                self._bytes -= self._sizes.pop(h)
                self._exact.discard(h)
                self.store.remove(h)

    def _invalidate(self, handle: str) -> bool:
        if handle not in self._sizes:
            return False
        freed = [handle]
        node = self._nodes.get(handle)
        if node is not None and node.attached:
            freed += self.tree.remove(node)
        variant = self._variants.get(handle)
        if variant is not None and variant.attached:
            self.index.remove(variant)
        self.counters["invalidated"] += 1
        self._unref(freed)
        return True

    def _lost(self, handle: str) -> None:
        """A referenced entry could not be read. Its variant goes at once (no request stores a
        variant again under its old handle); its tree node stays: the request computes that
        segment fresh, under the same path and handle, and ``admit`` stores it back."""
        variant = self._variants.get(handle)
        if variant is not None and variant.attached:
            self.index.remove(variant)
            self.counters["lost"] += 1
            self._unref([handle])

    def _sync_drops(self) -> None:
        """Forget the entries the store deleted for lack of room since the last call."""
        if not self.features.drops:
            return
        keys, self._drop_cursor, complete = self.store.drops_since(self._drop_cursor)
        for key in keys:
            if key in self._sizes and not self.store.contains(key):
                self.counters["store_drops"] += 1
                self._invalidate(key)
        if not complete:
            self._prune()

    def _prune(self) -> int:
        gone = [h for h in list(self._sizes) if not self.store.contains(h)]
        for h in gone:
            self._invalidate(h)
        return len(gone)

    def _enforce_capacity(self) -> None:
        if self.capacity_bytes is not None:
            self._evict_to(self.capacity_bytes)

    def _make_room(self, nbytes: int) -> bool:
        """Before a put: evict by the policy until ``nbytes`` more fit under ``capacity_bytes``;
        False if they cannot (what is left is this admission's own entries: the entry is not
        stored). Left to itself, a full store would make room by its own order (a memory tier:
        least recently used), not the policy's, and a store without a drop log would leave the
        manager referencing, planning hits on and budgeting for entries it no longer has."""
        if self.capacity_bytes is None:
            return True
        if nbytes <= self.capacity_bytes:
            self._evict_to(self.capacity_bytes - nbytes)
        return self._bytes + nbytes <= self.capacity_bytes

    def _evict_to(self, limit: int) -> None:
        """Evict tree leaves by the tree's policy, then the lowest-f_r variants, until the
        referenced bytes are at most ``limit``: first passing over the held chunks (``hold``),
        then, if that was not enough, taking them too."""
        for spare in ((self._held, frozenset()) if self._held else (frozenset(),)):
            over = self._bytes - limit
            if over > 0:
                self._unref(self.tree.evict_until(over, spare=spare))
            if self._bytes > limit:
                self.index.evict_while(lambda handle: self._unref([handle]) or self._bytes > limit, spare=spare)
            if self._bytes <= limit:
                return

    def hold(self, chunk_keys) -> None:
        """The chunks requests are waiting to use (the server's admission queue): until the next
        call, eviction passes over their variants and tree nodes while anything else can go, so
        a waiting request still finds what was cached when it arrived (RAGCache's point about
        queued requests, kept without reordering them). A store with ``hold`` (``TieredStore``,
        whose tiers move entries by their own policy) gets their entries' handles, which its
        tiers move out last. Replaces the previous set."""
        with self._lock:
            self._held = frozenset(chunk_keys)
            if self.features.hold:  # a store that places by its own policy (TieredStore): their entries
                handles = {v.handle for k in self._held for v in self.index.variants(k)}
                if self._held:  # one pass over the tree's nodes, only when something is held
                    handles |= {h for h, node in self._nodes.items() if node.key in self._held}
                self.store.hold(handles)

    # ---------------------------------------------------------------- priorities
    def _cost(self, prefix_tokens: int, n_tokens: int) -> float:
        profile = self.tree.profile
        return profile.marginal_cost(prefix_tokens, n_tokens) if profile is not None else float(n_tokens)

    def _initial_priority(self, prefix_tokens: int, n_tokens: int, nbytes: int) -> float:
        """Priority of a new entry (one access / f_r = 1), on the scale of ``_priority``."""
        return self.tree.clock + self._cost(prefix_tokens, n_tokens) / max(nbytes, 1)

    def _priority(self, handle: str) -> float:
        best = 0.0
        node = self._nodes.get(handle)
        if node is not None and node.stats is not None:
            best = _VALUE.priority(node.stats)
        variant = self._variants.get(handle)
        if variant is not None:
            nbytes = max(self._sizes.get(handle, 1), 1)
            best = max(best, self.tree.clock + variant.reuse_score * self._cost(0, variant.n_tokens) / nbytes)
        return best

    def priority(self, handle: str) -> float | None:
        """The store priority the policy gives ``handle`` now (None if not referenced)."""
        with self._lock:
            return self._priority(handle) if handle in self._sizes else None

    # ---------------------------------------------------------------- stats and checks
    @property
    def used_bytes(self) -> int:
        with self._lock:
            return self._bytes

    def refcount(self, handle: str) -> int:
        """How many references (tree node, variant) ``handle`` has: 0, 1 or 2."""
        with self._lock:
            return int(handle in self._nodes) + int(handle in self._variants)

    def handles(self) -> list[str]:
        """Referenced handles (each one stored)."""
        with self._lock:
            return list(self._sizes)

    def check(self) -> list[str]:
        """Reference-consistency violations (empty when all hold): the maps equal the tree's
        and the index's contents, every referenced handle is counted once, bytes add up."""
        problems: list[str] = []
        with self._lock:
            tree = {n.handle for n in self.tree.nodes()}
            variants = {v.handle for v in self.index.all_variants()}
            if tree != set(self._nodes):
                problems.append(f"tree handles differ from the node map by {len(tree ^ set(self._nodes))}")
            if variants != set(self._variants):
                problems.append(f"variant handles differ from the variant map by {len(variants ^ set(self._variants))}")
            referenced = tree | variants
            if referenced != set(self._sizes):
                problems.append(f"{len(referenced ^ set(self._sizes))} handles referenced xor tracked")
            if self._bytes != sum(self._sizes.values()):
                problems.append(f"bytes {self._bytes} != sum of sizes {sum(self._sizes.values())}")
            if self.capacity_bytes is not None and self._bytes > self.capacity_bytes:
                problems.append(f"bytes {self._bytes} > capacity {self.capacity_bytes}")
        return problems

    def stats(self) -> dict[str, Any]:
        with self._lock:
            out = {
                "entries": len(self._sizes),
                "bytes": self._bytes,
                "tree_nodes": len(self.tree),
                "variants": len(self.index),
                "chunks": self.index.n_chunks,
                "repeat_fingerprints": len(self._repeats),
                **self.counters,
            }
        if self.last_refresh is not None:
            out["last_refresh"] = self.last_refresh.as_dict()
        return out
