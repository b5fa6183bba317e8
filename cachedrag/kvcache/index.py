"""Chunk variant registry: up to M variants per chunk key, N x M in all, f_r eviction.

Owns: ``VariantIndex`` and ``Variant``. Each variant is one stored KV of a chunk (its
``handle``, opaque to this module) plus the ``AttentionMetadata`` of the context it was computed
in. Cache-Craft's frequency-reuse score decides what stays: f_r = 1 at admission and
f_r += 1 / max(CFO, cfo_floor) on every reuse. When a chunk already has M variants, its
lowest-f_r variant makes room; when the registry holds N x M variants, the globally lowest-f_r
variant goes (a chunk whose last variant goes is dropped). Ties break by least recent use.
Every eviction returns the evicted handles so the engine frees their tensors. Pinned variants
(in use by an in-flight request) are never evicted.

Lookups by chunk key are O(1); global eviction is O(log n) through a lazy heap. One re-entrant
lock makes every public method thread-safe.

Does not own: tensors, byte budgets (the store; it reports lost entries through ``remove``),
or the CFO computation (``variants.py``).
"""

from __future__ import annotations

import heapq
import itertools
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from cachedrag.kvcache.variants import AttentionMetadata


@dataclass(eq=False)
class Variant:
    """One stored KV of a chunk. Read its fields; mutate only through the index."""

    variant_id: int
    chunk_key: str
    handle: Any
    meta: AttentionMetadata
    reuse_score: float = 1.0  # f_r
    uses: int = 0
    last_used: int = 0
    pins: int = 0
    attached: bool = True

    @property
    def n_tokens(self) -> int:
        return self.meta.n_tokens


@dataclass(frozen=True)
class AddResult:
    """What ``add`` did.

    variant: the admitted variant, or the existing one with the same context (``duplicate``),
        or None when nothing could make room (every variant of the chunk pinned).
    evicted: handles to free: variants evicted to make room, plus the new handle itself when
        it was not admitted (duplicate or no room).
    duplicate: a variant of this chunk with the same ``prefix_keys`` already existed.
    """

    variant: Variant | None
    evicted: tuple[Any, ...]
    duplicate: bool = False

    @property
    def admitted(self) -> bool:
        return self.variant is not None and not self.duplicate


class VariantIndex:
    """Registry of chunk variants keyed by chunk key.

    >>> idx = VariantIndex(max_chunks=2, max_variants_per_chunk=1)
    >>> r = idx.add("c1", "h1", AttentionMetadata.standalone(4))
    >>> [v.handle for v in idx.variants("c1")]
    ['h1']
    """

    def __init__(self, max_chunks: int = 10_000, max_variants_per_chunk: int = 4, *, cfo_floor: float = 0.05) -> None:
        if max_chunks < 1 or max_variants_per_chunk < 1:
            raise ValueError("VariantIndex: max_chunks and max_variants_per_chunk must be >= 1")
        if not 0 < cfo_floor <= 1:
            raise ValueError(f"VariantIndex: cfo_floor must be in (0, 1], got {cfo_floor}")
        self.max_chunks = max_chunks
        self.max_variants_per_chunk = max_variants_per_chunk
        self.cfo_floor = cfo_floor
        self._lock = threading.RLock()
        self._by_chunk: dict[str, list[Variant]] = {}
        self._by_id: dict[int, Variant] = {}
        self._ids = itertools.count(1)
        self._seq = itertools.count()
        self._tick = 0
        self._heap: list[tuple[float, int, int, Variant]] = []
        self.evictions = 0

    @classmethod
    def from_config(cls, config: Any) -> VariantIndex:
        """From a ``CacheConfig`` (``max_chunks``, ``max_variants_per_chunk``, ``cfo_floor``)."""
        return cls(config.max_chunks, config.max_variants_per_chunk, cfo_floor=config.cfo_floor)

    # -- read --------------------------------------------------------------------------------

    @property
    def capacity(self) -> int:
        """Total variant cap N x M."""
        return self.max_chunks * self.max_variants_per_chunk

    def __len__(self) -> int:
        return len(self._by_id)

    @property
    def n_chunks(self) -> int:
        return len(self._by_chunk)

    def __contains__(self, chunk_key: object) -> bool:
        return chunk_key in self._by_chunk

    def variants(self, chunk_key: str) -> tuple[Variant, ...]:
        """The variants of a chunk (empty if none), O(1)."""
        with self._lock:
            return tuple(self._by_chunk.get(chunk_key, ()))

    def get(self, variant_id: int) -> Variant | None:
        return self._by_id.get(variant_id)

    # -- write -------------------------------------------------------------------------------

    def add(self, chunk_key: str, handle: Any, meta: AttentionMetadata) -> AddResult:
        """Admit a new variant of ``chunk_key``, evicting to respect the caps (see AddResult)."""
        with self._lock:
            existing = self._by_chunk.get(chunk_key, [])
            for v in existing:
                if v.meta.prefix_keys == meta.prefix_keys:
                    return AddResult(v, (handle,), duplicate=True)
            evicted: list[Any] = []
            if len(existing) >= self.max_variants_per_chunk:
                victims = [v for v in existing if v.pins == 0]
                if not victims:
                    return AddResult(None, (handle,))
                victim = min(victims, key=lambda v: (v.reuse_score, v.last_used, v.variant_id))
                evicted.append(self._drop(victim))
                self.evictions += 1
            while len(self._by_id) >= self.capacity:
                handle_out = self._pop_global()
                if handle_out is _NOTHING:
                    if evicted:
                        break  # made room within the chunk already
                    return AddResult(None, (handle,))
                evicted.append(handle_out)
            self._tick += 1
            variant = Variant(next(self._ids), chunk_key, handle, meta, last_used=self._tick)
            self._by_chunk.setdefault(chunk_key, []).append(variant)
            self._by_id[variant.variant_id] = variant
            self._push(variant)
            return AddResult(variant, tuple(evicted))

    def record_reuse(self, variant: Variant, cfo: float) -> float:
        """One reuse with recompute fraction ``cfo``: f_r += 1 / max(cfo, cfo_floor). New f_r."""
        with self._lock:
            variant.uses += 1
            self._tick += 1
            variant.last_used = self._tick
            variant.reuse_score += 1.0 / max(cfo, self.cfo_floor)
            if variant.attached:
                self._push(variant)
            return variant.reuse_score

    def pin(self, variant: Variant) -> bool:
        """Protect from eviction; False if the variant is no longer registered."""
        with self._lock:
            if not variant.attached:
                return False
            variant.pins += 1
            return True

    def unpin(self, variant: Variant) -> None:
        with self._lock:
            if variant.pins <= 0:
                raise ValueError(f"VariantIndex.unpin: variant {variant.variant_id} is not pinned")
            variant.pins -= 1
            if variant.pins == 0 and variant.attached:
                self._push(variant)

    def remove(self, variant: Variant) -> Any:
        """Unregister (e.g. the store lost its tensors); returns its handle, None if gone."""
        with self._lock:
            if not variant.attached:
                return None
            return self._drop(variant)

    def remove_chunk(self, chunk_key: str) -> list[Any]:
        """Unregister every variant of a chunk; returns their handles."""
        with self._lock:
            return [self._drop(v) for v in list(self._by_chunk.get(chunk_key, ()))]

    def evict(self, count: int, *, spare: frozenset[str] | set[str] = frozenset()) -> list[Any]:
        """Evict up to ``count`` lowest-f_r unpinned variants; returns their handles. Variants of
        the chunk keys in ``spare`` are passed over (they stay evictable by a later call without it)."""
        out: list[Any] = []
        if count > 0:
            self.evict_while(lambda handle: out.append(handle) or len(out) < count, spare=spare)
        return out

    def evict_while(self, more: Callable[[Any], bool], *, spare: frozenset[str] | set[str] = frozenset()) -> int:
        """Evict the lowest-f_r unpinned variants one by one, passing each evicted handle to
        ``more``, until it returns False or nothing is left; returns how many went. Variants of
        the chunk keys in ``spare`` are passed over, once for the whole call (put back after)."""
        with self._lock:
            spared: list = []
            n = 0
            try:
                while True:
                    h = self._pop_global(spare, spared)
                    if h is _NOTHING:
                        return n
                    n += 1
                    if not more(h):
                        return n
            finally:
                for item in spared:  # back in the heap, as they were
                    heapq.heappush(self._heap, item)

    def all_variants(self) -> list[Variant]:
        with self._lock:
            return list(self._by_id.values())

    # -- private -----------------------------------------------------------------------------

    def _push(self, v: Variant) -> None:
        heapq.heappush(self._heap, (v.reuse_score, v.last_used, next(self._seq), v))
        if len(self._heap) > 4 * len(self._by_id) + 1024:
            self._heap = [(x.reuse_score, x.last_used, next(self._seq), x) for x in self._by_id.values() if x.pins == 0]
            heapq.heapify(self._heap)

    def _pop_global(self, spare: frozenset[str] | set[str] = frozenset(), spared: list | None = None) -> Any:
        """Drop the lowest-f_r unpinned variant; those of ``spare`` chunks go to ``spared`` (the
        caller pushes them back)."""
        while self._heap:
            item = heapq.heappop(self._heap)
            score, last, _, v = item
            if not v.attached or v.pins > 0:
                continue  # gone, or pinned (pushed again on unpin)
            if score != v.reuse_score or last != v.last_used:
                continue  # stale entry; a newer one exists
            if v.chunk_key in spare:
                assert spared is not None
                spared.append(item)
                continue
            self.evictions += 1
            return self._drop(v)
        return _NOTHING

    def _drop(self, v: Variant) -> Any:
        v.attached = False
        del self._by_id[v.variant_id]
        siblings = self._by_chunk[v.chunk_key]
        siblings.remove(v)
        if not siblings:
            del self._by_chunk[v.chunk_key]
        return v.handle

    def __repr__(self) -> str:
        return f"VariantIndex(chunks={self.n_chunks}, variants={len(self)}/{self.capacity})"


class _Nothing:
    def __repr__(self) -> str:
        return "<nothing evictable>"


_NOTHING: Any = _Nothing()
