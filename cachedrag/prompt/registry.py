"""The passage registry: which texts are cacheable chunks, and where they occur in a prompt.

Owns: ``ChunkRegistry`` (a bounded LRU set of chunk texts with an anchor index that finds
them verbatim inside any prompt string), ``Match`` and ``leftmost_longest`` (the choice among
overlapping occurrences, shared by every finder), ``normalize`` (the form a chunk is held in),
and ``chunk_registry()``, the process-wide registry every cachedrag retriever, node
postprocessor and LLM class shares by default (``register_chunks`` adds to it). Pure Python; no
torch, no framework imports.

Does not own: splitting a prompt into parts (``splitter``), content-defined passages
(``passages``), tokenisation (``segments``) or cache keys (``cachedrag.kvcache``).

How ``find`` works (winnowing-lite): a chunk text ``t`` (stripped of surrounding whitespace,
since frameworks strip what they join) is indexed under its ``stride`` anchors, the
``anchor_chars``-long substrings starting at offsets ``0 .. stride - 1``. A prompt is probed
only at positions ``0, stride, 2 * stride, ...``: if ``t`` starts at position ``p``, exactly
one probe ``i`` lies in ``[p, p + stride)``, and the anchor of ``t`` at offset ``i - p`` is
the prompt's substring at ``i``, so every occurrence is found. Each candidate is verified
with ``str.startswith`` (C speed). Cost: ``O(n / stride)`` dict look-ups of
``anchor_chars``-long slices for an ``n``-character prompt, plus ``O(len(t))`` per verified
candidate; memory ``stride`` anchors per chunk. Texts shorter than
``anchor_chars + stride - 1`` characters are not registered (too short to be worth caching;
they are simply computed).

Overlaps: the matches are chosen leftmost first, the longest at equal starts; a match that
overlaps an earlier chosen one is dropped (its text stays ordinary text). A chunk appearing
twice yields two matches (the engine serves both occurrences from the same chunk cache).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field, model_validator


class ChunkRegistryConfig(BaseModel):
    """Size and matching parameters of a ``ChunkRegistry``."""

    model_config = ConfigDict(frozen=True)

    capacity: int = Field(20_000, ge=1, description="distinct chunk texts remembered (least recently used leave first)")
    anchor_chars: int = Field(32, ge=4, description="length of the substrings that index a chunk's start")
    stride: int = Field(4, ge=1, description="probe every stride-th prompt position; each chunk keeps stride anchors")

    @model_validator(mode="after")
    def _sane(self) -> "ChunkRegistryConfig":
        if self.stride > self.anchor_chars:
            raise ValueError("stride must not exceed anchor_chars")
        return self

    @property
    def min_chars(self) -> int:
        """The shortest text that can be registered."""
        return self.anchor_chars + self.stride - 1


@dataclass(frozen=True)
class Match:
    """One registered chunk found in a prompt: ``prompt[start:end] == text``."""

    start: int
    end: int
    text: str


class ChunkRegistry:
    """Bounded LRU registry of chunk texts, searchable inside prompts.

    >>> reg = ChunkRegistry()
    >>> reg.register(["The heapq module provides an implementation of the heap queue algorithm."])
    1
    >>> prompt = "Context:\\nThe heapq module provides an implementation of the heap queue algorithm.\\nQ: ?"
    >>> [m.start for m in reg.find(prompt)]
    [9]
    """

    def __init__(self, config: ChunkRegistryConfig | None = None):
        self.config = config or ChunkRegistryConfig()
        self._texts: OrderedDict[str, None] = OrderedDict()  # LRU order, oldest first
        self._anchors: dict[str, list[tuple[str, int]]] = {}  # anchor -> [(text, offset in text)]
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ public API
    def register(self, texts: Iterable[str]) -> int:
        """Add chunk texts (stripped); returns how many were new. Known texts become most recent."""
        added = 0
        with self._lock:
            for raw in texts:
                text = normalize(raw)
                if len(text) < self.config.min_chars:
                    continue
                if text in self._texts:
                    self._texts.move_to_end(text)
                    continue
                self._add(text)
                added += 1
            while len(self._texts) > self.config.capacity:
                oldest, _ = self._texts.popitem(last=False)
                self._remove_anchors(oldest)
        return added

    def find(self, prompt: str) -> list[Match]:
        """Registered chunks inside ``prompt``: non-overlapping, in order (see the module docstring)."""
        k, stride = self.config.anchor_chars, self.config.stride
        found: set[tuple[int, str]] = set()
        with self._lock:
            anchors = self._anchors
            if not anchors:
                return []
            for i in range(0, len(prompt) - k + 1, stride):
                candidates = anchors.get(prompt[i:i + k])
                if candidates is None:
                    continue
                for text, offset in candidates:
                    start = i - offset
                    if start >= 0 and prompt.startswith(text, start):
                        found.add((start, text))
            matches = leftmost_longest(found)
            for m in matches:
                self._texts.move_to_end(m.text)
        return matches

    def __contains__(self, text: str) -> bool:
        with self._lock:
            return normalize(text) in self._texts

    def __len__(self) -> int:
        return len(self._texts)

    def clear(self) -> None:
        with self._lock:
            self._texts.clear()
            self._anchors.clear()

    # ------------------------------------------------------------------ helpers
    def _add(self, text: str) -> None:
        self._texts[text] = None
        k = self.config.anchor_chars
        for offset in range(self.config.stride):
            self._anchors.setdefault(text[offset:offset + k], []).append((text, offset))

    def _remove_anchors(self, text: str) -> None:
        k = self.config.anchor_chars
        for offset in range(self.config.stride):
            key = text[offset:offset + k]
            entries = [e for e in self._anchors.get(key, ()) if e[0] != text]
            if entries:
                self._anchors[key] = entries
            else:
                self._anchors.pop(key, None)


def normalize(text: str) -> str:
    """The form a chunk is registered and matched in: surrounding whitespace stripped."""
    return text.strip()


def leftmost_longest(found: Iterable[tuple[int, str]]) -> list[Match]:
    """Non-overlapping matches from ``(start, text)`` occurrences: leftmost first, the longest at
    equal starts; an occurrence overlapping a chosen one is dropped."""
    chosen: list[Match] = []
    cursor = 0
    for start, text in sorted(found, key=lambda st: (st[0], -len(st[1]))):
        if start >= cursor:
            chosen.append(Match(start, start + len(text), text))
            cursor = start + len(text)
    return chosen


_DEFAULT: ChunkRegistry | None = None
_DEFAULT_LOCK = threading.Lock()


def chunk_registry() -> ChunkRegistry:
    """The process-wide registry shared by every cachedrag integration class by default."""
    global _DEFAULT
    with _DEFAULT_LOCK:
        if _DEFAULT is None:
            _DEFAULT = ChunkRegistry()
        return _DEFAULT


def register_chunks(texts: Iterable[str], registry: ChunkRegistry | None = None) -> int:
    """Register ``texts`` with ``registry`` (default: the process-wide one); returns how many were new."""
    return (chunk_registry() if registry is None else registry).register(texts)
