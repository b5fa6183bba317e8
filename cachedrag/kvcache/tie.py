"""The tie guard's decisions: is a token a near tie, and does the approximation look set to change it?

Owns the near-tie rule (``near_tie``: a top-2 gap below the threshold, allowing for the rounding
of the logits' dtype) and the trend check's decision (torch-free policy; the engine measures the
logits it reads). The tie guard (``CacheConfig.tie_guard``) re-prefills exactly a request whose
approximate first token is a near tie. A gap threshold alone cannot tell a near tie that the
approximation is about to flip from one it leaves alone (docs/fidelity.md, lever 4: on ``bench
ttft``'s two streams the flips' gaps and the non-flips' overlap). The trend check adds a second reading of the same request: the
first-token logits with the recomputed rows of the reused chunks put back to their cached values
(what reuse gives with no recompute). Going from that reading to the approximate one, the
recompute moved each rival's margin by some amount; the rows still not recomputed are assumed
to move it on by ``trend`` times as much. The request is re-prefilled only when that predicted
margin of the approximate top-1 over some rival falls below zero, i.e. when the recompute so far
is closing in on a rival and the rest of it would likely pass it.
"""

from __future__ import annotations

import math
from typing import Sequence


def rounding_unit(value: float, mantissa_bits: int) -> float:
    """The spacing of binary floating-point numbers with ``mantissa_bits`` explicit mantissa bits at
    ``value`` (one unit in the last place: 7 bits for bfloat16, 10 for float16, 23 for float32).

    >>> rounding_unit(20.0, 7), rounding_unit(40.0, 7), rounding_unit(-20.0, 23) == 2.0 ** -19
    (0.125, 0.25, True)
    """
    if value == 0 or not math.isfinite(value):
        return 0.0
    return math.ldexp(1.0, math.frexp(value)[1] - 1 - mantissa_bits)


def near_tie(gap: float, top: float, threshold: float, mantissa_bits: int) -> bool:
    """Whether a top-2 logit gap ``gap`` (the top logit ``top``) is a near tie at ``threshold`` nats:
    ``gap < threshold`` plus one rounding unit of the logits' dtype at ``top``. Logits computed in
    bfloat16 come in steps of 1/8 nat near 20 (1/4 near 40), so a gap read as 0.25 may be two steps
    of a smaller one; in float32 the unit is below 1e-5 and the rule is ``gap < threshold`` (a gap
    equal to it counts too).

    >>> near_tie(0.25, 20.0, 0.2, 7), near_tie(0.375, 20.0, 0.25, 7), near_tie(0.25, 20.0, 0.2, 23)
    (True, False, False)
    """
    return gap < threshold + rounding_unit(top, mantissa_bits)


def predicted_margin(approx: Sequence[float], reverted: Sequence[float], trend: float) -> float:
    """The smallest predicted margin of the approximate top-1 over its rivals.

    ``approx``: logits of the candidate tokens under the approximate prefill, its top-1 first;
    ``reverted``: the same tokens' logits with the recomputed rows put back to their cached
    values. Per rival ``b``, with ``s`` its margin under the approximation and ``s0`` under the
    reverted reading: ``s + trend * (s - s0)``.

    >>> predicted_margin([2.0, 1.8], [2.0, 1.2], 0.5)  # the recompute closed 0.6 of the gap: 0.2 - 0.3
    -0.1
    >>> predicted_margin([2.0, 1.8], [1.0, 1.5], 0.5)  # it opened the gap: the first token holds
    0.55
    >>> predicted_margin([2.0, 1.8], [2.0, 1.2], 0.0)  # trend 0: the gap itself
    0.2
    """
    if len(approx) != len(reverted) or len(approx) < 2:
        raise ValueError("predicted_margin needs the same >= 2 candidates in both readings")
    if trend < 0:
        raise ValueError(f"trend must be >= 0, got {trend}")
    margins = []
    for a, r in zip(approx[1:], reverted[1:]):
        s, s0 = approx[0] - a, reverted[0] - r
        margins.append(s + trend * (s - s0))
    return round(min(margins), 12)
