"""Answer-fidelity and latency metrics shared by the benchmark suites.

Owns: ROUGE-L F1 (LCS over lower-cased word tokens, the standard definition), order
statistics (median, mean, p95) and speedup ratios. Pure Python.
"""

from __future__ import annotations

import math
import re
import statistics
from collections.abc import Sequence

_WORD = re.compile(r"\w+", re.UNICODE)


def _tokens(text: str) -> list[str]:
    return _WORD.findall(text.lower())


def _lcs(a: Sequence[str], b: Sequence[str]) -> int:
    if not a or not b:
        return 0
    prev = [0] * (len(b) + 1)
    for x in a:
        cur = [0]
        for j, y in enumerate(b, 1):
            cur.append(prev[j - 1] + 1 if x == y else max(prev[j], cur[j - 1]))
        prev = cur
    return prev[-1]


def rouge_l(candidate: str, reference: str) -> float:
    """ROUGE-L F1 between two texts; 1.0 when both are empty."""
    c, r = _tokens(candidate), _tokens(reference)
    if not c and not r:
        return 1.0
    lcs = _lcs(c, r)
    if lcs == 0:
        return 0.0
    p, rec = lcs / len(c), lcs / len(r)
    return 2 * p * rec / (p + rec)


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile ``q`` in [0, 100]."""
    if not values:
        return math.nan
    s = sorted(values)
    pos = (len(s) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def summary(values: Sequence[float]) -> dict[str, float]:
    if not values:
        return {"median": math.nan, "mean": math.nan, "p95": math.nan}
    return {"median": statistics.median(values), "mean": statistics.fmean(values), "p95": percentile(values, 95)}
