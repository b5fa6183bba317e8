"""Paired comparison of two right/wrong outcomes on the same questions (task accuracy vs full prefill).

Owns: ``PairedAccuracy`` (the 2x2 table of two systems answering the same questions), the exact
two-sided sign test on its discordant pairs (McNemar's exact test: under "no difference" each
discordant question is a fair coin, so the smaller count is Binomial(b + c, 1/2)), and a 95%
interval for the accuracy difference (Newcombe's hybrid score interval for paired proportions,
his method 10: Wilson intervals of both marginals, combined with the phi correlation of the
pairs; Stat. Med. 17:2635-2650, 1998). Does not own what counts as right (``bench.gold``).

Why hand-written: both are a few lines of arithmetic on integers (``math.comb``, a square root),
and the package does not depend on scipy or statsmodels; the tests check them against hand
computations and, where scipy happens to be installed, against ``scipy.stats.binomtest``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

#: two-sided 95% normal quantile
Z95 = 1.959963984540054


@dataclass(frozen=True)
class PairedAccuracy:
    """Outcomes of a reference (``full``) and a compared row on the same ``n`` questions."""

    both: int  # both right
    ref_only: int  # the reference right, the row wrong
    row_only: int  # the row right, the reference wrong
    neither: int  # both wrong

    @classmethod
    def from_pairs(cls, pairs) -> "PairedAccuracy":
        """From ``(reference_right, row_right)`` booleans, one pair per question."""
        pairs = [(bool(ref), bool(row)) for ref, row in pairs]
        return cls(both=pairs.count((True, True)), ref_only=pairs.count((True, False)),
                   row_only=pairs.count((False, True)), neither=pairs.count((False, False)))

    @property
    def n(self) -> int:
        return self.both + self.ref_only + self.row_only + self.neither

    @property
    def delta(self) -> float:
        """Row accuracy minus reference accuracy (a fraction; 0 when there are no questions)."""
        return (self.row_only - self.ref_only) / self.n if self.n else 0.0

    def p_value(self) -> float:
        """Exact two-sided sign test (McNemar) on the discordant questions; 1.0 when there are none."""
        return sign_test(self.ref_only, self.row_only)

    def interval(self, z: float = Z95) -> tuple[float, float]:
        """Newcombe's interval for ``delta`` (row minus reference), as fractions."""
        return newcombe_paired(self.both, self.ref_only, self.row_only, self.neither, z)

    def to_dict(self) -> dict:
        lo, hi = self.interval() if self.n else (None, None)
        return {"n": self.n, "both": self.both, "full_only": self.ref_only, "row_only": self.row_only,
                "neither": self.neither, "delta_pts": 100.0 * self.delta,
                "ci95_pts": None if lo is None else [100.0 * lo, 100.0 * hi], "p_value": self.p_value()}


def sign_test(b: int, c: int) -> float:
    """Two-sided exact binomial test of ``b`` vs ``c`` discordant outcomes with p = 1/2.

    p = min(1, 2 * P(X <= min(b, c))), X ~ Binomial(b + c, 1/2): the probability, were both
    systems equally good, of a split at least as lopsided as the one seen.
    """
    if b < 0 or c < 0:
        raise ValueError("counts must be >= 0")
    m = b + c
    if m == 0:
        return 1.0
    tail = sum(math.comb(m, k) for k in range(min(b, c) + 1))
    return min(1.0, 2 * tail / 2**m)


def wilson(successes: int, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson score interval of a proportion."""
    if n <= 0:
        raise ValueError("n must be > 0")
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z / (1 + z * z / n) * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return max(0.0, centre - half), min(1.0, centre + half)


def newcombe_paired(both: int, ref_only: int, row_only: int, neither: int, z: float = Z95) -> tuple[float, float]:
    """Interval for p_row - p_ref from a paired 2x2 table (Newcombe 1998, method 10): with (l, u)
    the Wilson intervals of each accuracy and phi the correlation of the pairs (its numerator
    ad - bc lowered by n/2, floored at 0, when positive, as Newcombe recommends), lower = d - sqrt((p_row - l_row)^2 - 2 phi (p_row - l_row)(u_ref - p_ref) + (u_ref - p_ref)^2),
    upper = d + sqrt((u_row - p_row)^2 - 2 phi (u_row - p_row)(p_ref - l_ref) + (p_ref - l_ref)^2)."""
    n = both + ref_only + row_only + neither
    ref_right, row_right = both + ref_only, both + row_only
    p_ref, p_row = ref_right / n, row_right / n
    l_ref, u_ref = wilson(ref_right, n, z)
    l_row, u_row = wilson(row_right, n, z)
    denom = (both + ref_only) * (row_only + neither) * (both + row_only) * (ref_only + neither)
    cross = both * neither - ref_only * row_only
    if cross > 0:  # Newcombe's continuity correction of a positive correlation
        cross = max(cross - n / 2, 0.0)
    phi = cross / math.sqrt(denom) if denom else 0.0
    d = p_row - p_ref
    lower = d - math.sqrt(max(0.0, (p_row - l_row) ** 2 - 2 * phi * (p_row - l_row) * (u_ref - p_ref)
                              + (u_ref - p_ref) ** 2))
    upper = d + math.sqrt(max(0.0, (u_row - p_row) ** 2 - 2 * phi * (u_row - p_row) * (p_ref - l_ref)
                              + (p_ref - l_ref) ** 2))
    return max(-1.0, lower), min(1.0, upper)
