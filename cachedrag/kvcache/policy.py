"""Replacement policies as strategies that return a sort key (lowest is evicted first).

Owns: ``EntryStats`` (the per-entry numbers a policy reads), ``record_access`` (how an access
updates them), the policies ``LRU``, ``LFU``, ``GDSF``, ``PGDSF``, ``CacheCraftFR`` and the
registry ``make_policy(name)``. In the style of sglang's ``evict_policy.py``: a policy never
mutates a cache; the cache (``tree.py``) asks it for ``sort_key(stats)`` and, after evicting an
entry, for ``clock_after_evict(clock, stats)``.

Does not own: which entries are evictable (the tree: leaves only, unpinned), byte accounting.

Formulas (S = entry size in bytes, F = access count, L = the cache clock):
  * LRU:  key = (last_access,)
  * LFU:  key = (F, last_access)
  * GDSF (Cherkasova 1998, the hit-rate variant used by Squid's ``heap GDSF``):
          H = L_access + F x 1 / S; key = (H, last_access). Cost is the constant 1, so small
          popular entries are kept: this maximises the *object* (document) hit rate.
  * PGDSF (RAGCache): H = L_access + F x C / S with C = the prefill time the entry saves,
          from the profile (``PrefillProfile.marginal_cost(prefix_tokens, tokens)``), computed by
          the tree at insert; key = (H, last_access). C / S is ~constant per token plus a term
          growing with the entry's prefix depth and length, so PGDSF keeps what is expensive to
          recompute per byte, not what is small.
  * GDSF and PGDSF are *aging* policies: ``L_access`` is the clock L when the entry was last
    accessed, and evicting an entry raises the clock to its priority (L = max(L, H)), so
    entries not used for a while fall behind newly touched ones.
  * CacheCraftFR (Cache-Craft): key = (f_r, last_access), f_r = 1 at insert and
    f_r += 1 / max(CFO, cfo_floor) on each reuse: a variant reused often, and with little
    recompute, is worth keeping.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar


@dataclass
class EntryStats:
    """Per-entry numbers read by the policies. Mutated only by ``record_access`` / the cache."""

    nbytes: int
    n_tokens: int
    cost: float = 0.0  # seconds saved when hit (PGDSF); set by the cache at insert
    frequency: int = 1  # F: accesses including the insert
    last_access: int = 0  # logical tick of the last access
    clock: float = 0.0  # cache clock L at the last access (GDSF family)
    reuse_score: float = 1.0  # Cache-Craft f_r


def record_access(stats: EntryStats, tick: int, clock: float, cfo: float | None = None, cfo_floor: float = 0.05) -> None:
    """Update ``stats`` for one access at logical time ``tick`` with cache clock ``clock``.

    ``cfo``: the recompute fraction of this reuse (None or 0 for an exact hit); f_r grows by
    1 / max(cfo, cfo_floor).
    """
    stats.frequency += 1
    stats.last_access = tick
    stats.clock = clock
    stats.reuse_score += 1.0 / max(cfo or 0.0, cfo_floor)


class EvictionPolicy(ABC):
    """A strategy: ``sort_key(stats)``, lowest evicted first; optional clock update."""

    name: ClassVar[str]

    @abstractmethod
    def sort_key(self, stats: EntryStats) -> tuple[float, ...]:
        """Lowest key is evicted first. Must depend only on ``stats`` (keys are cached)."""

    def clock_after_evict(self, clock: float, stats: EntryStats) -> float:
        """The cache clock after evicting an entry with these stats (unchanged by default)."""
        return clock

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class LRU(EvictionPolicy):
    """Least recently used first."""

    name = "lru"

    def sort_key(self, stats: EntryStats) -> tuple[float, ...]:
        return (stats.last_access,)


class LFU(EvictionPolicy):
    """Least frequently used first; ties by recency. No aging (frequencies only grow)."""

    name = "lfu"

    def sort_key(self, stats: EntryStats) -> tuple[float, ...]:
        return (stats.frequency, stats.last_access)


class GDSF(EvictionPolicy):
    """Greedy-Dual-Size-Frequency with cost 1: H = L + F / S (object hit-rate variant)."""

    name = "gdsf"

    def cost(self, stats: EntryStats) -> float:
        return 1.0

    def priority(self, stats: EntryStats) -> float:
        return stats.clock + stats.frequency * self.cost(stats) / max(stats.nbytes, 1)

    def sort_key(self, stats: EntryStats) -> tuple[float, ...]:
        return (self.priority(stats), stats.last_access)

    def clock_after_evict(self, clock: float, stats: EntryStats) -> float:
        return max(clock, self.priority(stats))


class PGDSF(GDSF):
    """RAGCache's prefix-aware GDSF: H = L + F x C / S, C = prefill time saved (profile)."""

    name = "pgdsf"

    def cost(self, stats: EntryStats) -> float:
        return stats.cost


class CacheCraftFR(EvictionPolicy):
    """Cache-Craft frequency-reuse: lowest f_r first, ties by recency."""

    name = "cachecraft_fr"

    def sort_key(self, stats: EntryStats) -> tuple[float, ...]:
        return (stats.reuse_score, stats.last_access)


_POLICIES: dict[str, type[EvictionPolicy]] = {cls.name: cls for cls in (LRU, LFU, GDSF, PGDSF, CacheCraftFR)}
_ALIASES = {"cachecraft": "cachecraft_fr", "fr": "cachecraft_fr", "cache-craft": "cachecraft_fr"}
POLICY_NAMES: frozenset[str] = frozenset(_POLICIES)


def canonical_policy_name(name: str) -> str:
    """Lower-cased registry name for ``name`` or an alias; KeyError if unknown."""
    key = name.strip().lower()
    key = _ALIASES.get(key, key).replace("-", "_")
    if key not in _POLICIES:
        raise KeyError(name)
    return key


def make_policy(name: str | EvictionPolicy) -> EvictionPolicy:
    """A policy by registry name (``lru``, ``lfu``, ``gdsf``, ``pgdsf``, ``cachecraft_fr``)."""
    if isinstance(name, EvictionPolicy):
        return name
    try:
        return _POLICIES[canonical_policy_name(name)]()
    except KeyError:
        raise ValueError(f"unknown eviction policy {name!r}; choose one of {sorted(POLICY_NAMES)}") from None
