"""The tie guard during decoding: whole answers equal to full prefill's, at reuse's TTFT.

Every chunk is cached first in another order, so the retrieved order is served from non-prefix
reuse (approximate). ``fidelity="guarded"`` (the first-token tie guard at 0.25 nats) keeps the
first token full prefill's; later tokens are still decoded on the approximate KV, where a 135M
model's near ties flip. ``CacheConfig.exact.tie_guard_decode=G`` watches them too: the first answer
token whose top-2 logits are closer than G nats is not chosen from them; the prompt and the answer
so far are prefilled exactly (prefix caching's plan, its path stored) and decoding goes on from
that KV. The answer pauses once for that prefill (``result.tie_guard_switch_s``; its TTFT is
unchanged), ``result.tie_guard_switch`` says before which token, and ``result.tie_guard_agreed``
how many tokens before it were full prefill's greedy choices as well (when all of them were, the
whole answer is full prefill's). ``tie_guard_decode=inf`` switches every approximate answer before
its second token: ``fidelity="faithful"``, whose answers are full prefill's whenever their first
token is. Exact repeats are off so that every question meets the approximation (the switch stores
the exact path, so the next question over these chunks would be an exact hit: the example warms a
fresh engine before each one).

    python examples/decode_guard.py            # embedded SmolLM2-135M-Instruct
"""

from __future__ import annotations

import math

from tie_guard import QUESTIONS, SYSTEM, excerpts  # the first-token guard's example: same chunks and questions

from cachedrag.config import EngineConfig
from cachedrag.engine import CachedEngine
from cachedrag.kvcache.config import CacheConfig, ExactFallback
from cachedrag.model.loader import load_model
from cachedrag.model.runner import ModelRunner


def main() -> None:
    runner = ModelRunner(*load_model(None))  # one loaded model shared by every engine
    chunks = excerpts()
    full = CachedEngine(runner, config=EngineConfig(mode="full"))
    for decode in (0.0, 0.25, math.inf):  # "guarded", a threshold, "faithful"
        print(f"tie_guard=0.25 tie_guard_decode={decode}")
        for question in QUESTIONS:
            cache = CacheConfig(exact=ExactFallback(tie_guard=0.25, tie_guard_decode=decode, repeats=0))
            engine = CachedEngine(runner, config=EngineConfig(cache=cache))
            engine.generate(chunks[::-1], "What are these modules for?", SYSTEM, max_new_tokens=1)  # warm, other order
            reference = full.generate(chunks, question, SYSTEM, max_new_tokens=24)
            r = engine.generate(chunks, question, SYSTEM, max_new_tokens=24)
            how = "exact prefill for the first token" if r.tie_guard is not None else "approximate prefill"
            if r.tie_guard_switch is not None:
                how += (f", exact from token {r.tie_guard_switch} on (paused {r.tie_guard_switch_s:.2f} s; full "
                        f"prefill's choices before it: {r.tie_guard_agreed} of {r.tie_guard_switch})")
            same = "= full prefill" if r.token_ids == reference.token_ids else "differs"
            print(f"  {how}; TTFT {r.ttft_s:.3f} s, answer {r.total_s:.2f} s ({same}): {r.text.strip()[:48]!r}")


if __name__ == "__main__":
    main()
