"""Exact repeats: how often each chunk sequence was served from non-prefix reuse.

Owns: ``RepeatTracker``, a bounded LRU map from a chunk-sequence fingerprint (``path_key`` of
the system and chunk segment keys, in prompt order) to the number of times a request with that
sequence was served partly from reused chunk variants. The manager consults it at planning
(``ChunkCacheManager.plan`` sets ``Plan.repeat``); the engine decides from that count whether
to compute the sequence's exact knowledge-tree path (``CacheConfig.exact.repeats``).

Why: a request served from reuse stores no exact tree path (its KV is approximate, and an
approximate entry must never be labelled exact), so a sequence that recurs is approximated
again every time, while prefix caching serves it as an exact hit from its second sighting.
Counting sightings lets the engine spend one exact prefill on sequences that proved to recur
(the n-th sighting), not on every reuse-served request; the later sightings are exact prefix
hits, whose answers equal full prefill.

Does not own: computing or storing the path (the engine and ``ChunkCacheManager.admit``), the
threshold or its timing (``CacheConfig``). Pure Python, no torch; callers hold the manager's
lock or use it from one thread (``OrderedDict`` operations themselves are not atomic).
A hand-written LRU (an ``OrderedDict``, ten lines) rather than a library: nothing in the
dependency set offers a counting LRU, and ``functools.lru_cache`` caches calls, not counts.
"""

from __future__ import annotations

from collections import OrderedDict


class RepeatTracker:
    """Sightings per chunk-sequence fingerprint, the least recently seen forgotten past ``capacity``.

    >>> t = RepeatTracker(capacity=2)
    >>> t.sight("a"), t.sight("a"), t.sight("b"), t.sight("c")
    (1, 2, 1, 1)
    >>> t.count("a"), t.count("c")  # "a" was the least recently seen: forgotten
    (0, 1)
    """

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"RepeatTracker: capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._counts: OrderedDict[str, int] = OrderedDict()

    def sight(self, fingerprint: str) -> int:
        """Record one reuse-served sighting of ``fingerprint``; returns its count including this one."""
        n = self._counts.pop(fingerprint, 0) + 1
        self._counts[fingerprint] = n  # most recent last
        while len(self._counts) > self.capacity:
            self._counts.popitem(last=False)
        return n

    def count(self, fingerprint: str) -> int:
        """Sightings recorded for ``fingerprint`` (0 when never seen or forgotten); no LRU update."""
        return self._counts.get(fingerprint, 0)

    def __len__(self) -> int:
        return len(self._counts)
