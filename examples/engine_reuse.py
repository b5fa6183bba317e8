"""Chunk-cache reuse with the engine: the same chunks in another order are served from cache.

Run: .venv/bin/python examples/engine_reuse.py
"""

from cachedrag.corpus import stdlib_corpus
from cachedrag.engine import CachedEngine

engine = CachedEngine()
tok = engine.runner.tokenizer
docs = {d.id: d.text for d in stdlib_corpus(("heapq", "bisect", "functools", "textwrap"))}
chunks = [tok.decode(tok.encode(text, add_special_tokens=False)[:256]) for text in docs.values()]
system = "Answer the question using the Python documentation excerpts. Be brief."

for label, order, question in [
    ("cold", chunks, "What does heapq.heappush do?"),
    ("same chunks, new order", chunks[::-1], "How do I insert into a sorted list?"),
]:
    full = engine.generate(order, question, system, max_new_tokens=32, mode="full")
    r = engine.generate(order, question, system, max_new_tokens=32)
    print(f"{label}: TTFT {r.ttft_s * 1000:.0f} ms (full prefill {full.ttft_s * 1000:.0f} ms), "
          f"{r.chunks_hit}/{len(order)} chunks from cache, CFO {[round(c, 2) if c else c for c in r.chunk_cfo]}")
    print(f"  answer: {r.text.strip()[:120]}")
