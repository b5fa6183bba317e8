"""LlamaIndex RAG with cachedrag: a RetrieverQueryEngine whose LLM reuses chunk KV caches.

Builds a small index of a few stdlib modules' docs (or uses --index DIR from
`cachedrag index build`), then asks questions twice: the second time the retrieved chunks'
KV caches are reused, and the time to first token drops.

Run: .venv/bin/python examples/llamaindex_rag.py [--index DIR]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from llama_index.core import Settings
from llama_index.core.embeddings import MockEmbedding
from llama_index.core.indices.query.query_transform import HyDEQueryTransform
from llama_index.core.query_engine import RetrieverQueryEngine, TransformQueryEngine

from cachedrag.integrations.llama_index import CachedRAGLLM, CachedRAGRetriever

QUESTIONS = ["How do I pretty-print a JSON document with indentation?", "What does heapq.heappush do?"]


def small_index(out: Path) -> Path:
    from cachedrag.corpus import stdlib_corpus
    from cachedrag.model.loader import load_default_tokenizer
    from cachedrag.retrieval import Embedder, build_index

    docs = stdlib_corpus(("json", "heapq", "bisect", "hashlib", "uuid", "textwrap"), max_chars_per_doc=6000)
    build_index(docs, load_default_tokenizer(), Embedder(), out=out, progress=False)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--index", help="an index directory from `cachedrag index build`")
    args = parser.parse_args()

    llm = CachedRAGLLM(max_new_tokens=48)  # the embedded SmolLM2-135M-Instruct; no network
    Settings.llm = llm  # so no LlamaIndex default reaches for OpenAI
    Settings.embed_model = MockEmbedding(embed_dim=8)  # unused: the retriever embeds with the index's model

    with tempfile.TemporaryDirectory() as tmp:
        index_dir = args.index or small_index(Path(tmp) / "index")
        retriever = CachedRAGRetriever(index_dir=str(index_dir), similarity_top_k=3)
        engine = RetrieverQueryEngine.from_args(retriever, llm=llm)
        for attempt in ("first", "again"):
            for question in QUESTIONS:
                t = time.perf_counter()
                response = engine.query(question)
                stats = response.metadata["cachedrag"]  # this query's cache stats (summed over its LLM calls)
                print(f"[{attempt}] {question}\n  -> {str(response).strip()[:160]!r}")
                print(f"  {time.perf_counter() - t:.2f} s total, TTFT {stats['ttft_s'] * 1000:.0f} ms, "
                      f"{stats['registered_chunks']} retrieved chunks in the prompt, "
                      f"{stats['registered_chunks_cached']} of them from the cache, "
                      f"{stats['cached_tokens']}/{stats['prompt_tokens']} prompt tokens served from cache")
                print(f"  sources: {[n.node.node_id for n in response.source_nodes]}")

        # HyDE: the LLM writes a hypothetical answer first; the retriever starts prefetching the
        # original question's IVF clusters when the query starts, and embeds both texts.
        hyde = TransformQueryEngine(engine, HyDEQueryTransform(llm=llm, include_original=True))
        print("[HyDE]", str(hyde.query("How do I compute a SHA-256 hash of some bytes?")).strip()[:160])
        retriever.close()


if __name__ == "__main__":
    main()
