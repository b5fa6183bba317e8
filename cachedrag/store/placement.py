"""Executing placement decisions over a store's ordered tiers.

Owns: the moves ``TieredStore`` makes (place an entry in a tier after moving lower-ordered ones
out, demote before delete, swap-out-only-once, drop with cached descendants, lift toward a
faster tier, parents before children), the index repairs when a tier no longer holds what the
index says (``lost``, ``heal_links``), the log of drops (``drops_since``) and the store-level
counters (``StoreStats``). Does not own: the decisions (``policy.PlacementPolicy``: which tier,
which victims), the tiers' bytes and media, or the public get/put API (``tiered``).

Locking: every method but ``lost``, ``drops_since`` and ``promote_after_read`` (which take it)
expects the store lock held; tier locks are taken inside, always after it.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from cachedrag.store.base import Tier
from cachedrag.store.codec import encode
from cachedrag.store.cpu import MemoryTier
from cachedrag.store.entry import KVEntry
from cachedrag.store.policy import PlacementPolicy


@dataclass
class StoreStats:
    """Store-level counters (per-tier counters live in each tier's ``TierStats``)."""

    puts: int = 0
    puts_existing: int = 0  # put of a key already cached: priority/parent updated, no rewrite
    puts_refused: int = 0  # no tier would take the entry
    hits: int = 0
    misses: int = 0
    promotions: int = 0  # copies made into a faster tier on reuse / prefetch
    demotions: int = 0  # entries moved (or, if already there, handed) to a slower tier
    demotion_writes_saved: int = 0  # demotions where the slower tier already held the copy
    drops: int = 0  # entries deleted from the store for lack of room anywhere
    stale_index: int = 0  # a tier no longer held what the index said (removed as corrupt, TTL, other process)
    prefetches: int = 0
    load_seconds: float = 0.0  # time in get() reading hits

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


class Placement:
    """The moves of one ``TieredStore``: its tiers, index (``PlacementPolicy``), counters and lock."""

    def __init__(self, tiers: Sequence[Tier], namespace: str, policy: PlacementPolicy, stats: StoreStats,
                 lock: threading.RLock, drop_log_size: int = 65536) -> None:
        self.tiers = list(tiers)
        self.namespace = namespace
        self.stats = stats
        self._policy = policy
        self._lock = lock
        self._drop_log: deque[str] = deque(maxlen=drop_log_size)  # keys deleted for lack of room
        self._drop_seq = 0  # drops logged since start (the log keeps the last ``maxlen``)

    def lost(self, key: str, tier: int) -> None:
        """The index said ``tier`` holds ``key`` and it did not: fix the index."""
        with self._lock:
            node = self._policy.node(key)
            if node is None or tier not in node.copies or self.tiers[tier].contains(key):
                return
            self.stats.stale_index += 1
            self._policy.drop_copy(key, tier)
            if not node.copies:
                self._policy.forget(key)
                return
            self.heal_links(key)

    def heal_links(self, key: str) -> None:
        """Store lock held. ``key`` lost a fast copy (or came back from a shared tier) and may now
        sit slower than its cached children: drop those links (they only order evictions, so no
        I/O is needed and nothing is served differently)."""
        node = self._policy.cached(key)
        if node is None:
            return
        for child in self._policy.children_of(key):
            if child.level < node.level:
                self._policy.unlink(child.key)

    def remove_copies(self, key: str) -> bool:
        """Remove every local copy of ``key``; ``False`` if a tier kept one (it stays indexed)."""
        node = self._policy.node(key)
        if node is None:
            return True
        return all([self.remove_copy(key, t) for t in sorted(node.copies)])

    def remove_copy(self, key: str, t: int) -> bool:
        """Remove ``key`` from tier ``t`` and the index; a copy the tier could not delete stays
        in the index (the tier still holds and charges it)."""
        if self.tiers[t].remove(key) or not self.tiers[t].contains(key):
            self._policy.drop_copy(key, t)
            return True
        return False

    def place(
        self,
        key: str,
        entry: KVEntry,
        j: int,
        protect: set[str],
        blobs: dict[str, bytes],
        *,
        copy: bool,
        evict: str = "all",
    ) -> bool:
        """Store ``key`` in tier ``j``, moving lower-ordered entries out first.

        ``evict``: ``"all"`` (duplicates, then lower-ordered primaries), ``"duplicates"``
        (only copies that also live in a faster tier) or ``"none"`` (free room only).
        """
        node = self._policy.nodes[key]
        if j in node.copies:
            return True  # already there (swap-out-only-once)
        tier = self.tiers[j]
        blob = None
        if tier.serialized:
            blob = blobs.get(key)
            if blob is None:
                blob = blobs[key] = encode(key, entry, self.namespace)
        prepared = tier.prepare(key, entry, blob=blob, copy=copy)
        if not tier.shared:
            if prepared.nbytes > tier.budget_bytes:
                return False
            need = tier.used_bytes + prepared.nbytes - tier.budget_bytes
            if need > 0:
                if evict == "none":
                    return False
                victims = self._policy.victims(j, need, tier.entry_bytes, key, protect, primaries=evict == "all")
                if victims is None:
                    return False
                for victim in victims:
                    self.evict(victim, j, protect, blobs)
                if tier.used_bytes + prepared.nbytes > tier.budget_bytes:
                    return False
        if not tier.commit(prepared):
            return False
        self._policy.add_copy(key, j)
        return True

    def evict(self, key: str, j: int, protect: set[str], blobs: dict[str, bytes]) -> None:
        """Move ``key`` out of tier ``j``: drop a duplicate, else demote, else delete."""
        node = self._policy.node(key)
        if node is None or j not in node.copies:
            return
        if node.level < j or any(c > j for c in node.copies):
            if not self.remove_copy(key, j):
                return
            self.heal_links(key)  # its children may now sit faster than its remaining (shared) copy
            if node.level is not None and node.level > j:
                self.stats.demotions += 1
                self.stats.demotion_writes_saved += 1
            return
        entry = self.peek(j, key)
        demoted = False
        if entry is not None:
            children = [c.level for c in self._policy.children_of(key)]
            deepest = min(children) if children else len(self.tiers) - 1
            inner = protect | {key, *self._policy.ancestors(key)}
            for k in range(j + 1, deepest + 1):
                if self.place(key, entry, k, inner, blobs, copy=False):
                    demoted = True
                    break
        if not self.remove_copy(key, j):
            return  # undeletable here (read-only disk): it stays, and the caller finds no room
        if demoted:
            self.stats.demotions += 1
        else:
            self.drop(key)

    def drop(self, key: str) -> None:
        """Delete ``key`` and its cached descendants from every tier (logged for ``drops_since``)."""
        for k in [*self._policy.descendants(key), key]:
            if not self.remove_copies(k):
                self.heal_links(k)
                continue  # a tier could not delete it: it stays indexed where it is
            self._policy.forget(k)
            self._policy.unlink(k)
            self.stats.drops += 1
            self._drop_log.append(k)
            self._drop_seq += 1

    def drops_since(self, cursor: int) -> tuple[list[str], int, bool]:
        """Keys the store deleted for lack of room since ``cursor`` (0 at start).

        Returns ``(keys, new_cursor, complete)``; ``complete`` is False when more drops
        happened than the log keeps (the caller should then check what it references with
        ``contains``). Explicit ``remove`` calls are not logged.
        """
        with self._lock:
            behind = self._drop_seq - cursor
            if behind <= 0:
                return [], self._drop_seq, True
            log = list(self._drop_log)
            complete = behind <= len(log)
            return log[len(log) - min(behind, len(log)):], self._drop_seq, complete

    def promote_after_read(self, key: str, entry: KVEntry, found_at: int, version: int) -> KVEntry | None:
        with self._lock:
            node = self._policy.node(key)
            if node is None or node.version != version or node.level is None or node.level < found_at:
                return None  # replaced, removed or promoted meanwhile
            placed = self.lift(key, entry, found_at, 0, {key}, {})
            if placed is None:
                return None
            return self.peek(placed, key)

    def lift(self, key: str, entry: KVEntry, found_at: int, target: int, protect: set[str], blobs: dict[str, bytes]) -> int | None:
        """Copy ``key`` (read from ``found_at``) into the fastest tier in ``[target, found_at)`` taking it."""
        protect = protect | {key, *self._policy.ancestors(key)}
        parent = self._policy.parent_of(key)
        if parent is not None and parent.level > target:
            self.lift_cached(parent.key, target, protect, blobs)
            parent = self._policy.parent_of(key)
        start = max(target, parent.level if parent is not None else 0)
        for j in range(start, found_at):
            if self.place(key, entry, j, protect, blobs, copy=False):
                self.stats.promotions += 1
                return j
        return None

    def lift_cached(self, key: str, target: int, protect: set[str], blobs: dict[str, bytes]) -> None:
        """Promote an already cached ``key`` (e.g. a parent) toward ``target``."""
        node = self._policy.cached(key)
        if node is None or node.level <= target:
            return
        level = node.level
        entry = self.peek(level, key)
        if entry is None:
            return
        self.lift(key, entry, level, target, protect, blobs)

    def peek(self, j: int, key: str) -> KVEntry | None:
        """Read ``key`` from tier ``j`` for a move (memory tiers: no copy, no stats)."""
        tier = self.tiers[j]
        if isinstance(tier, MemoryTier):
            return tier.peek(key)
        entry = tier.get(key)
        if entry is None:
            self.lost(key, j)
        return entry

    def repair_parent(self, key: str) -> None:
        """After a new parent link: lift the parent to the child's tier, else drop the link."""
        node = self._policy.nodes[key]
        parent = self._policy.parent_of(key)
        if parent is None or parent.level <= node.level:
            return
        self.lift_cached(parent.key, node.level, {key, *self._policy.ancestors(key)}, {})
        parent = self._policy.parent_of(key)
        if parent is not None and parent.level > node.level:
            self._policy.unlink(key)
