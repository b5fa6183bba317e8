"""``cachedrag demo``: RAG over the Python stdlib docs with chunk-cache reuse, against full prefill.

Owns: the demo command only. It loads the embedded default model, builds (once, then cached
under the cachedrag home) an IVF index of the stdlib documentation, and answers a Zipf stream of
questions, asked in different words as users do, twice each: with cachedrag's chunk reuse and
with plain full prefill, printing answers, time to first token and cache hits, then a
comparison table.
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import time

from cachedrag.corpus import STDLIB_TOPICS, stdlib_corpus, zipf_stream

SYSTEM_PROMPT = (
    "You are a helpful assistant. Answer the question using the Python documentation excerpts "
    "given by the user. Be brief."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-questions", type=int, default=12, help="questions in the stream (default 12)")
    parser.add_argument("--top-k", type=int, default=5, help="chunks retrieved per question (default 5)")
    parser.add_argument("--max-new-tokens", type=int, default=40, help="answer length bound (default 40)")
    parser.add_argument("--model", default=None, help="HF model id or path (default: embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--no-baseline", action="store_true", help="skip the full-prefill comparison")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tiny", action="store_true",
                        help="smoke test of the install: a tiny random-weight model and a 6-document corpus "
                             "(runs in seconds; the answers are noise)")


def stdlib_index(tokenizer, model_name: str):
    """The IVF index of the stdlib docs for this tokenizer, built once and cached on disk."""
    from cachedrag.paths import cache_home
    from cachedrag.retrieval.embedder import Embedder
    from cachedrag.retrieval.index import build_index, load_index

    docs = stdlib_corpus()
    digest = hashlib.sha256("".join(d.id + d.text for d in docs).encode() + model_name.encode()).hexdigest()[:16]
    path = cache_home() / "indexes" / f"stdlib-{digest}"
    embedder = Embedder()
    if (path / "manifest.json").is_file():
        return load_index(path, embedder)
    from cachedrag.retrieval.embedding_cache import CachingEmbedder

    print("building the stdlib-docs index (once; cached for later runs)...")
    # embeddings are saved as they are computed: an interrupted first run resumes
    return build_index(docs, tokenizer, CachingEmbedder(embedder, cache_home() / "embeddings"), out=path)


def tiny_setup(tmp_dir: str):
    """``--tiny``: a random-weight model with the byte tokenizer and an index of six short docs."""
    from cachedrag.model.runner import ModelRunner
    from cachedrag.retrieval.config import ChunkConfig, IndexConfig, RetrievalConfig
    from cachedrag.retrieval.embedder import Embedder
    from cachedrag.retrieval.index import build_index
    from cachedrag.testing import TINY_DOCS, byte_tokenizer, tiny_model

    tok = byte_tokenizer()
    model = tiny_model("llama", vocab_size=len(tok), max_position_embeddings=4096)
    model.generation_config.eos_token_id = tok.eos_token_id
    config = RetrievalConfig(chunk=ChunkConfig(chunk_tokens=96, overlap=8), index=IndexConfig(nlist=2))
    index = build_index(TINY_DOCS, tok, Embedder(), config, out=f"{tmp_dir}/index", progress=False)
    return ModelRunner(model, tok), index


def check_arguments(args: argparse.Namespace) -> None:
    """Refuse bad arguments before loading anything."""
    from cachedrag.errors import ConfigError
    from cachedrag.retrieval.cli import require_faiss

    for flag, value in (("--max-questions", args.max_questions), ("--top-k", args.top_k),
                        ("--max-new-tokens", args.max_new_tokens)):
        if value < 1:
            raise ConfigError(f"{flag} must be >= 1 (got {value})")
    if args.tiny and args.model:
        raise ConfigError("--tiny uses its own random-weight model; drop --model")
    require_faiss()


def run(args: argparse.Namespace) -> int:
    from cachedrag.config import EngineConfig
    from cachedrag.engine import CachedEngine
    from cachedrag.model.runner import ModelRunner

    import tempfile

    check_arguments(args)
    t0 = time.perf_counter()
    tmp = tempfile.TemporaryDirectory(prefix="cachedrag-demo-")
    if args.tiny:
        runner, index = tiny_setup(tmp.name)
    else:
        runner = ModelRunner.from_pretrained(args.model)  # warmed up at load: the first question pays no one-time cost
        index = stdlib_index(runner.tokenizer, args.model or "default")
    nprobe = min(16, index.manifest.nlist)
    cached = CachedEngine(runner, config=EngineConfig(mode="cachedrag"))
    full = CachedEngine(runner, config=EngineConfig(mode="full"))
    questions = zipf_stream(list(STDLIB_TOPICS), args.max_questions, seed=args.seed)
    print(f"model, {len(index.chunks)} indexed chunks ready in {time.perf_counter() - t0:.1f}s\n")

    rows = []
    for i, question in enumerate(questions, 1):
        hits = index.search([question], k=args.top_k, nprobe=nprobe)[0]
        chunks = [h.chunk.text for h in hits]
        r = cached.generate(chunks, question, SYSTEM_PROMPT, max_new_tokens=args.max_new_tokens)
        base = None if args.no_baseline else full.generate(chunks, question, SYSTEM_PROMPT,
                                                           max_new_tokens=args.max_new_tokens)
        rows.append((r, base))
        print(f"[{i}] Q: {question}")
        print(f"    A: {r.text.strip()}")
        line = (f"    cachedrag TTFT {r.ttft_s * 1000:.0f} ms ({r.chunks_hit}/{r.chunks_hit + r.chunks_missed} chunks "
                f"from cache, {r.cached_tokens}/{r.prompt_tokens} prompt tokens not recomputed, "
                f"{r.computed_fraction:.0%} of prefill computed)")
        if base is not None:
            line += f" | full prefill TTFT {base.ttft_s * 1000:.0f} ms"
        print(line + "\n")

    _print_summary(rows, args.no_baseline)
    print("\nMore: `cachedrag bench ttft` compares all reuse modes; docs/ explains each part.")
    tmp.cleanup()
    return 0


def _print_summary(rows: list, no_baseline: bool) -> None:
    """Medians over the stream after its first quarter (the cache starts empty): TTFT and the
    whole answer time (TTFT + decode) of both systems, and TTFT split by whether every chunk
    came from the cache, so a reader sees what reuse buys and what a miss costs."""
    warm = rows[len(rows) // 4:] or rows
    hits = sum(r.chunks_hit for r, _ in warm)
    total = max(1, sum(r.chunks_hit + r.chunks_missed for r, _ in warm))
    print(f"summary: {len(warm)} questions after the first {len(rows) - len(warm)} (the stream repeats topics in "
          f"new words, so retrieved chunks recur); chunk hit rate {hits / total:.0%}")

    def med(values):
        values = list(values)
        return statistics.median(values) * 1000 if values else float("nan")

    print(f"  {'':<14} {'median TTFT':>12} {'median answer time':>19}")
    ttft, answer = med(r.ttft_s for r, _ in warm), med(r.total_s for r, _ in warm)
    print(f"  {'cachedrag':<14} {ttft:>9.0f} ms {answer:>16.0f} ms")
    if not no_baseline:
        base_ttft, base_answer = med(b.ttft_s for _, b in warm), med(b.total_s for _, b in warm)
        same = statistics.fmean(float(r.token_ids[:1] == b.token_ids[:1]) for r, b in warm)
        print(f"  {'full prefill':<14} {base_ttft:>9.0f} ms {base_answer:>16.0f} ms")
        print(f"  {'speedup':<14} {base_ttft / ttft:>11.2f}x {base_answer / answer:>18.2f}x   "
              f"same first token {same:.0%}")
    all_hit = [r.ttft_s for r, _ in warm if r.chunks_missed == 0]
    some_miss = [r.ttft_s for r, _ in warm if r.chunks_missed > 0]
    print(f"  cachedrag TTFT when every chunk was cached: {med(all_hit):.0f} ms ({len(all_hit)} questions); "
          f"with misses: {med(some_miss):.0f} ms ({len(some_miss)} questions)")
