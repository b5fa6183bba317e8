"""Exact repeats: a recurring retrieval turns from approximate chunk reuse into an exact prefix hit.

Every chunk is cached first in another order, so the retrieved order is served from non-prefix
reuse (approximate). With ``CacheConfig.exact.repeats=2`` (the default) the second such sighting
computes the sequence's exact knowledge-tree path once its answer is out, and the third is an
exact prefix hit: no approximation, the answer of full prefill. ``exact_repeats=0`` is the
reference behaviour (approximated at every sighting). See docs/fidelity.md, "Exact repeats".

    python examples/exact_repeats.py            # embedded SmolLM2-135M-Instruct
"""

from __future__ import annotations

from cachedrag.config import EngineConfig
from cachedrag.corpus import stdlib_corpus
from cachedrag.engine import CachedEngine
from cachedrag.kvcache.config import CacheConfig, ExactFallback
from cachedrag.model.loader import load_model
from cachedrag.model.runner import ModelRunner

SYSTEM = "Answer the question using the Python documentation excerpts given by the user. Be brief."
QUESTIONS = ["Which heapq function pushes an item and then pops the smallest?",
             "How do I insert into a sorted list?", "What does functools.lru_cache do?"]


def main() -> None:
    runner = ModelRunner(*load_model(None))  # one loaded model shared by both engines
    docs = {d.id: d.text for d in stdlib_corpus(("heapq", "bisect", "functools"))}
    chunks = [docs["stdlib/heapq"][:900], docs["stdlib/bisect"][:900], docs["stdlib/functools"][:900]]
    for n in (0, 2):
        engine = CachedEngine(runner, config=EngineConfig(cache=CacheConfig(exact=ExactFallback(repeats=n))))
        engine.generate(chunks[::-1], "What are these modules for?", SYSTEM, max_new_tokens=1)  # warm, other order
        print(f"exact_repeats={n}")
        for question in QUESTIONS:
            r = engine.generate(chunks, question, SYSTEM, max_new_tokens=16)
            print(f"  TTFT {r.ttft_s:.3f} s, approximations {r.approximations or 'none'}, exact repeat "
                  f"{r.exact_repeat or '-'} ({r.promotion_s:.2f} s after the response): {r.text.strip()[:60]!r}")


if __name__ == "__main__":
    main()
