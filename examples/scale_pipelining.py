"""A RAG request over a large on-disk index, sequential vs. speculative pipelining.

Builds (once, under the cache home; resumable) the scale index: the stdlib corpus's real chunk
embeddings plus synthetic distractors (``--vectors``, default 200,000; the benchmark uses
1,000,000), then answers one question twice with cold disk reads: search then prefill, and with
RAGCache's dynamic speculative pipelining (prefill on the intermediate top-k of a staged search).

    python examples/scale_pipelining.py --vectors 200000 --question "How do I pretty-print JSON?"

``--index DIR`` takes the real chunks from another index (`cachedrag index build`) instead of the
stdlib one; the scale index is then built beside it, in ``DIR-scale-N``.
"""

from __future__ import annotations

import argparse

from cachedrag.engine import CachedEngine
from cachedrag.pipelining import SpeculativePipeline, rows_stages
from cachedrag.retrieval import DiskIndexConfig, load_index
from cachedrag.retrieval.scale import DistractorConfig, build_scale_index, scale_index_dir, stdlib_base_index


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vectors", type=int, default=200_000)
    parser.add_argument("--nlist", type=int, default=512)
    parser.add_argument("--nprobe", type=int, default=64)
    parser.add_argument("--question", default="How do I pretty-print JSON?")
    parser.add_argument("--index", help="the index of the real chunks (default: the stdlib index under the cache home)")
    args = parser.parse_args()

    base = load_index(args.index) if args.index else stdlib_base_index()
    out = f"{args.index.rstrip('/')}-scale-{args.vectors}" if args.index else scale_index_dir(args.vectors)
    index = build_scale_index(base, out, DistractorConfig(ntotal=args.vectors),
                              DiskIndexConfig(nlist=args.nlist))
    q = index.embed(args.question)  # [1, d]
    search = rows_stages(lambda n: index.ivf.search_stages(q, 10, args.nprobe, n), index.texts)
    for name, stages in (("sequential", 1), ("speculative", None)):
        engine = CachedEngine()  # a fresh chunk cache for each, so the two runs compare fairly
        pipe = SpeculativePipeline(engine)
        index.ivf.store.drop_page_cache()  # cold reads from disk
        out = pipe.generate(args.question, search, max_new_tokens=32, n_stages=stages)
        print(f"{name:>11}: TTFT {out.ttft_s:.3f} s (final top-k after {out.search_s:.3f} s, {out.stages} stages, "
              f"{out.kept_chunks} chunks kept from speculation, {out.wasted_tokens} of {out.prefill_tokens} prefill "
              f"tokens wasted)\n             {out.result.text.strip()[:200]!r}")
        pipe.close()


if __name__ == "__main__":
    main()
