"""In-memory tiers: entries kept as tensors on one device.

Owns: ``MemoryTier`` (a byte-budgeted, LRU-ordered map key -> ``KVEntry`` on a device) and
``CPUTier`` (host RAM; pinned memory when CUDA is present, so host-to-GPU copies can be
asynchronous). ``GPUTier`` (``gpu``) is the same class on a CUDA device. Budgets count
tensor bytes (``KVEntry.nbytes``). Does not own: serialization or cross-tier placement.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from cachedrag.errors import ConfigError
from cachedrag.store.base import EntryInfo, Prepared, Tier, check_key
from cachedrag.store.codec import check_namespace
from cachedrag.store.entry import KVEntry
from cachedrag.store.source import LayerSource, TensorSource


class MemoryTier(Tier):
    """Entries held as tensors on ``device``; ``put`` copies (the caller keeps its tensors)."""

    def __init__(
        self,
        budget_bytes: int,
        *,
        namespace: str,
        device: torch.device | str,
        name: str,
        pin_memory: bool = False,
        self_evict: bool = True,
    ) -> None:
        super().__init__(name, budget_bytes, namespace, self_evict=self_evict)
        self.device = torch.device(device)
        self.pin_memory = bool(pin_memory and self.device.type == "cpu")
        self._entries: OrderedDict[str, KVEntry] = OrderedDict()  # oldest use first
        self._used = 0

    @property
    def used_bytes(self) -> int:
        return self._used

    def contains(self, key: str) -> bool:
        with self._lock:
            return key in self._entries

    def keys(self) -> list[str]:
        with self._lock:
            return list(self._entries)

    def entry_bytes(self, key: str) -> int | None:
        with self._lock:
            entry = self._entries.get(key)
            return None if entry is None else entry.nbytes

    def peek(self, key: str) -> KVEntry | None:
        """The stored entry without touching recency or stats (for moves between tiers)."""
        with self._lock:
            return self._entries.get(key)

    def _info(self, key: str) -> EntryInfo | None:
        entry = self.peek(key)
        return None if entry is None else EntryInfo.of(entry)

    def _extras(self, key: str) -> dict[str, torch.Tensor] | None:
        entry = self.peek(key)
        return None if entry is None else {n: entry.tensors[n] for n in entry.extra_names()}

    def _get(self, key: str) -> KVEntry | None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                self._entries.move_to_end(key)
            return entry

    def prepare(self, key: str, entry: KVEntry, *, blob: bytes | None = None, copy: bool = True) -> Prepared:
        check_key(key)
        check_namespace(entry, self.namespace)
        if copy or not self._placed_right(entry):
            entry = entry.to(self.device, pin_memory=self.pin_memory)
        return Prepared(key, entry.nbytes, entry)

    def _placed_right(self, entry: KVEntry) -> bool:
        if entry.device != self.device and not (entry.device.type == self.device.type == "cuda" and self.device.index is None):
            return False
        return not self.pin_memory or all(t.is_pinned() for t in entry.tensors.values())

    def commit(self, prepared: Prepared) -> bool:
        key, nbytes, entry = prepared.key, prepared.nbytes, prepared.payload
        assert isinstance(entry, KVEntry)
        with self._lock:
            if not self._make_room(nbytes, key):
                self.stats.refused += 1
                return False
            old = self._entries.pop(key, None)
            if old is not None:
                self._used -= old.nbytes
            self._entries[key] = entry
            self._used += nbytes
            self.stats.puts += 1
            self.stats.put_bytes += nbytes
            return True

    def _make_room(self, nbytes: int, key: str) -> bool:
        """Under the lock: ensure ``nbytes`` fit (counting ``key``'s old copy as freed)."""
        if nbytes > self._budget:
            return False
        old = self._entries.get(key)
        freed = old.nbytes if old is not None else 0
        while self._used - freed + nbytes > self._budget:
            victim = next((k for k in self._entries if k != key), None)
            if victim is None or not self.self_evict:
                return False
            self._used -= self._entries.pop(victim).nbytes
            self.stats.evictions += 1
        return True

    def remove(self, key: str) -> bool:
        with self._lock:
            entry = self._entries.pop(key, None)
            if entry is None:
                return False
            self._used -= entry.nbytes
            self.stats.removes += 1
            return True

    def open_source(self, key: str) -> LayerSource | None:
        entry = self.get(key)
        return None if entry is None else TensorSource(entry, self.name)


class CPUTier(MemoryTier):
    """Host RAM. ``pin_memory=None`` pins when CUDA is available (fast async H2D copies)."""

    def __init__(
        self,
        budget_bytes: int,
        *,
        namespace: str,
        pin_memory: bool | None = None,
        self_evict: bool = True,
        name: str = "cpu",
    ) -> None:
        if pin_memory is None:
            pin_memory = torch.cuda.is_available()
        elif pin_memory and not torch.cuda.is_available():
            raise ConfigError("pin_memory=True needs CUDA; leave it None to pin only when CUDA is present")
        super().__init__(budget_bytes, namespace=namespace, device="cpu", name=name, pin_memory=pin_memory, self_evict=self_evict)
