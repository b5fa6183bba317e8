"""Prefill-time profile: T(cached_len, computed_len) on a grid, bilinear interpolation.

Owns: ``PrefillProfile``, the measured cost model RAGCache's PGDSF uses. ``T(c, n)`` is the
time to prefill ``n`` new tokens that attend to ``c`` already-cached tokens (plus themselves).
Measurement takes a callable ``time_fn(cached_len, computed_len) -> seconds`` so this module
stays pure (the lead's runner supplies the callable); JSON save/load is atomic.

Does not own: running the model, timing it, or deciding what to cache.

Interpolation (``time``):
  * Inside the grid: bilinear in the cell that contains (c, n).
  * Outside the grid: the same bilinear formula continued from the nearest edge cell, i.e.
    linear extrapolation along each axis from the last two grid points (t < 0 or t > 1).
    Real prefill grows faster than linearly in n, so extrapolation underestimates far past the
    grid: measure a grid that spans the context window. Results are clamped at >= 0.
  * An axis with a single grid point is constant along that axis.
  * ``n == 0`` is exactly 0 s (no forward pass runs), whatever the grid says.

Derived costs:
  * ``saved_time(c, n) = T(0, c + n) - T(c, n)``: time saved when the first ``c`` of ``c + n``
    tokens come from the cache instead of being computed (>= 0).
  * ``marginal_cost(p, n, tail) = T(p, n + tail) - T(p + n, tail)``: what caching a segment of
    ``n`` tokens that sits behind ``p`` cached tokens saves, given ``tail`` tokens computed after
    it. Equal to ``saved_time(p + n, tail) - saved_time(p, n + tail)``; with ``tail = 0`` it is
    ``T(p, n)``. This is the per-node cost of PGDSF (prefix-aware: a node deeper in the tree
    costs more per token because its tokens attend over a longer prefix).
"""

from __future__ import annotations

import bisect
import json
import math
import os
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from cachedrag.errors import ConfigError, CorruptCacheError

_FORMAT = "cachedrag-prefill-profile"
_VERSION = 1

DEFAULT_CACHED_GRID: tuple[int, ...] = (0, 128, 256, 512, 1024, 2048)
DEFAULT_COMPUTED_GRID: tuple[int, ...] = (16, 64, 128, 256, 512, 1024, 2048)


def _check_grid(name: str, grid: Sequence[int]) -> tuple[int, ...]:
    out = tuple(grid)
    if not out:
        raise ConfigError(f"PrefillProfile: {name} must not be empty")
    for v in out:
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ConfigError(f"PrefillProfile: {name} must hold non-negative integers, got {v!r}")
    if any(b <= a for a, b in zip(out, out[1:])):
        raise ConfigError(f"PrefillProfile: {name} must be strictly increasing, got {list(out)}")
    return out


def _locate(grid: tuple[int, ...], x: float) -> tuple[int, float]:
    """Cell index i (into grid[i], grid[i+1]) and the local coordinate t; t may leave [0, 1]."""
    if len(grid) == 1:
        return 0, 0.0
    i = bisect.bisect_right(grid, x) - 1
    i = min(max(i, 0), len(grid) - 2)
    lo, hi = grid[i], grid[i + 1]
    return i, (x - lo) / (hi - lo)


class PrefillProfile:
    """Measured prefill times on a (cached_len x computed_len) grid.

    ``times[i][j]`` is T(cached_grid[i], computed_grid[j]) in seconds.

    >>> p = PrefillProfile.analytic(per_token=1e-3, per_pair=1e-7)
    >>> round(p.time(0, 512), 4) > 0
    True
    """

    def __init__(
        self,
        cached_grid: Sequence[int],
        computed_grid: Sequence[int],
        times: Sequence[Sequence[float]],
        meta: dict[str, Any] | None = None,
    ) -> None:
        self.cached_grid = _check_grid("cached_grid", cached_grid)
        self.computed_grid = _check_grid("computed_grid", computed_grid)
        rows = [tuple(float(v) for v in row) for row in times]
        if len(rows) != len(self.cached_grid) or any(len(r) != len(self.computed_grid) for r in rows):
            raise ConfigError(
                f"PrefillProfile: times must be {len(self.cached_grid)} x {len(self.computed_grid)} "
                f"(cached_grid x computed_grid)"
            )
        for row in rows:
            for v in row:
                if not math.isfinite(v) or v < 0:
                    raise ConfigError(f"PrefillProfile: times must be finite and >= 0, got {v!r}")
        self.times: tuple[tuple[float, ...], ...] = tuple(rows)
        self.meta: dict[str, Any] = dict(meta or {})

    # -- queries -----------------------------------------------------------------------------

    def time(self, cached: float, computed: float) -> float:
        """Interpolated T(cached, computed) in seconds (see the module docstring for edges)."""
        if cached < 0 or computed < 0:
            raise ValueError(f"PrefillProfile.time: lengths must be >= 0, got ({cached}, {computed})")
        if computed == 0:
            return 0.0
        i, u = _locate(self.cached_grid, cached)
        j, v = _locate(self.computed_grid, computed)
        i1 = min(i + 1, len(self.cached_grid) - 1)
        j1 = min(j + 1, len(self.computed_grid) - 1)
        t = self.times
        value = (
            (1 - u) * (1 - v) * t[i][j]
            + (1 - u) * v * t[i][j1]
            + u * (1 - v) * t[i1][j]
            + u * v * t[i1][j1]
        )
        return max(0.0, value)

    def saved_time(self, cached: float, computed: float) -> float:
        """T(0, cached + computed) - T(cached, computed), clamped at >= 0."""
        if cached <= 0:
            return 0.0
        return max(0.0, self.time(0, cached + computed) - self.time(cached, computed))

    def marginal_cost(self, prefix_tokens: float, n_tokens: float, tail_tokens: float = 0) -> float:
        """Time saved by having a segment of ``n_tokens`` behind ``prefix_tokens`` cached.

        ``T(prefix, n + tail) - T(prefix + n, tail)``, clamped at >= 0 (PGDSF's node cost).
        """
        if n_tokens <= 0:
            return 0.0
        return max(
            0.0,
            self.time(prefix_tokens, n_tokens + tail_tokens) - self.time(prefix_tokens + n_tokens, tail_tokens),
        )

    # -- construction ------------------------------------------------------------------------

    @classmethod
    def measure(
        cls,
        time_fn: Callable[[int, int], float],
        cached_grid: Sequence[int] = DEFAULT_CACHED_GRID,
        computed_grid: Sequence[int] = DEFAULT_COMPUTED_GRID,
        *,
        repeats: int = 1,
        reduce: Callable[[list[float]], float] = min,
        meta: dict[str, Any] | None = None,
    ) -> PrefillProfile:
        """Call ``time_fn(c, n)`` ``repeats`` times per grid point and keep ``reduce`` of them.

        ``min`` is the default reducer: on a shared, noisy machine the minimum is the least
        disturbed sample. ``time_fn`` must return seconds as a finite float >= 0.
        """
        if repeats < 1:
            raise ConfigError(f"PrefillProfile.measure: repeats must be >= 1, got {repeats}")
        cg = _check_grid("cached_grid", cached_grid)
        ng = _check_grid("computed_grid", computed_grid)
        times = [[float(reduce([float(time_fn(c, n)) for _ in range(repeats)])) for n in ng] for c in cg]
        info = {"repeats": repeats, **(meta or {})}
        return cls(cg, ng, times, meta=info)

    @classmethod
    def analytic(
        cls,
        per_token: float = 1.0e-3,
        per_pair: float = 2.5e-7,
        overhead: float = 0.0,
        cached_grid: Sequence[int] = DEFAULT_CACHED_GRID,
        computed_grid: Sequence[int] = DEFAULT_COMPUTED_GRID,
    ) -> PrefillProfile:
        """A synthetic profile shaped like real prefill, sampled on a grid.

        T(c, n) = overhead + per_token x n + per_pair x (n x c + n (n + 1) / 2): a linear part
        (projections, MLP) and a quadratic part (each new token attends to c cached tokens and
        to the new tokens before it). The defaults give ~1.8 s for 1,525 tokens, close to the
        default model's measured ~1.9 s on 2 CPU cores. For simulations and tests.
        """

        def fn(c: int, n: int) -> float:
            return overhead + per_token * n + per_pair * (n * c + n * (n + 1) / 2)

        return cls.measure(
            fn,
            cached_grid,
            computed_grid,
            meta={"analytic": {"per_token": per_token, "per_pair": per_pair, "overhead": overhead}},
        )

    # -- persistence -------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": _FORMAT,
            "version": _VERSION,
            "cached_grid": list(self.cached_grid),
            "computed_grid": list(self.computed_grid),
            "times": [list(r) for r in self.times],
            "meta": self.meta,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PrefillProfile:
        if not isinstance(data, dict) or data.get("format") != _FORMAT:
            raise CorruptCacheError("not a cachedrag prefill profile (missing or wrong 'format')")
        if data.get("version") != _VERSION:
            raise CorruptCacheError(f"unsupported prefill profile version {data.get('version')!r}")
        try:
            return cls(data["cached_grid"], data["computed_grid"], data["times"], meta=data.get("meta"))
        except (KeyError, TypeError, ValueError, ConfigError) as exc:
            raise CorruptCacheError(f"malformed prefill profile: {exc}") from None

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write JSON atomically (temp file in the same folder, then ``os.replace``)."""
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=target.name + ".", suffix=".tmp", dir=target.parent)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as fh:
                json.dump(self.to_dict(), fh, indent=1)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, target)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise
        return target

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> PrefillProfile:
        """Read a profile written by ``save``; a malformed file raises ``CorruptCacheError``."""
        try:
            with open(path, encoding="utf-8") as fh:
                data = json.load(fh)
        except json.JSONDecodeError as exc:
            raise CorruptCacheError(f"{path}: not valid JSON ({exc})") from None
        return cls.from_dict(data)

    def __repr__(self) -> str:
        return f"PrefillProfile(cached_grid={list(self.cached_grid)}, computed_grid={list(self.computed_grid)})"
