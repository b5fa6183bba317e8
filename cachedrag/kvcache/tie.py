"""The tie guard's decision: is a token a near tie?

Owns the near-tie rule (``near_tie``: a top-2 gap below the threshold, allowing for the rounding
of the logits' dtype); torch-free policy, the engine measures the logits it reads. The tie guard
(``CacheConfig.exact.tie_guard``) re-prefills exactly a request whose approximate first token is a near
tie; ``CacheConfig.exact.tie_guard_decode`` does the same for the answer's later tokens.
"""

from __future__ import annotations

import math


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
