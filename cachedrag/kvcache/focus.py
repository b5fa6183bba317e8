"""Focused-chunk early termination of recompute (Cache-Craft Algorithm 1).

Owns: ``FocusTracker``, fed once per layer with the question tokens' attention mass to each
chunk of the prompt (plain floats the tensor side sums), and the pure rule that decides when
the set of chunks the question focuses on has settled. After the decision the engine stops
recomputing the tokens of unfocused chunks in the remaining layers (their cached KV is used
as is); focused chunks keep their recompute tokens in every layer.

Does not own: computing attention, or which tokens a chunk recomputes (``planner.py``).

The rule, for chunks c = 0 .. n-1 and layers l = 0, 1, ... fed in order:
  * cumulative mass  A_l(c) = sum_{k <= l} m_k(c)   (m_k(c) >= 0: question -> chunk c at layer k)
  * focused set      F_l = the smallest set of chunks, taken by descending A_l(c) (ties: lower
    index first), whose mass is >= ``mass_threshold`` x sum_c A_l(c). If all mass is 0, F_l is
    every chunk (nothing can be excluded yet).
  * run length       r_0 = 0; r_l = r_{l-1} + 1 if F_l == F_{l-1} else 0
  * decision at the first layer l with  l + 1 >= ``min_layers``  and  r_l >= ``window`` - 1,
    i.e. the same focused set at each of the last ``window`` layers. The decision is final:
    later updates return it unchanged.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class FocusDecision:
    """layer: 0-based index of the layer whose update settled the set (stop after it).
    chunks: focused chunk indices, ascending. shares: each chunk's cumulative share then."""

    layer: int
    chunks: tuple[int, ...]
    shares: tuple[float, ...]

    def is_focused(self, chunk: int) -> bool:
        return chunk in self.chunks


def focused_set(cumulative: Sequence[float], mass_threshold: float) -> tuple[int, ...]:
    """Smallest set of chunks by descending mass holding >= ``mass_threshold`` of the total."""
    n = len(cumulative)
    total = math.fsum(cumulative)
    if total <= 0:
        return tuple(range(n))
    target = mass_threshold * total * (1.0 - 1e-12)
    order = sorted(range(n), key=lambda c: (-cumulative[c], c))
    acc = 0.0
    chosen: list[int] = []
    for c in order:
        chosen.append(c)
        acc += cumulative[c]
        if acc >= target:
            break
    return tuple(sorted(chosen))


class FocusTracker:
    """Per-request, per-layer tracker of the question's focused chunks.

    >>> t = FocusTracker(3, window=2, min_layers=2, mass_threshold=0.8)
    >>> t.update([0.9, 0.05, 0.05]) is None
    True
    >>> t.update([0.9, 0.05, 0.05]).chunks
    (0,)
    """

    def __init__(self, n_chunks: int, *, window: int = 3, min_layers: int = 4, mass_threshold: float = 0.8) -> None:
        if n_chunks < 0:
            raise ValueError(f"FocusTracker: n_chunks must be >= 0, got {n_chunks}")
        if window < 1 or min_layers < 1:
            raise ValueError(f"FocusTracker: window and min_layers must be >= 1, got {window}, {min_layers}")
        if not 0 < mass_threshold <= 1:
            raise ValueError(f"FocusTracker: mass_threshold must be in (0, 1], got {mass_threshold}")
        self.n_chunks = n_chunks
        self.window = window
        self.min_layers = min_layers
        self.mass_threshold = mass_threshold
        self._cumulative = [0.0] * n_chunks
        self._layers = 0
        self._current: tuple[int, ...] | None = None
        self._run = 0
        self._decision: FocusDecision | None = None

    @classmethod
    def from_config(cls, n_chunks: int, config: Any) -> FocusTracker:
        """From a ``CacheConfig`` (``focus_window``, ``focus_min_layers``, ``focus_mass_threshold``)."""
        return cls(
            n_chunks,
            window=config.focus.window,
            min_layers=config.focus.min_layers,
            mass_threshold=config.focus.mass_threshold,
        )

    @property
    def decision(self) -> FocusDecision | None:
        return self._decision

    @property
    def layers_seen(self) -> int:
        return self._layers

    @property
    def current(self) -> tuple[int, ...]:
        """The focused set after the last update (every chunk before any update)."""
        return self._current if self._current is not None else tuple(range(self.n_chunks))

    def is_focused(self, chunk: int) -> bool:
        """Whether chunk ``chunk`` still recomputes: True until a decision, then membership."""
        return self._decision is None or chunk in self._decision.chunks

    def update(self, layer_mass: Sequence[float]) -> FocusDecision | None:
        """Feed one layer's question -> chunk masses; returns the decision once made."""
        if self._decision is not None:
            return self._decision
        if len(layer_mass) != self.n_chunks:
            raise ValueError(f"FocusTracker.update: expected {self.n_chunks} masses, got {len(layer_mass)}")
        for c, m in enumerate(layer_mass):
            m = float(m)
            if not math.isfinite(m) or m < 0:
                raise ValueError(f"FocusTracker.update: mass of chunk {c} must be finite and >= 0, got {m!r}")
            self._cumulative[c] += m
        layer = self._layers
        self._layers += 1
        fset = focused_set(self._cumulative, self.mass_threshold)
        self._run = self._run + 1 if fset == self._current else 0
        self._current = fset
        if self._layers >= self.min_layers and self._run >= self.window - 1:
            total = math.fsum(self._cumulative)
            shares = tuple(a / total if total > 0 else 0.0 for a in self._cumulative)
            self._decision = FocusDecision(layer, fset, shares)
        return self._decision


def detect_focus(
    per_layer: Iterable[Sequence[float]],
    *,
    window: int = 3,
    min_layers: int = 4,
    mass_threshold: float = 0.8,
) -> FocusDecision | None:
    """Run the rule over a whole sequence of per-layer masses (offline analysis, tests)."""
    tracker: FocusTracker | None = None
    for masses in per_layer:
        if tracker is None:
            tracker = FocusTracker(len(masses), window=window, min_layers=min_layers, mass_threshold=mass_threshold)
        decision = tracker.update(masses)
        if decision is not None:
            return decision
    return None
