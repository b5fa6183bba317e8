"""Tie guard: a near-tied first token is never left to the chunk-reuse approximation.

Every chunk is cached first in another order, so the retrieved order is served from non-prefix
reuse (approximate). With ``CacheConfig.exact.tie_guard=G``, a request whose approximate prefill ends
in a first token whose top-2 logits are closer than G nats is prefilled again exactly (its
answer is full prefill's, its TTFT pays both prefills; ``result.tie_guard`` holds the gap). The
default, 0, is off. These five questions have no first token within 0.3 nats, so the example
runs G = 1 to show it acting: the second question is guarded, and since the exact prefill stores
its knowledge-tree path the later questions over the same chunks are exact prefix hits (the
guarded line shows both plans, ``result.tie_guard_actions`` -> ``result.segment_actions``: every
chunk reused, then every chunk computed exactly; missed chunks ahead of the first reused one would
come from the tree in the exact plan, since the guard stores them first). With
G = 0 two answers differ from full prefill although their first tokens are decisive (gaps near
2 nats): the guard does not look at those (``fidelity="faithful"`` guards every later token too:
``CacheConfig.exact.tie_guard_decode``).

    python examples/tie_guard.py            # embedded SmolLM2-135M-Instruct
"""

from __future__ import annotations

from cachedrag_bench.ttft import plan_letters
from cachedrag.config import EngineConfig
from cachedrag.corpus import stdlib_corpus
from cachedrag.engine import CachedEngine, top2_gap
from cachedrag.kvcache.config import CacheConfig, ExactFallback
from cachedrag.model.loader import load_model
from cachedrag.model.runner import ModelRunner

SYSTEM = "Answer the question using the Python documentation excerpts given by the user. Be brief."
QUESTIONS = ["Which heapq function pushes an item and then pops the smallest?",
             "How do I insert into a sorted list?", "What does functools.lru_cache do?",
             "Which module keeps a list sorted?", "How do I cache the results of a function?"]


def excerpts() -> list[str]:
    """The three retrieved chunks: the heapq, bisect and functools docs' openings (embedded corpus)."""
    docs = {d.id: d.text for d in stdlib_corpus(("heapq", "bisect", "functools"))}
    return [docs["stdlib/heapq"][:900], docs["stdlib/bisect"][:900], docs["stdlib/functools"][:900]]


def main() -> None:
    runner = ModelRunner(*load_model(None))  # one loaded model shared by every engine
    chunks = excerpts()
    full = CachedEngine(runner, config=EngineConfig(mode="full"))
    for guard in (0.0, 1.0):
        # exact_repeats off: every question is served from reuse, so each one meets the guard
        cache = CacheConfig(exact=ExactFallback(tie_guard=guard, repeats=0))
        engine = CachedEngine(runner, config=EngineConfig(cache=cache))
        engine.generate(chunks[::-1], "What are these modules for?", SYSTEM, max_new_tokens=1)  # warm, other order
        print(f"tie_guard={guard}")
        for question in QUESTIONS:
            segs = engine.prompts.chat(chunks, question, SYSTEM)
            reference = full.generate(chunks, question, SYSTEM, max_new_tokens=12)
            gap = top2_gap(full.prefill_logits(segs))
            r = engine.generate(chunks, question, SYSTEM, max_new_tokens=12)
            guarded = "not guarded"
            if r.tie_guard is not None:  # plans: T tree, R reused, F fresh (system first), approximate -> exact
                guarded = (f"guarded (gap {r.tie_guard:.2f}, plan {plan_letters(r.tie_guard_actions)} -> "
                           f"{plan_letters(r.segment_actions)})")
            print(f"  full prefill's first-token gap {gap:.2f}; {guarded}, approximations "
                  f"{r.approximations or 'none'}, TTFT {r.ttft_s:.3f} s, answer "
                  f"{'= full prefill' if r.token_ids == reference.token_ids else 'differs'}: {r.text.strip()[:50]!r}")


if __name__ == "__main__":
    main()
