"""Answer-fidelity and latency metrics shared by the benchmark suites.

Owns: ROUGE-L F1 (LCS over lower-cased word tokens, the standard definition), order
statistics (median, mean, p95) and speedup ratios, where a teacher-forced answer first
leaves the reference (``divergence``, ``divergence_summary``), and whether an answer's first
token as decoded is the reference's (``first_token_matches``). Pure Python.
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


def first_token_matches(result, reference_ids: Sequence[int]) -> bool:
    """Whether ``result``'s (an ``EngineResult``) first token as first decoded, what a stream of it
    would have shown, is ``reference_ids[0]``: a whole answer's rewind (``tie_guard_rewound``) may
    replace that token afterwards, and its final ``token_ids`` would hide the flip.

    >>> from types import SimpleNamespace as R
    >>> first_token_matches(R(token_ids=[5, 6], decoded_first_token=5), [5, 7])
    True
    >>> first_token_matches(R(token_ids=[5, 6], decoded_first_token=9), [5, 6])  # rewound past a flip
    False
    >>> first_token_matches(R(token_ids=[], decoded_first_token=None), [])
    True
    """
    decoded = result.decoded_first_token
    first = result.token_ids[:1] if decoded is None else [decoded]
    return first == list(reference_ids[:1])


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


def divergence(reference_top: Sequence[int], mode_top: Sequence[int], reference_gaps: Sequence[float],
               mode_gaps: Sequence[float]) -> dict:
    """Where a mode's greedy answer first leaves the reference's, read off one teacher-forced pass
    over the reference answer: ``reference_top`` / ``mode_top`` are each reading's top-1 token at
    every answer position, ``*_gaps`` its top-1 minus top-2 logit there (nats). Along the
    reference's own tokens the two greedy answers are equal up to the first position whose top-1
    differs, so that position is where the free-running answers part. Returns ``position`` (None:
    the answers are equal over the whole answer), the two gaps there, and ``mode_gap_min``: the
    smallest gap of the mode's reading up to there (over the whole answer when they never part),
    what a gap guard watching every decode step would have seen before the answers parted."""
    n = min(len(reference_top), len(mode_top))
    position = next((j for j in range(n) if reference_top[j] != mode_top[j]), None)
    end = n if position is None else position + 1
    return {"position": position,
            "reference_gap": None if position is None else reference_gaps[position],
            "mode_gap": None if position is None else mode_gaps[position],
            "mode_gap_min": min(mode_gaps[:end]) if end else None}


def divergence_summary(records: Sequence[dict], near_tie: float = 0.25) -> dict:
    """Over ``divergence`` records: how many answers part from the reference, where (median
    position), how near a tie the reference itself was there (median gap, and how many under
    ``near_tie`` nats), and how many of the approximate answers (records with ``approximate``
    true) a gap guard at ``near_tie`` watching every decode step would prefill again
    (``mode_gap_min`` under it) against the partings that would prevent."""
    parted = [r for r in records if r["position"] is not None]
    guarded = [r for r in records if r.get("approximate", True) and r["mode_gap_min"] is not None
               and r["mode_gap_min"] < near_tie]
    return {
        "answers": len(records),
        "approximate": sum(bool(r.get("approximate", True)) for r in records),
        "parted": len(parted),
        "first_token_parted": sum(r["position"] == 0 for r in parted),
        "position_median": statistics.median(r["position"] for r in parted) if parted else None,
        "reference_gap_median": statistics.median(r["reference_gap"] for r in parted) if parted else None,
        "near_tie": near_tie,
        "parted_at_reference_near_tie": sum(r["reference_gap"] < near_tie for r in parted),
        "step_guard_prefills": len(guarded),
        "step_guard_prevents": sum(r["position"] is not None for r in guarded),
    }
