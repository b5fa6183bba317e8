"""The precision of recomputed rows (``CacheConfig.recompute_dtype``): bfloat16 repairs vs float32.

A reuse-served request recomputes ~27% of each reused chunk's tokens to repair the cached K/V
they carry from other neighbours. By default those rows' matmuls run on bfloat16 copies of the
weights (the question, fresh chunks and the logits stay float32); ``recompute_dtype="float32"``
is the reference. Both engines below serve the same reordered retrieval, every chunk cached
before in another order, and print TTFT, the approximations each used and the answer, beside
full prefill (docs/fidelity.md, round 10).

    python examples/recompute_precision.py            # embedded SmolLM2-135M-Instruct
"""

from __future__ import annotations

from cachedrag.config import EngineConfig
from cachedrag.corpus import stdlib_corpus
from cachedrag.engine import CachedEngine
from cachedrag.kvcache.config import CacheConfig
from cachedrag.model.loader import load_model
from cachedrag.model.runner import ModelRunner

SYSTEM = "Answer the question using the Python documentation excerpts given by the user. Be brief."


def main() -> None:
    runner = ModelRunner(*load_model(None))  # one loaded model shared by the engines
    docs = {d.id: d.text for d in stdlib_corpus(("heapq", "bisect", "functools", "itertools"))}
    chunks = [docs[f"stdlib/{m}"][:1000] for m in ("heapq", "bisect", "functools", "itertools")]
    question = "Which function keeps a list sorted while inserting an item?"
    order = [chunks[2], chunks[0], chunks[3], chunks[1]]  # every chunk cached below, none in this order
    full = CachedEngine(runner, config=EngineConfig(mode="full")).generate(order, question, SYSTEM, max_new_tokens=24)
    print(f"     full prefill: TTFT {full.ttft_s:.3f} s  {full.text.strip()!r}")
    for dtype in ("bfloat16", "float32"):
        engine = CachedEngine(runner, config=EngineConfig(cache=CacheConfig(recompute_dtype=dtype, exact_repeats=0)))
        engine.generate(chunks, "What are these modules for?", SYSTEM, max_new_tokens=1)  # caches every chunk
        engine.generate(order, "warm-up question", SYSTEM, max_new_tokens=1)  # first reuse (one-time costs)
        r = engine.generate(order, question, SYSTEM, max_new_tokens=24)
        same = "same as full" if r.token_ids == full.token_ids else "differs from full"
        print(f"{dtype:>9} repairs: TTFT {r.ttft_s:.3f} s, computed {r.computed_fraction:.2f}, "
              f"approximations {r.approximations}  ({same})")
        print(f"                   {r.text.strip()!r}")


if __name__ == "__main__":
    main()
