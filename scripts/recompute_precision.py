"""The precision of the rows a reuse prefill computes: bfloat16 vs float32.

A reuse-served request recomputes ~27% of each reused chunk's tokens to repair the cached K/V
they carry from other neighbours (``CacheConfig.precision.recompute``), and computes the chunks it
missed; those behind a reused chunk attend to its approximate K/V (``CacheConfig.precision.fresh``).
By default both kinds of rows run their matmuls on bfloat16 copies of the weights (the system
prompt, fresh chunks before every reused one, the question and the logits stay float32);
``"float32"`` for both is the reference. Both engines below serve the same retrieval: three
chunks cached before in another order and one new chunk behind them. Each prints TTFT, the
approximations it used and the answer, beside full prefill (docs/fidelity.md, rounds 10 and 20).

    python scripts/recompute_precision.py            # embedded SmolLM2-135M-Instruct
"""

from __future__ import annotations

from cachedrag.config import EngineConfig
from cachedrag.corpus import stdlib_corpus
from cachedrag.engine import CachedEngine
from cachedrag.kvcache.config import CacheConfig, ExactFallback, RowPrecision
from cachedrag.model.loader import load_model
from cachedrag.model.runner import ModelRunner

SYSTEM = "Answer the question using the Python documentation excerpts given by the user. Be brief."


def main() -> None:
    runner = ModelRunner(*load_model(None))  # one loaded model shared by the engines
    docs = {d.id: d.text for d in stdlib_corpus(("heapq", "bisect", "functools", "itertools"))}
    chunks = [docs[f"stdlib/{m}"][:1000] for m in ("heapq", "bisect", "functools", "itertools")]
    question = "Which function keeps a list sorted while inserting an item?"
    cached = chunks[:3]  # cached below; itertools is new to every engine
    order = [chunks[2], chunks[0], chunks[3], chunks[1]]  # the cached ones in another order, the new one behind them
    full = CachedEngine(runner, config=EngineConfig(mode="full")).generate(order, question, SYSTEM, max_new_tokens=24)
    print(f"     full prefill: TTFT {full.ttft_s:.3f} s  {full.text.strip()!r}")
    for dtype in ("bfloat16", "float32"):
        cache = CacheConfig(precision=RowPrecision(recompute=dtype, fresh=dtype), exact=ExactFallback(repeats=0))
        engine = CachedEngine(runner, config=EngineConfig(cache=cache))
        engine.generate(cached, "What are these modules for?", SYSTEM, max_new_tokens=1)  # caches three chunks
        engine.generate(cached[::-1], "warm-up question", SYSTEM, max_new_tokens=1)  # first reuse (one-time costs)
        r = engine.generate(order, question, SYSTEM, max_new_tokens=24)
        same = "same as full" if r.token_ids == full.token_ids else "differs from full"
        print(f"{dtype:>9} rows: TTFT {r.ttft_s:.3f} s, computed {r.computed_fraction:.2f}, "
              f"approximations {r.approximations}  ({same})")
        print(f"                {r.text.strip()!r}")


if __name__ == "__main__":
    main()
