"""The narrow tier interface every cache tier implements, and per-tier statistics.

Owns: ``Tier`` (contains / get / put / remove, batched defaults, budget and usage, the
two-step ``prepare`` -> ``commit`` write used by ``TieredStore``, header-only ``info`` /
``meta`` and ``extras`` reads for scans), ``TierStats``, ``EntryInfo`` and key validation.
Does not own: any storage medium (``cpu``, ``gpu``, ``disk``, ``redis_tier``) or placement
across tiers (``policy``, ``tiered``).

A tier never holds more than ``budget_bytes`` (its own notion of bytes: tensor bytes in
memory, allocated bytes on disk, measured memory in Redis). When a write does not fit, a
tier with ``self_evict=True`` drops its least recently used entries first; with
``self_evict=False`` (how ``TieredStore`` drives its local tiers, choosing victims itself)
the write is refused. An entry larger than the whole budget is always refused.
"""

from __future__ import annotations

import re
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

import torch

from cachedrag.store.codec import check_namespace
from cachedrag.store.entry import KVEntry

if TYPE_CHECKING:
    from cachedrag.store.source import LayerSource

_KEY = re.compile(r"[0-9a-f]{2,128}")


def check_key(key: str) -> str:
    """``key`` if it is a lowercase hex string (2-128 chars, e.g. a sha256), else ``ValueError``."""
    if not isinstance(key, str) or not _KEY.fullmatch(key):
        raise ValueError(f"cache keys are lowercase hex strings (2-128 chars), got {key!r}")
    return key


@dataclass
class TierStats:
    """Counters of one tier; ``as_dict()`` is JSON-ready."""

    hits: int = 0
    misses: int = 0
    puts: int = 0  # entries written
    put_bytes: int = 0
    refused: int = 0  # writes that did not fit (too large, or no room without self-eviction)
    evictions: int = 0  # entries this tier dropped on its own (LRU self-eviction)
    removes: int = 0
    corrupt: int = 0  # truncated / bit-flipped / unreadable blobs found, removed, served as misses
    foreign: int = 0  # blobs of another namespace found, removed, served as misses
    skipped_writes: int = 0  # writes abandoned on an I/O error (disk full, read-only dir, lost server)
    temp_cleaned: int = 0  # leftover temp files removed at start
    vanished: int = 0  # values gone between two reads (another process's eviction, TTL): misses, not corrupt
    unavailable: int = 0  # calls that failed on a lost / hanging server or were skipped while its circuit was open
    repairs: int = 0  # malformed shared accounting found and repaired (with a warning)
    load_seconds: float = 0.0  # time spent reading + decoding hits
    store_seconds: float = 0.0  # time spent writing

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


@dataclass(frozen=True)
class EntryInfo:
    """What a tier can say about an entry without reading its K/V (a scan after a restart)."""

    meta: dict[str, str]
    nbytes: int  # tensor bytes, as ``KVEntry.nbytes``
    n_layers: int
    n_tokens: int

    @classmethod
    def of(cls, entry: KVEntry) -> EntryInfo:
        return cls(dict(entry.meta), entry.nbytes, entry.n_layers, entry.n_tokens)


@dataclass
class Prepared:
    """A write made ready outside any lock: ``payload`` is a device copy or an encoded blob."""

    key: str
    nbytes: int  # bytes the entry will be charged in this tier
    payload: object


class Tier(ABC):
    """One cache tier. Subclasses implement the storage; this class the shared plumbing."""

    shared: bool = False  # other processes may change its contents (TieredStore probes it on a miss)
    persistent: bool = False  # entries survive a restart
    serialized: bool = False  # stores codec blobs (``prepare`` accepts a ready ``blob``)

    def __init__(self, name: str, budget_bytes: int, namespace: str, *, self_evict: bool = True) -> None:
        if budget_bytes < 0:
            raise ValueError(f"{name}: budget_bytes must be >= 0, got {budget_bytes}")
        if not namespace:
            raise ValueError(f"{name}: namespace must be non-empty")
        self.name = name
        self.namespace = namespace
        self.self_evict = self_evict
        self._budget = int(budget_bytes)
        self._lock = threading.RLock()
        self.stats = TierStats()

    # ---- budget --------------------------------------------------------------------------
    @property
    def budget_bytes(self) -> int:
        return self._budget

    @property
    @abstractmethod
    def used_bytes(self) -> int:
        """Bytes charged right now (never above ``budget_bytes``)."""

    # ---- single-key API ------------------------------------------------------------------
    @abstractmethod
    def contains(self, key: str) -> bool: ...

    def get(self, key: str) -> KVEntry | None:
        """The entry, or ``None`` on a miss (including a corrupt or foreign blob, removed)."""
        check_key(key)
        t0 = time.perf_counter()
        entry = self._get(key)
        with self._lock:
            if entry is None:
                self.stats.misses += 1
            else:
                self.stats.hits += 1
                self.stats.load_seconds += time.perf_counter() - t0
        return entry

    def put(self, key: str, entry: KVEntry) -> bool:
        """Store ``entry`` under ``key``; ``False`` when it does not fit or the write failed."""
        check_key(key)
        check_namespace(entry, self.namespace)
        return self.commit(self.prepare(key, entry))

    @abstractmethod
    def remove(self, key: str) -> bool:
        """Drop ``key``; ``True`` if it was there."""

    # ---- header-only reads (scans) -------------------------------------------------------
    def info(self, key: str) -> EntryInfo | None:
        """``key``'s meta, tensor bytes and shape without reading K/V (serialized tiers read
        the header only). ``None`` on a miss; a bad header is counted, removed and a miss.
        Not counted as a hit or miss and does not change recency: scans use it."""
        check_key(key)
        return self._info(key)

    def meta(self, key: str) -> dict[str, str] | None:
        """``entry.meta`` of ``key`` from the header alone (``None`` on a miss)."""
        info = self.info(key)
        return None if info is None else info.meta

    def extras(self, key: str) -> dict[str, torch.Tensor] | None:
        """The non-layered tensors of ``key`` (e.g. ``token_inter`` ``[T]``), verified, without
        reading K/V. ``None`` on a miss. Read-only, like every entry a tier hands out."""
        check_key(key)
        return self._extras(key)

    def _info(self, key: str) -> EntryInfo | None:
        """Default: read the whole entry (tiers with a header override this)."""
        entry = self._get(key)
        return None if entry is None else EntryInfo.of(entry)

    def _extras(self, key: str) -> dict[str, torch.Tensor] | None:
        entry = self._get(key)
        return None if entry is None else {n: entry.tensors[n] for n in entry.extra_names()}

    @abstractmethod
    def keys(self) -> list[str]:
        """Keys held now (for a shared tier: this namespace's keys, possibly many)."""

    @abstractmethod
    def entry_bytes(self, key: str) -> int | None:
        """Bytes charged for ``key``, or ``None`` when absent."""

    # ---- two-step write (TieredStore) ----------------------------------------------------
    @abstractmethod
    def prepare(self, key: str, entry: KVEntry, *, blob: bytes | None = None, copy: bool = True) -> Prepared:
        """Make the write ready without touching shared state (copy to device / encode).

        ``blob``: the entry already encoded (serialized tiers reuse it). ``copy=False``: the
        caller hands over ``entry`` (freshly decoded), memory tiers may keep it as is.
        """

    @abstractmethod
    def commit(self, prepared: Prepared) -> bool:
        """Store a prepared write if it fits (self-evicting when allowed)."""

    def open_source(self, key: str) -> LayerSource | None:
        """A layer-by-layer reader of ``key`` (None on a miss). Default: whole-entry get."""
        from cachedrag.store.source import TensorSource

        entry = self.get(key)
        return None if entry is None else TensorSource(entry, self.name)

    @abstractmethod
    def _get(self, key: str) -> KVEntry | None: ...

    # ---- batched defaults ----------------------------------------------------------------
    def contains_many(self, keys: Sequence[str]) -> list[bool]:
        return [self.contains(k) for k in keys]

    def get_many(self, keys: Sequence[str]) -> list[KVEntry | None]:
        return [self.get(k) for k in keys]

    def put_many(self, items: Iterable[tuple[str, KVEntry]]) -> list[bool]:
        return [self.put(k, e) for k, e in items]

    def remove_many(self, keys: Sequence[str]) -> list[bool]:
        return [self.remove(k) for k in keys]

    # ---- misc ----------------------------------------------------------------------------
    def stats_dict(self) -> dict[str, float]:
        with self._lock:
            out = self.stats.as_dict()
        out.update(used_bytes=self.used_bytes, budget_bytes=self.budget_bytes, entries=len(self.keys()))
        return out

    def close(self) -> None:
        """Release resources (connections, processes). The default has none."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, used={self.used_bytes}, budget={self.budget_bytes})"


class HeaderTier(Tier):
    """A tier whose blobs can be read header-first (disk files, Redis values): entry info and
    the small non-layered tensors come from ``_read_header`` without reading K/V."""

    @abstractmethod
    def _read_header(self, key: str, *, extras: bool) -> tuple[EntryInfo, dict[str, torch.Tensor]] | None:
        """Header of ``key`` (and with ``extras`` its non-layered tensors), or None on a miss."""

    def _info(self, key: str) -> EntryInfo | None:
        got = self._read_header(key, extras=False)
        return None if got is None else got[0]

    def _extras(self, key: str) -> dict[str, torch.Tensor] | None:
        got = self._read_header(key, extras=True)
        return None if got is None else got[1]
