"""Adopting what a chunk-cache manager's store already holds: entries an earlier run or another
process wrote.

Owns: ``RefreshReport``, ``describe`` (engine entries from their headers) and ``StoreAdoption``,
the manager's ``rebuild`` / ``refresh``: entries read from their headers become tree nodes and
variants. ``StoreAdoption`` is a base of ``ChunkCacheManager`` and works on its state (the
store, tree, index, lock and reference maps, ``_track`` / ``_unref`` / ``_prune`` /
``_priority``); it is not used alone. Pure Python; never imports torch.

With a store that has a persistent tier (disk, Redis) the constructor calls
``rebuild()``: every entry the store lists (local tiers, plus this namespace's keys in shared
tiers) is described from its header alone (``store.info``; a chunk variant also reads its small
``token_inter`` tensor through ``store.extras``, never its K/V). Exact entries become tree nodes
when their whole ancestor chain is present; variants re-enter the index (N x M caps apply).
Entries nothing can reach (an ancestor is gone, a duplicate variant) stay in the store
unreferenced (the store evicts them first: they have no priority) and are not re-read by
``refresh``. A restarted process's first request therefore hits what the last one stored;
``refresh()`` picks up entries other processes wrote since (shared Redis).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from cachedrag.kvcache.catalog import CatalogError, StoredSegment, tree_order, variant_metadata


@dataclass
class RefreshReport:
    """What one ``refresh`` / ``rebuild`` found in the store."""

    listed: int = 0  # keys the store listed
    read: int = 0  # headers read (keys not referenced yet)
    tree_nodes: int = 0  # adopted as knowledge-tree nodes
    variants: int = 0  # adopted as chunk variants
    unreferenced: int = 0  # readable engine entries nothing can reach (missing ancestor, duplicate)
    unreadable: int = 0  # listed but gone, damaged or foreign when read (the store counted them)
    not_engine: int = 0  # entries without (consistent) engine metadata: left alone
    pruned: int = 0  # referenced handles the store no longer holds, forgotten
    seconds: float = 0.0

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


def describe(store: Any, keys: Sequence[str],
             report: RefreshReport) -> tuple[list[StoredSegment], dict[str, list[float]], list[str]]:
    """The engine entries among ``keys`` from their headers (``store.info``; a chunk variant's
    ``token_inter`` through ``store.extras``), never their K/V: segments, token_inter per handle,
    and the keys that are not engine entries. Counts into ``report``."""
    segments: list[StoredSegment] = []
    token_inter: dict[str, list[float]] = {}
    not_engine: list[str] = []
    for key in keys:
        info = store.info(key)
        report.read += 1
        if info is None:
            report.unreadable += 1
            continue
        try:
            seg = StoredSegment.parse(key, info.meta, info.nbytes, info.n_tokens)
        except CatalogError:
            report.not_engine += 1
            not_engine.append(key)
            continue
        if seg.variant is not None and seg.role == "chunk":
            extras = store.extras(key)
            values = None if extras is None else extras.get("token_inter")
            if values is not None:
                token_inter[key] = [float(x) for x in values.tolist()]  # [T] floats
        segments.append(seg)
    return segments, token_inter, not_engine


class StoreAdoption:
    """``rebuild`` and ``refresh`` of ``ChunkCacheManager`` (see the module docstring)."""

    def rebuild(self) -> RefreshReport:
        """Adopt every engine entry the store holds (see the module docstring); also forgets
        referenced handles the store no longer has. Called by the constructor on persistent
        stores."""
        with self._lock:
            self._ignored.clear()
        return self.refresh(prune=True)

    def refresh(self, *, prune: bool = False) -> RefreshReport:
        """Adopt entries written since the last scan (by other processes sharing a Redis tier,
        or by this one before a restart). ``prune`` also checks that every referenced handle
        is still in the store (one ``contains`` each) and forgets the missing ones."""
        t0 = time.perf_counter()
        report = RefreshReport()
        if not self.features.info:
            report.seconds = time.perf_counter() - t0
            self.last_refresh = report
            return report
        keys = self.store.keys(shared=True) if self.features.shared_keys else self.store.keys()
        report.listed = len(keys)
        with self._lock:
            self._sync_drops()
            todo = [k for k in keys if k not in self._sizes and k not in self._ignored]
        segments, token_inter, not_engine = describe(self.store, todo, report)  # store reads, outside the lock
        with self._lock:
            self._ignored.update(not_engine)
            self._adopt(segments, token_inter, report)
            if prune:
                report.pruned = self._prune()
            self._enforce_capacity()
            self.counters["refreshes"] += 1
            self.counters["adopted"] += report.tree_nodes + report.variants
        report.seconds = time.perf_counter() - t0
        self.last_refresh = report
        return report

    def _adopt(self, segments: list[StoredSegment], token_inter: dict[str, list[float]], report: RefreshReport) -> None:
        """Under the lock: tree paths first (parents before children), then variants."""
        fresh = [s for s in segments if s.handle not in self._sizes]
        insertable, _orphans = tree_order(fresh, lambda path: self.tree.find(list(path)) is not None)
        adopted: dict[str, str | None] = {}  # handle -> tree parent handle
        for seg in insertable:
            parents = self.tree.match_prefix(seg.path[:-1])
            if len(parents) != len(seg.path) - 1 or self.tree.find(list(seg.path)) is not None:
                continue  # an ancestor went meanwhile, or a request inserted this path first
            result = self.tree.insert(
                list(seg.path), [n.handle for n in parents] + [seg.handle],
                [n.n_tokens for n in parents] + [seg.n_tokens], [n.nbytes for n in parents] + [seg.nbytes],
            )
            self._track(seg.handle, seg.nbytes, exact=True)
            self._nodes[seg.handle] = result.nodes[-1]
            adopted[seg.handle] = seg.parent_handle
            report.tree_nodes += 1
        for seg in fresh:
            values = token_inter.get(seg.handle)
            if values is None or seg.handle in self._variants:
                continue
            try:
                meta = variant_metadata(seg, values)
            except CatalogError:
                continue
            added = self.index.add(seg.segment_key, seg.handle, meta)
            if added.admitted:
                self._track(seg.handle, seg.nbytes, exact=seg.exact)
                self._variants[seg.handle] = added.variant
                adopted.setdefault(seg.handle, None)
                report.variants += 1
            self._unref(added.evicted)
        for seg in fresh:
            if seg.handle not in self._sizes:
                report.unreferenced += 1
                self._ignored.add(seg.handle)
        if self.features.placement:
            for h, parent in adopted.items():
                if h in self._sizes:
                    self.store.set_priority(h, self._priority(h), parent=parent)
