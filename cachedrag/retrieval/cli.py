"""``cachedrag index build|search``.

Owns: the arguments of the two index commands and their output. ``build`` chunks a corpus
(a directory of .txt/.md files or a JSONL file; the stdlib demo corpus when ``--corpus`` is
omitted) in an LLM tokenizer's tokens, embeds and writes an index directory; ``search``
prints ranked chunks with their scores. Heavy imports happen inside ``run_*`` so building
the CLI parser stays cheap. Does not own: any retrieval logic.
"""

from __future__ import annotations

import argparse
import json
import sys

from cachedrag.retrieval.config import DEFAULT_EMBEDDER, ChunkConfig, IndexConfig, SearchConfig

_CHUNK = ChunkConfig()
_INDEX = IndexConfig()
_SEARCH = SearchConfig()
SNIPPET_CHARS = 300  # chunk text shown per hit by default


def add_build_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--corpus", help="directory of .txt/.md files or a JSONL file (default: the stdlib docs corpus)")
    parser.add_argument("--out", required=True, help="index directory to write (replaced if it is an index)")
    parser.add_argument("--nlist", type=int, help=f"IVF clusters (default {_INDEX.nlist}; clamped to the chunk count)")
    parser.add_argument("--chunk-tokens", type=int, help=f"LLM tokens per chunk (default {_CHUNK.chunk_tokens})")
    parser.add_argument("--overlap", type=int, help=f"tokens shared by consecutive chunks (default {_CHUNK.overlap})")
    parser.add_argument("--metric", choices=["ip", "l2"], help=f"similarity (default {_INDEX.metric})")
    parser.add_argument(
        "--tokenizer", help="LLM tokenizer name or local path (default: the default model's tokenizer)"
    )
    parser.add_argument("--embedder", default=DEFAULT_EMBEDDER, help="sentence-transformers name or local path")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")


def run_build(args: argparse.Namespace) -> int:
    from cachedrag.corpus import load_corpus, stdlib_corpus
    from cachedrag.retrieval.chunker import load_tokenizer
    from cachedrag.retrieval.config import RetrievalConfig, make_config
    from cachedrag.retrieval.embedder import Embedder
    from cachedrag.retrieval.index import build_index

    config = RetrievalConfig(
        chunk=make_config(ChunkConfig, chunk_tokens=args.chunk_tokens, overlap=args.overlap),
        index=make_config(IndexConfig, nlist=args.nlist, metric=args.metric),
    )
    docs = load_corpus(args.corpus) if args.corpus else stdlib_corpus()
    tokenizer = load_tokenizer(args.tokenizer)
    embedder = Embedder(model=args.embedder)
    index = build_index(docs, tokenizer, embedder, config, out=args.out, progress=False if args.quiet else None)
    m = index.manifest
    print(
        f"index {index.path}: {m.n_docs} documents -> {m.n_chunks} chunks of <= {m.chunk.chunk_tokens} tokens "
        f"(overlap {m.chunk.overlap}, tokenizer {m.tokenizer['name']}), embedder {m.embedder} (d={m.dim}), "
        f"IVF-Flat nlist={m.nlist}{'' if m.nlist == m.nlist_requested else f' (requested {m.nlist_requested})'}, "
        f"metric={m.metric}"
    )
    return 0


def add_search_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("index", metavar="DIR", help="index directory from `cachedrag index build`")
    parser.add_argument("query", help="query text")
    parser.add_argument("-k", type=int, default=_SEARCH.k, help=f"results (default {_SEARCH.k})")
    parser.add_argument("--nprobe", type=int, default=_SEARCH.nprobe, help=f"clusters probed (default {_SEARCH.nprobe})")
    parser.add_argument("--embedder", help="embedder to use (default: the one recorded in the index)")
    parser.add_argument("--max-chars", type=int, default=SNIPPET_CHARS, help="characters of chunk text shown (0: all)")
    parser.add_argument("--json", action="store_true", help="print one JSON object per hit")


def run_search(args: argparse.Namespace) -> int:
    from cachedrag.retrieval.embedder import Embedder
    from cachedrag.retrieval.index import load_index

    embedder = Embedder(model=args.embedder) if args.embedder else None
    index = load_index(args.index, embedder=embedder)
    hits = index.search(args.query, k=args.k, nprobe=args.nprobe)[0]
    for hit in hits:
        c = hit.chunk
        if args.json:
            print(json.dumps({"rank": hit.rank + 1, "score": hit.score, "id": c.id, "doc_id": c.doc_id,
                              "token_start": c.token_start, "token_end": c.token_end,
                              "char_start": c.char_start, "char_end": c.char_end, "text": c.text}))
            continue
        text = c.text if args.max_chars == 0 else c.text[: args.max_chars]
        print(f"{hit.rank + 1:>3}  {hit.score:8.4f}  {c.id}  [tokens {c.token_start}:{c.token_end}, chars {c.char_start}:{c.char_end}]")
        print("     " + " ".join(text.split()) + ("..." if len(text) < len(c.text) else ""))
    if not hits:
        print("no results", file=sys.stderr)
    return 0
