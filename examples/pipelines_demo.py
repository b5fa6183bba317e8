"""Prebuilt pipelines over the shared chunk cache, with lookahead IVF prefetch.

Run:  python examples/pipelines_demo.py [--modules 8] [--pipelines hyde,flare] [--tiny]

Builds a small index over part of the stdlib docs corpus, then answers a few questions with
each pipeline (HyDE, SubQuestion, Iter-RetGen, FLARE) over one ``CachedEngine`` (one chunk
cache for all of them) and a lookahead retriever, printing each run's steps and its
breakdown. Then the same pipeline as a LlamaIndex query engine and as a LangChain runnable.
``--tiny`` uses a random tiny model instead of the default SmolLM2 (seconds, gibberish answers).
Everything runs offline on CPU.
"""

from __future__ import annotations

import argparse
import tempfile
import time

from cachedrag.corpus import STDLIB_MODULES, STDLIB_QUESTIONS, stdlib_corpus
from cachedrag.engine import CachedEngine
from cachedrag.pipelines import PIPELINES, LookaheadSearch, pipeline_class
from cachedrag.retrieval import build_index
from cachedrag.retrieval.config import ChunkConfig, IndexConfig, RetrievalConfig
from cachedrag.retrieval.embedder import Embedder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--modules", type=int, default=8, help="stdlib modules in the corpus")
    parser.add_argument("--pipelines", default=",".join(PIPELINES), help="comma-separated pipelines")
    parser.add_argument("--questions", type=int, default=2, help="questions per pipeline")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--tiny", action="store_true", help="random tiny model (fast; answers are gibberish)")
    args = parser.parse_args()

    if args.tiny:
        from cachedrag.testing import tiny_runner

        engine = CachedEngine(tiny_runner())
    else:
        engine = CachedEngine()  # embedded SmolLM2-135M-Instruct
    tokenizer = engine.runner.tokenizer  # chunks in the LLM's tokens: chunk KV caches are keyed by them
    config = RetrievalConfig(chunk=ChunkConfig(chunk_tokens=64 if args.tiny else 256, overlap=16),
                             index=IndexConfig(nlist=16))
    with tempfile.TemporaryDirectory() as tmp:
        index = build_index(stdlib_corpus(STDLIB_MODULES[: args.modules]), tokenizer, Embedder(), config,
                            out=f"{tmp}/index", progress=False)
        print(f"index: {index.manifest.n_chunks} chunks, nlist {index.ivf.nlist}")
        retriever = LookaheadSearch.from_index(index, device="cpu", nprobe=8, engine=engine)
        questions = [q for q in STDLIB_QUESTIONS if any(m in q.lower() for m in ("json", "heapq", "csv", "bisect",
                                                                                "itertools", "functools"))]
        try:
            for name in args.pipelines.split(","):
                pipeline = pipeline_class(name.strip())(engine, retriever, max_new_tokens=args.max_new_tokens)
                for question in questions[: args.questions]:
                    show(pipeline.run(question))
            pipeline = pipeline_class("hyde")(engine, retriever, max_new_tokens=args.max_new_tokens)
            response = pipeline.as_query_engine().query(questions[0])  # LlamaIndex
            print(f"\nLlamaIndex query engine: {response.response!r} ({len(response.source_nodes)} source nodes)")
            answer = pipeline.as_runnable().invoke({"question": questions[0]})  # LangChain
            print(f"LangChain runnable: {answer!r}")
            print(f"chunk warming (on_candidates): {retriever.warmer.stats}")
        finally:
            retriever.close()


def show(run) -> None:
    print(f"\n[{run.pipeline}] {run.question}")
    for s in run.steps:
        extra = ""
        if s.kind in ("pre_retrieval", "post_retrieval"):
            extra = f"{s.computed_tokens}/{s.prompt_tokens} prompt tokens computed, chunks hit {s.cache.get('chunks_hit', 0)}"
        elif s.kind == "retrieval":
            extra = f"cluster hit rate {s.retrieval.get('hit_rate', 0):.2f}"
        elif s.kind == "judgment":
            extra = f"-> {s.output}"
        print(f"  {s.started_s:6.2f}s  {s.name:<22} {s.kind:<15} {s.seconds * 1e3:8.1f} ms  {extra}")
    b = run.breakdown()
    overlap = f", prefetch {b['prefetch_ms']:.1f} ms ({b['prefetch_overlap']:.0%} hidden)" if b.get("prefetch_ms") else ""
    print(f"  total {b['total_s']:.2f}s = LLM {b['llm_s']:.2f}s + retrieval {b['retrieval_s'] * 1e3:.1f} ms{overlap}")
    print(f"  answer: {run.answer[:200]!r}")


if __name__ == "__main__":
    t0 = time.perf_counter()
    main()
    print(f"\ndone in {time.perf_counter() - t0:.1f} s")
