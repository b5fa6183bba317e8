"""The tiered chunk-cache store: ordered tiers (fastest first) behind one get/put API.

Owns: composing tiers behind the one tier interface (``base.Tier``), the get/put/remove API
and when it places, promotes or removes, probing shared tiers, and the entry points for
preloading (``prefetch``, ``open_layers``). Does not own: the decisions themselves
(``policy``), executing the moves and the store's counters (``placement``), bytes and media
(tiers), threads that load ahead (``preload``).

Placement, in short (details in ``docs/store.md``):

- ``put(key, entry, priority, parent)`` places the entry in the fastest tier where it can
  make room by moving out entries of lower priority (``policy.victims``); otherwise the
  next tier, and so on; if none takes it, the put is refused (``False``).
- A victim is demoted to the next tier that takes it (making room there the same way)
  before anything is deleted; only what no tier takes is dropped, with its cached
  descendants. When a slower tier already holds the victim's copy (it was promoted from
  there), the demotion just forgets the fast copy: swap-out-only-once.
- ``get`` from a slow tier copies the entry up to the fastest tier that takes it (the slow
  copy stays), possibly demoting others; its ancestors are promoted first.
- Parents are never slower than their children: children leave a tier first, parents are
  promoted first, and a put lands no slower than its cached children allow.
- Shared tiers (Redis) are probed on a miss and evict by their own LRU (other processes
  write there too); the tree rule is kept for the local tiers.

Drops are logged (``drops_since``) so that a policy layer holding references to entries
(``ChunkCacheManager``) learns which ones the store deleted for lack of room.

Locking: one store lock serializes placement (cheap bookkeeping plus the tier writes it
decides); tier reads of a ``get`` run outside it, so hits in different tiers proceed in
parallel. Tiers have their own locks; lock order is always store -> tier.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Iterable, Sequence

import torch

from cachedrag.errors import ConfigError
from cachedrag.store.base import EntryInfo, Tier, check_key
from cachedrag.store.codec import check_namespace
from cachedrag.store.config import StoreConfig
from cachedrag.store.cpu import CPUTier
from cachedrag.store.entry import KVEntry
from cachedrag.store.placement import Placement, StoreStats
from cachedrag.store.policy import PlacementPolicy, SortKey, priority_then_recency
from cachedrag.store.preload import LayerLoader, PrefetchHandle, Prefetcher


class TieredStore:
    """Ordered tiers (fastest first) with priority placement; thread-safe."""

    def __init__(
        self,
        tiers: Sequence[Tier],
        *,
        namespace: str,
        write_through: bool = False,
        prefetch_workers: int = 1,
        sort_key: SortKey = priority_then_recency,
        drop_log_size: int = 65536,
    ) -> None:
        if not tiers:
            raise ConfigError("a TieredStore needs at least one tier")
        names = [t.name for t in tiers]
        if len(set(names)) != len(names):
            raise ConfigError(f"tier names must be unique, got {names}")
        for t in tiers:
            if t.namespace != namespace:
                raise ConfigError(f"tier {t.name} has namespace {t.namespace!r}, store has {namespace!r}")
            if not t.shared:
                t.self_evict = False  # the store chooses victims in local tiers
        self.tiers = list(tiers)
        self.namespace = namespace
        self.write_through = write_through
        self.stats = StoreStats()
        self._policy = PlacementPolicy(len(self.tiers), sort_key)
        self._lock = threading.RLock()
        self._placement = Placement(self.tiers, namespace, self._policy, self.stats, self._lock, drop_log_size)
        self._prefetcher = Prefetcher(self._fetch_up, prefetch_workers)
        self._loaders: weakref.WeakSet[LayerLoader] = weakref.WeakSet()
        for i, tier in enumerate(self.tiers):  # adopt what local tiers already hold (disk after a restart)
            if not tier.shared:
                for key in tier.keys():
                    self._policy.ensure(key)
                    self._policy.add_copy(key, i)

    @classmethod
    def from_config(cls, config: StoreConfig) -> TieredStore:
        """Build gpu -> cpu -> disk -> redis tiers from a validated ``StoreConfig``."""
        tiers: list[Tier] = []
        ns = config.namespace
        if config.gpu_bytes:
            from cachedrag.store.gpu import GPUTier

            tiers.append(GPUTier(config.gpu_bytes, namespace=ns, device=config.gpu_device))
        if config.cpu_bytes:
            tiers.append(CPUTier(config.cpu_bytes, namespace=ns, pin_memory=config.pin_memory))
        if config.disk_dir is not None:
            from cachedrag.store.disk import DiskTier

            tiers.append(DiskTier(config.disk_dir, config.disk_bytes, namespace=ns,
                                  validate=config.disk_validate, fsync=config.disk_fsync))
        if config.redis_url is not None:
            from cachedrag.store.redis_tier import RedisTier

            tiers.append(RedisTier(config.redis_url, config.redis_bytes, namespace=ns,
                                   ttl_s=config.redis_ttl_s, prefix=config.redis_prefix,
                                   timeout_s=config.redis_timeout_s, breaker_failures=config.redis_breaker_failures,
                                   breaker_reset_s=config.redis_breaker_reset_s))
        return cls(tiers, namespace=ns, write_through=config.write_through, prefetch_workers=config.prefetch_workers)

    # ---- queries -------------------------------------------------------------------------
    def tier(self, name: str) -> Tier:
        for t in self.tiers:
            if t.name == name:
                return t
        raise KeyError(f"no tier named {name!r}; tiers: {[t.name for t in self.tiers]}")

    def contains(self, key: str) -> bool:
        """Whether a tier holds ``key``: the index's tiers are asked (a copy a tier removed on
        its own, e.g. found corrupt by a layer loader, is dropped from the index), then shared
        tiers are probed."""
        check_key(key)
        with self._lock:
            node = self._policy.cached(key)
            copies = sorted(node.copies) if node is not None else []
        for i in copies:
            if self.tiers[i].contains(key):
                return True
            self._placement.lost(key, i)
        return any(t.contains(key) for i, t in enumerate(self.tiers) if t.shared and i not in copies)

    def contains_many(self, keys: Sequence[str]) -> list[bool]:
        return [self.contains(k) for k in keys]

    def where(self, key: str) -> str | None:
        """Name of the fastest tier holding ``key`` (local index; shared tiers probed)."""
        with self._lock:
            node = self._policy.cached(key)
            if node is not None:
                return self.tiers[node.level].name
        return next((t.name for t in self.tiers if t.shared and t.contains(key)), None)

    def priority(self, key: str) -> float | None:
        with self._lock:
            node = self._policy.node(key)
            return None if node is None else node.priority

    def keys(self, *, shared: bool = False) -> list[str]:
        """Keys cached in the local tiers; with ``shared``, also every key of this namespace in
        the shared tiers (a scan of the Redis accounting set: O(all values under the prefix))."""
        with self._lock:
            out = [k for k, n in self._policy.nodes.items() if n.copies]
        if shared:
            seen = set(out)
            for tier in self.tiers:
                if tier.shared:
                    for k in tier.keys():
                        if k not in seen:
                            seen.add(k)
                            out.append(k)
        return out

    # ---- header-only reads ---------------------------------------------------------------
    def info(self, key: str) -> EntryInfo | None:
        """``key``'s meta, tensor bytes and shape from the fastest tier holding it, reading no
        K/V (disk: the safetensors header; Redis: ``GETRANGE`` of it). No promotion, no stats."""
        return self._header_read(key, lambda tier: tier.info(key))

    def meta(self, key: str) -> dict[str, str] | None:
        """``entry.meta`` of ``key`` from its header (``None`` when no tier holds it)."""
        info = self.info(key)
        return None if info is None else info.meta

    def extras(self, key: str) -> dict[str, torch.Tensor] | None:
        """The non-layered tensors of ``key`` (e.g. ``token_inter`` ``[T]``) without its K/V."""
        return self._header_read(key, lambda tier: tier.extras(key))

    def _header_read(self, key: str, read):
        check_key(key)
        with self._lock:
            node = self._policy.cached(key)
            order = sorted(node.copies) if node is not None else []
        order += [i for i, t in enumerate(self.tiers) if t.shared and i not in order]
        for i in order:
            got = read(self.tiers[i])
            if got is not None:
                return got
            if not self.tiers[i].shared:
                self._placement.lost(key, i)
        return None

    # ---- get -----------------------------------------------------------------------------
    def get(self, key: str, *, promote: bool = True) -> KVEntry | None:
        """The entry (from the fastest tier holding it), or ``None``.

        With ``promote``, a hit in a slower tier is copied up toward the fastest tier (the
        returned entry is then the fast copy). The entry is shared with the store: read-only.
        """
        check_key(key)
        t0 = time.perf_counter()
        entry, found_at, version = self._read(key)
        with self._lock:
            if entry is None:
                self.stats.misses += 1
                return None
            self.stats.hits += 1
            self.stats.load_seconds += time.perf_counter() - t0
        if promote and found_at > 0:
            lifted = self._placement.promote_after_read(key, entry, found_at, version)
            if lifted is not None:
                entry = lifted
        return entry

    def get_many(self, keys: Sequence[str], *, promote: bool = True) -> list[KVEntry | None]:
        return [self.get(k, promote=promote) for k in keys]

    def _read(self, key: str) -> tuple[KVEntry | None, int, int]:
        """Read ``key`` from the fastest tier that has it (outside the store lock)."""
        with self._lock:
            node = self._policy.cached(key)
            order = sorted(node.copies) if node is not None else []
            version = node.version if node is not None else -1
            self._policy.touch(key)
        for i in order:
            entry = self.tiers[i].get(key)
            if entry is not None:
                return entry, i, version
            self._placement.lost(key, i)
        for i, tier in enumerate(self.tiers):
            if tier.shared and i not in order:
                entry = tier.get(key)
                if entry is not None:
                    with self._lock:
                        node = self._policy.ensure(key)
                        self._policy.add_copy(key, i)
                        self._policy.touch(key)
                        self._placement.heal_links(key)
                        return entry, i, node.version
        return None, -1, -1

    # ---- put -----------------------------------------------------------------------------
    def put(
        self,
        key: str,
        entry: KVEntry,
        *,
        priority: float = 0.0,
        parent: str | None = None,
        replace: bool = False,
    ) -> bool:
        """Cache ``entry`` under ``key`` in the fastest tier its ``priority`` earns.

        ``priority``: higher is more valuable (the engine's score, e.g. PGDSF or Cache-Craft's
        frequency-reuse). ``parent``: the key of the prefix entry this one extends (knowledge
        tree); a parent is never kept in a slower tier than its children. A key already
        cached is not rewritten (keys name content) unless ``replace``; its priority and
        parent are updated. Returns whether the entry is cached.
        """
        check_key(key)
        if parent is not None:
            check_key(parent)
        check_namespace(entry, self.namespace)
        with self._lock:
            node = self._policy.cached(key)
            if node is not None and not replace:
                old_parent = node.parent
                self._policy.ensure(key, priority, parent)
                self._policy.touch(key)
                if node.parent != old_parent:
                    self._placement.repair_parent(key)
                self.stats.puts_existing += 1
                return True
            if node is not None:
                self._placement.remove_copies(key)
            node = self._policy.ensure(key, priority, parent)
            node.version += 1
            self._policy.touch(key)
            protect = {key, *self._policy.ancestors(key)}
            blobs: dict[str, bytes] = {}
            parent_node = self._policy.parent_of(key)
            if parent_node is not None and parent_node.level > 0:
                self._placement.lift_cached(parent_node.key, 0, protect, blobs)
            placed = None
            for j in self._policy.allowed_levels(key):
                if self._placement.place(key, entry, j, protect, blobs, copy=True):
                    placed = j
                    break
            if placed is None:
                self._policy.forget(key)
                self.stats.puts_refused += 1
                return False
            if self.write_through:
                for k in range(placed + 1, len(self.tiers)):
                    if self.tiers[k].persistent:
                        self._placement.place(key, entry, k, protect, blobs, copy=True, evict="duplicates")
            self.stats.puts += 1
            return True

    def put_many(self, items: Iterable[tuple[str, KVEntry]], *, priority: float = 0.0) -> list[bool]:
        return [self.put(k, e, priority=priority) for k, e in items]

    def set_priority(self, key: str, priority: float, *, parent: str | None = None) -> bool:
        """Update ``key``'s priority (used at its next placement decision) and, with ``parent``,
        record its knowledge-tree parent (the parent is lifted to the child's tier, as in
        ``put``). ``False`` if the key is not cached in a local tier."""
        if parent is not None:
            check_key(parent)
        with self._lock:
            node = self._policy.cached(key)
            if node is None:
                return False
            node.priority = float(priority)
            if parent is not None and parent != node.parent and parent != key:
                try:
                    self._policy.link(key, parent)
                except ValueError:
                    return True  # would make a cycle: keep the old link
                self._placement.repair_parent(key)
            return True

    def hold(self, keys) -> None:
        """Keys that waiting requests will read: until the next call, a tier making room moves
        them out after every other eligible entry (``PlacementPolicy.held``). Replaces the set."""
        with self._lock:
            self._policy.held = frozenset(keys)

    # ---- remove --------------------------------------------------------------------------
    def remove(self, key: str) -> bool:
        """Delete ``key`` from every tier (shared tiers included). Its children stay cached.

        ``True`` when it was cached and now is gone from every local tier; ``False`` when it
        was not cached, or when a tier could not delete its copy (e.g. a read-only disk: the
        tier warns, and the copy stays indexed and charged where it is)."""
        check_key(key)
        with self._lock:
            had = self._policy.cached(key) is not None
            gone = self._placement.remove_copies(key)
            if gone:
                self._policy.forget(key)
                self._policy.unlink(key)
            else:
                self._placement.heal_links(key)
        for tier in self.tiers:
            if tier.shared:
                had = tier.remove(key) or had
        return had and gone

    def drops_since(self, cursor: int) -> tuple[list[str], int, bool]:
        """Keys the store deleted for lack of room since ``cursor`` (``Placement.drops_since``)."""
        return self._placement.drops_since(cursor)

    # ---- preloading ----------------------------------------------------------------------
    def prefetch(self, keys: Iterable[str]) -> PrefetchHandle:
        """Start moving ``keys`` toward the fastest tier in background threads; returns at once."""
        keys = [check_key(k) for k in keys]
        with self._lock:
            self.stats.prefetches += len(keys)
        return self._prefetcher.submit(keys)

    def wait_prefetches(self, timeout: float | None = None) -> bool:
        """Block until every promotion started so far finished (or ``timeout``); ``True`` if all did.
        The engine starts them after a request (``CachedEngine`` promotes what it reused), so
        whoever inspects the tiers right after a request waits here first."""
        return self._prefetcher.wait(timeout)

    def _fetch_up(self, key: str) -> bool:
        """Prefetch worker: promote ``key``; ``True`` if it now sits in tier 0."""
        with self._lock:
            node = self._policy.cached(key)
            if node is not None and node.level == 0:
                return True
        entry, found_at, version = self._read(key)
        if entry is None:
            return False
        if found_at > 0:
            self._placement.promote_after_read(key, entry, found_at, version)
        with self._lock:
            node = self._policy.cached(key)
            return node is not None and node.level == 0

    def open_layers(self, key: str, device: torch.device | str = "cpu", depth: int | None = None) -> LayerLoader | None:
        """A layer-wise loader of ``key`` onto ``device`` (``None`` on a miss).

        Layers ``0..depth-1`` start loading at once (``depth`` from ``preload_depth``; None =
        all); ``loader.layer(l)`` then keeps ``depth`` layers ahead. Close the loader (or use
        it as a context manager). The entry is read from the fastest tier holding it; use
        ``prefetch`` first to move it up.
        """
        check_key(key)
        with self._lock:
            node = self._policy.cached(key)
            order = sorted(node.copies) if node is not None else []
            self._policy.touch(key)
        order += [i for i, t in enumerate(self.tiers) if t.shared and i not in order]
        for i in order:
            source = self.tiers[i].open_source(key)
            if source is not None:
                loader = LayerLoader(source, device, depth)
                with self._lock:
                    self.stats.hits += 1
                    self._loaders.add(loader)
                return loader
            self._placement.lost(key, i)
        with self._lock:
            self.stats.misses += 1
        return None

    # ---- maintenance ---------------------------------------------------------------------
    def flush(self) -> int:
        """Copy entries held only in volatile tiers into the first persistent tier with free
        room (evicting nothing there); returns how many were copied."""
        copied = 0
        with self._lock:
            persistent = [i for i, t in enumerate(self.tiers) if t.persistent]
            if not persistent:
                return 0
            for key, node in list(self._policy.nodes.items()):
                if not node.copies or any(c in persistent for c in node.copies):
                    continue
                entry = self._placement.peek(node.level, key)
                if entry is None:
                    continue
                protect = {key, *self._policy.ancestors(key)}
                for k in persistent:
                    if self._placement.place(key, entry, k, protect, {}, copy=False, evict="none"):
                        copied += 1
                        break
        return copied

    def check_invariants(self) -> list[str]:
        """Budget, index and tree-consistency violations (empty when all hold)."""
        problems: list[str] = []
        with self._lock:
            for i, tier in enumerate(self.tiers):
                if tier.used_bytes > tier.budget_bytes:
                    problems.append(f"{tier.name}: used {tier.used_bytes} > budget {tier.budget_bytes}")
                if not tier.shared and set(tier.keys()) != self._policy.members[i]:
                    extra = set(tier.keys()) ^ self._policy.members[i]
                    problems.append(f"{tier.name}: index and tier disagree on {len(extra)} keys")
            problems += self._policy.tree_violations()
        return problems

    def stats_dict(self) -> dict[str, dict]:
        """JSON-ready: store counters plus every tier's counters, usage and budget."""
        with self._lock:
            store = self.stats.as_dict()
        return {"store": store, "tiers": {t.name: t.stats_dict() for t in self.tiers}}

    def close(self) -> None:
        """Stop prefetching, close open loaders and tiers."""
        self._prefetcher.shutdown()
        for loader in list(self._loaders):
            loader.close()
        for tier in self.tiers:
            tier.close()

    def __enter__(self) -> TieredStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
