"""The chunk-cache manager: one knowledge tree, one variant index, one store of entries.

Owns: planning requests (through ``Planner``), admitting what a request computed (exact
prefix paths into the tree, fresh chunks as variants), and the lifetime of stored entries:
an entry (one segment's raw K + V) may be referenced by a tree node and by a variant at once,
so entries are reference-counted by handle and removed from the store when the last reference
goes. Pure Python: entries are opaque objects handed to ``store.put``; never imports torch.

Does not own: tensors (the engine makes entries), tier placement (the store), or the
thresholds (``CacheConfig``).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from cachedrag.kvcache.config import CacheConfig
from cachedrag.kvcache.index import VariantIndex
from cachedrag.kvcache.planner import Mode, Plan, Planner, PlanRequest
from cachedrag.kvcache.profile import PrefillProfile
from cachedrag.kvcache.tree import KnowledgeTree
from cachedrag.kvcache.variants import AttentionMetadata


@dataclass(frozen=True)
class NewEntry:
    """A segment the request computed fresh: its store handle, entry, size and metadata."""

    segment: int  # index into plan.segments
    handle: str
    entry: Any
    nbytes: int
    meta: AttentionMetadata | None  # None for system segments (never variants)


class ChunkCacheManager:
    """Tree + variants + refcounted store handles, safe for concurrent requests."""

    def __init__(self, store, config: CacheConfig | None = None, capacity_bytes: int | None = None,
                 profile: PrefillProfile | None = None):
        self.config = config or CacheConfig()
        self.store = store
        self.capacity_bytes = capacity_bytes
        self.tree = KnowledgeTree(self.config.policy, profile=profile)
        self.index = VariantIndex.from_config(self.config)
        self.planner = Planner(self.tree, self.index, self.config)
        self._refs: dict[str, int] = {}
        self._sizes: dict[str, int] = {}
        self._lock = threading.RLock()

    # ---------------------------------------------------------------- planning
    def plan(self, request: PlanRequest, mode: str | Mode) -> Plan:
        return self.planner.plan(request, mode)

    def release(self, plan: Plan, used: bool = True) -> None:
        self.planner.release(plan, used=used)

    def load(self, handle: str):
        """The stored entry of ``handle`` or None (evicted, corrupt, foreign: always a miss)."""
        return self.store.get(handle)

    # ---------------------------------------------------------------- admission
    def admit(self, plan: Plan, keys: Sequence[str], new: Sequence[NewEntry], priority: float = 0.0) -> dict[str, int]:
        """Store what ``plan``'s request computed and reference it from the tree and the index.

        ``keys`` are the plan's segment keys in order. Exact leading segments
        (``plan.exact_prefix_segments``) become a tree path; fresh chunks become variants.
        Returns counts for stats.
        """
        by_segment = {n.segment: n for n in new}
        stored = 0
        with self._lock:
            for n in new:
                if n.handle in self._refs:  # the same segment in the same context is already stored
                    continue
                if self.store.put(n.handle, n.entry):
                    self._refs[n.handle] = 0
                    self._sizes[n.handle] = n.nbytes
                    stored += 1
            exact = plan.exact_prefix_segments
            path_len = 0
            for i in range(exact):  # the tree path stops at the first segment with no stored entry
                seg = plan.segments[i]
                handle = seg.handle if seg.handle is not None else (by_segment[i].handle if i in by_segment else None)
                if handle is None or handle not in self._refs:
                    break
                path_len += 1
            if path_len:
                handles = [plan.segments[i].handle or by_segment[i].handle for i in range(path_len)]
                for h in handles:
                    self._refs[h] += 1
                result = self.tree.insert(
                    list(keys[:path_len]), handles, [plan.segments[i].n_tokens for i in range(path_len)],
                    [self._sizes.get(h, 0) for h in handles],
                )
                self._drop(result.unused_handles)
            for n in new:
                if n.meta is None or n.handle not in self._refs:
                    continue
                self._refs[n.handle] += 1
                added = self.index.add(keys[n.segment], n.handle, n.meta)
                self._drop(added.evicted)
            for n in new:  # stored but referenced by nothing (e.g. not admitted anywhere)
                if self._refs.get(n.handle) == 0:
                    self._drop([n.handle], decref=False)
            self._enforce_capacity()
        return {"stored": stored}

    def _drop(self, handles, decref: bool = True) -> None:
        for h in handles:
            if h not in self._refs:
                continue
            if decref:
                self._refs[h] -= 1
            if self._refs[h] <= 0:
                del self._refs[h]
                self._sizes.pop(h, None)
                self.store.remove(h)

    def _enforce_capacity(self) -> None:
        if self.capacity_bytes is None:
            return
        over = self.used_bytes - self.capacity_bytes
        if over > 0:
            self._drop(self.tree.evict_until(over))
        while self.used_bytes > self.capacity_bytes and len(self.index) > 0:
            evicted = self.index.evict(1)
            if not evicted:
                break
            self._drop(evicted)

    # ---------------------------------------------------------------- stats
    @property
    def used_bytes(self) -> int:
        with self._lock:
            return sum(self._sizes.values())

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {
                "entries": len(self._refs),
                "bytes": sum(self._sizes.values()),
                "tree_nodes": len(self.tree.nodes()),
                "variants": len(self.index),
                "chunks": self.index.n_chunks,
            }
