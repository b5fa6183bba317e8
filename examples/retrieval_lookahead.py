"""Lookahead retrieval on the stdlib docs corpus: prefetch while the "LLM" rewrites the query.

Run:  python examples/retrieval_lookahead.py [--modules 12]

Builds a small index (a subset of the stdlib corpus, chunked in the default LLM's tokens),
then for a few questions: starts the prefetch of the clusters nearest the original question,
simulates the LLM's query rewrite (a sleep of --llm-ms, then question + a hint), and searches
the rewritten query over the fast tier (prefetched) and the disk tier (missed) together.
Also shows the profile-guided budget and a staged search. Everything runs offline on CPU.
"""

from __future__ import annotations

import argparse
import tempfile
import time

from cachedrag.corpus import STDLIB_MODULES, STDLIB_QUESTIONS, stdlib_corpus
from cachedrag.errors import ConfigError, ModelNotFoundError
from cachedrag.retrieval.chunker import load_tokenizer
from cachedrag.retrieval.config import ChunkConfig, IndexConfig, LookaheadConfig, RetrievalConfig, SearchConfig
from cachedrag.retrieval.embedder import Embedder, default_embedder_path
from cachedrag.retrieval.index import build_index
from cachedrag.retrieval.lookahead import LookaheadRetriever


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--modules", type=int, default=12, help="stdlib modules in the corpus")
    parser.add_argument("--llm-ms", type=float, default=30.0, help="simulated query-rewrite time")
    args = parser.parse_args()

    try:
        tokenizer = load_tokenizer(None)  # the default LLM's tokenizer: chunk KV caches are keyed by its ids
    except (ConfigError, ModelNotFoundError) as exc:
        print(f"note: default LLM tokenizer unavailable ({exc}); using the embedder's tokenizer")
        tokenizer = load_tokenizer(default_embedder_path())
    docs = stdlib_corpus(STDLIB_MODULES[: args.modules])
    config = RetrievalConfig(chunk=ChunkConfig(chunk_tokens=256, overlap=32), index=IndexConfig(nlist=16))

    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        index = build_index(docs, tokenizer, Embedder(), config, out=f"{tmp}/index", progress=False)
        print(f"built {index.manifest.n_chunks} chunks, nlist={index.ivf.nlist} in {time.perf_counter() - t0:.1f} s")

        def preload_kv(chunk_ids: list[str]) -> None:  # the engine would load these chunks' KV now
            print(f"    on_candidates: preload KV of {chunk_ids}")

        retriever = LookaheadRetriever.from_index(
            index, device="cpu", config=LookaheadConfig(candidate_chunks=3),
            search_config=SearchConfig(k=3, nprobe=8), on_candidates=preload_kv,
        )
        with retriever:
            budget = retriever.profile_budget([args.llm_ms / 1e3])
            print(f"profile-guided budget b_p = bandwidth x {args.llm_ms:.0f} ms = {budget} bytes "
                  f"(index: {sum(index.ivf.cluster_nbytes())} bytes)")
            for question in STDLIB_QUESTIONS[:4]:
                print(f"\nQ: {question}")
                retriever.clear_fast_tier()
                retriever.slow.drop_page_cache()
                handle = retriever.prefetch(question)  # prepare: runs in the background
                time.sleep(args.llm_ms / 1e3)  # ... meanwhile the LLM rewrites the query
                rewritten = f"{question} Explain with the relevant function and an example."
                result = retriever.search(rewritten)  # compute (fast + slow tiers) + merge
                report = handle.wait()
                print(f"    prefetched {len(report.clusters)} clusters in {report.elapsed_ms:.1f} ms "
                      f"({report.embed_ms:.1f} ms embedding the question); "
                      f"search {result.total_ms:.2f} ms, hit rate {result.hit_rate:.2f}")
                for hit in index.hits(result.scores, result.ids)[0]:
                    print(f"    {hit.rank + 1}. {hit.score:.3f} {hit.chunk.id}")

            print("\nstaged search (speculative pipelining):")
            for stage in retriever.search_stages(STDLIB_QUESTIONS[0], n_stages=3):
                top = index.hits(stage.scores, stage.ids)[0][0]
                print(f"    after {stage.clusters_searched} clusters: top-1 {top.chunk.id} ({top.score:.3f})"
                      f"{'  [final]' if stage.final else ''}")


if __name__ == "__main__":
    main()
