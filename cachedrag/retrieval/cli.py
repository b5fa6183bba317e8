"""``cachedrag index build|search``.

Owns: the arguments of the two index commands and their output. ``build`` chunks a corpus
(a directory of .txt/.md files or a JSONL file; the stdlib demo corpus when ``--corpus`` is
omitted) in an LLM tokenizer's tokens, embeds and writes an index directory; ``search``
prints ranked chunks with their scores. Heavy imports happen inside ``run_*`` so building
the CLI parser stays cheap. Does not own: any retrieval logic.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

from cachedrag.errors import ConfigError, InputError, InputNotFoundError
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
    from cachedrag.retrieval.config import RetrievalConfig, make_config

    # every argument is checked before the slow part (loading models, embedding)
    config = RetrievalConfig(
        chunk=make_config(ChunkConfig, chunk_tokens=args.chunk_tokens, overlap=args.overlap),
        index=make_config(IndexConfig, nlist=args.nlist, metric=args.metric),
    )
    if args.corpus and not Path(args.corpus).exists():
        raise InputNotFoundError(f"--corpus {args.corpus}: no such file or directory")
    check_out_dir(args.out)
    require_faiss()

    from cachedrag.corpus import load_corpus, stdlib_corpus
    from cachedrag.paths import cache_home
    from cachedrag.retrieval.chunker import load_tokenizer
    from cachedrag.retrieval.embedder import Embedder
    from cachedrag.retrieval.embedding_cache import CachingEmbedder
    from cachedrag.retrieval.index import build_index

    docs = load_corpus(args.corpus) if args.corpus else stdlib_corpus()
    tokenizer = load_tokenizer(args.tokenizer)
    # embeddings are saved as they are computed: a failed or interrupted build resumes
    embedder = CachingEmbedder(Embedder(model=args.embedder), cache_home() / "embeddings")
    index = build_index(docs, tokenizer, embedder, config, out=args.out, progress=False if args.quiet else None)
    m = index.manifest
    print(
        f"index {index.path}: {m.n_docs} documents -> {m.n_chunks} chunks of <= {m.chunk.chunk_tokens} tokens "
        f"(overlap {m.chunk.overlap}, tokenizer {m.tokenizer['name']}), embedder {m.embedder} (d={m.dim}), "
        f"IVF-Flat nlist={m.nlist}{'' if m.nlist == m.nlist_requested else f' (requested {m.nlist_requested})'}, "
        f"metric={m.metric}; {embedder.served} chunk embeddings reused from an earlier build"
    )
    return 0


def check_out_dir(out: str) -> None:
    """``--out`` must be a new or empty directory, or an index (replaced): refused before any work."""
    path = Path(out)
    if path.exists() and not path.is_dir():
        raise InputError(f"--out {out} is a file, not a directory")
    if path.is_dir() and any(path.iterdir()) and not (path / "manifest.json").is_file():
        raise InputError(f"--out {out} is a non-empty directory that is not a cachedrag index; "
                         f"choose a new or empty directory")


def require_faiss() -> None:
    """Building an index trains IVF with Faiss: say how to install it before any work."""
    if importlib.util.find_spec("faiss") is None:
        raise ConfigError("building an index needs Faiss, which is not installed: run `pip install faiss-cpu`")


def add_search_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("index", metavar="DIR", help="index directory from `cachedrag index build`")
    parser.add_argument("query", help="query text")
    parser.add_argument("-k", type=int, default=_SEARCH.k, help=f"results (default {_SEARCH.k})")
    parser.add_argument("--nprobe", type=int, help=f"clusters probed (default {_SEARCH.nprobe}, at most the index's nlist)")
    parser.add_argument("--embedder", help="embedder to use (default: the one recorded in the index)")
    parser.add_argument("--max-chars", type=int, default=SNIPPET_CHARS, help="characters of chunk text shown (0: all)")
    parser.add_argument("--json", action="store_true", help="print one JSON object per hit")


def run_search(args: argparse.Namespace) -> int:
    if args.k < 1:
        raise ConfigError(f"-k must be >= 1 (got {args.k})")
    if args.nprobe is not None and args.nprobe < 1:
        raise ConfigError(f"--nprobe must be >= 1 (got {args.nprobe})")
    if args.max_chars < 0:
        raise ConfigError(f"--max-chars must be >= 0 (got {args.max_chars})")
    if not args.query.strip():
        raise InputError("the query is empty")
    path = Path(args.index)
    if not path.exists():
        raise InputNotFoundError(f"{args.index}: no such index directory")
    if not (path / "manifest.json").is_file():
        raise InputError(f"{args.index} is not a cachedrag index directory (no manifest.json); "
                         f"build one with `cachedrag index build --out {args.index}`")
    from cachedrag.retrieval.embedder import Embedder
    from cachedrag.retrieval.index import load_index

    embedder = Embedder(model=args.embedder) if args.embedder else None
    index = load_index(args.index, embedder=embedder)
    nprobe = args.nprobe if args.nprobe is not None else min(_SEARCH.nprobe, index.manifest.nlist)
    if nprobe > index.manifest.nlist:
        raise ConfigError(f"--nprobe {nprobe} exceeds the index's {index.manifest.nlist} clusters")
    hits = index.search(args.query, k=args.k, nprobe=nprobe)[0]
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
