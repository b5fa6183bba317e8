"""``cachedrag demo``: RAG over the Python stdlib docs with chunk-cache reuse, against full prefill
and prefix caching.

Owns: the demo command only. It loads the embedded default model, builds (once, then cached
under the cachedrag home) an IVF index of the stdlib documentation, warms the chunk cache with
earlier users' questions (untimed), then answers a Zipf stream of questions, asked in different
words as users do: with chunk reuse, and with full prefill and prefix caching on the same
prompts, printing answers, time to first token and cache hits, then a summary that leads with
the steady state's median TTFT of each.
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import tempfile
import time

from cachedrag.corpus import STDLIB_TOPICS, stdlib_corpus, zipf_stream

SYSTEM_PROMPT = (
    "You are a helpful assistant. Answer the question using the Python documentation excerpts "
    "given by the user. Be brief."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-questions", type=int, default=12, help="timed questions in the stream (default 12)")
    parser.add_argument("--warmup", type=int, default=8,
                        help="earlier users' questions that fill the cache before the timed stream (default 8)")
    parser.add_argument("--top-k", type=int, default=5, help="chunks retrieved per question (default 5)")
    parser.add_argument("--max-new-tokens", type=int, default=40, help="answer length bound (default 40)")
    parser.add_argument("--model", default=None, help="HF model id, path or .gguf file (default: embedded SmolLM2-135M-Instruct)")
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
    if args.warmup < 0:
        raise ConfigError(f"--warmup must be >= 0 (got {args.warmup})")
    if args.tiny and args.model:
        raise ConfigError("--tiny uses its own random-weight model; drop --model")
    require_faiss()


def run(args: argparse.Namespace) -> int:
    check_arguments(args)
    first_run = not args.tiny and not _prepared(args.model)
    _print_intro(args, first_run)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="cachedrag-demo-") as tmp:
        runner, index = _setup(args, tmp)
        print(f"model and index of {len(index.chunks)} chunks ready in {time.perf_counter() - t0:.1f}s\n")
        systems = _systems(runner, args.no_baseline)
        ask = _Asker(index, args)
        _warm_up(ask, systems, args)
        rows = _stream(ask, systems, args)
    _print_summary(rows, args.no_baseline)
    print("\nMore: `cachedrag bench ttft` compares every reuse mode and fidelity level; docs/ explains each part.")
    return 0


# measured on an idle 2-core CPU with a fresh CACHEDRAG_HOME: 3 min 30 s in all, 100 s of it preparing
_FIRST_RUN = "about 3.5 minutes in all, 1.5 of them converting the model and building the index"


def _prepared(model: str | None) -> bool:
    """Whether an earlier run left the converted model and the stdlib index in the cachedrag home."""
    from cachedrag.paths import cache_home

    home = cache_home()
    return (home / "indexes").is_dir() and any((home / "indexes").glob("stdlib-*/manifest.json")) and (
        model is not None or (home / "models").is_dir() and any((home / "models").iterdir()))


def _print_intro(args: argparse.Namespace, first_run: bool) -> None:
    print("cachedrag demo: RAG over the Python standard library's documentation with the embedded "
          "SmolLM2-135M model.\nA warm-up pass fills the chunk cache as earlier users would; then a stream of "
          "questions in new words\nis answered with chunk reuse and timed against full prefill and prefix caching.")
    if first_run:
        print(f"First run: {_FIRST_RUN} (once; later runs start in seconds and take about 2 minutes).")
    print()


def _setup(args: argparse.Namespace, tmp: str):
    from cachedrag.model.runner import ModelRunner

    if args.tiny:
        return tiny_setup(tmp)
    runner = ModelRunner.from_pretrained(args.model)  # warmed up at load: the first question pays no one-time cost
    return runner, stdlib_index(runner.tokenizer, args.model or "default")


def _systems(runner, no_baseline: bool) -> dict:
    """One engine (and so one chunk cache) per system: chunk reuse, and the two baselines."""
    from cachedrag.config import EngineConfig
    from cachedrag.engine import CachedEngine

    modes = {"cachedrag": "cachedrag"} if no_baseline else {"cachedrag": "cachedrag", "prefix": "prefix",
                                                            "full": "full"}
    return {name: CachedEngine(runner, config=EngineConfig(mode=mode)) for name, mode in modes.items()}


class _Asker:
    """Retrieves a question's chunks once and asks any engine with them."""

    def __init__(self, index, args: argparse.Namespace):
        self.index, self.args = index, args
        self.nprobe = min(16, index.manifest.nlist)

    def chunks(self, question: str) -> list[str]:
        hits = self.index.search([question], k=self.args.top_k, nprobe=self.nprobe)[0]
        return [h.chunk.text for h in hits]

    def __call__(self, engine, chunks: list[str], question: str, max_new_tokens: int):
        return engine.generate(chunks, question, SYSTEM_PROMPT, max_new_tokens=max_new_tokens)


def _warm_up(ask: _Asker, systems: dict, args: argparse.Namespace) -> None:
    """Earlier users' questions (another draw of the same topics): each caching system prefills them
    once, storing their chunks; nothing is timed."""
    questions = zipf_stream(list(STDLIB_TOPICS), args.warmup, seed=args.seed + 1000)
    caching = [e for name, e in systems.items() if name != "full"]
    for question in _progress(questions, "warm-up"):
        chunks = ask.chunks(question)
        for engine in caching:
            ask(engine, chunks, question, max_new_tokens=1)


def _progress(items: list, desc: str):
    from tqdm.auto import tqdm

    return tqdm(items, desc=desc, unit="question", leave=False) if items else items


def _stream(ask: _Asker, systems: dict, args: argparse.Namespace) -> list:
    """The timed stream: chunk reuse answers in full; the baselines prefill the same prompt (their
    first token is what TTFT and the first-token check need)."""
    rows = []
    for i, question in enumerate(zipf_stream(list(STDLIB_TOPICS), args.max_questions, seed=args.seed), 1):
        chunks = ask.chunks(question)
        r = ask(systems["cachedrag"], chunks, question, args.max_new_tokens)
        base = {name: ask(e, chunks, question, 1) for name, e in systems.items() if name != "cachedrag"}
        rows.append((r, base.get("full"), base.get("prefix")))
        print(f"[{i}] Q: {question}")
        print(f"    A: {r.text.strip()}")
        line = (f"    TTFT {r.ttft_s * 1000:.0f} ms with reuse ({r.chunks_hit}/{r.chunks_hit + r.chunks_missed} chunks "
                f"from cache, {r.computed_fraction:.0%} of the prompt computed)")
        if base:
            line += (f" | full prefill {base['full'].ttft_s * 1000:.0f} ms | prefix caching "
                     f"{base['prefix'].ttft_s * 1000:.0f} ms")
        print(line + "\n")
    return rows


def _med_ms(values) -> float:
    values = list(values)
    return statistics.median(values) * 1000 if values else float("nan")


def _print_summary(rows: list, no_baseline: bool) -> None:
    """Leads with the median TTFT served by chunk reuse against full prefill and prefix caching over
    the timed stream, with the share of retrieved chunks that were cached; then TTFT split by
    whether every chunk was cached, and whether the first token matched full prefill's."""
    hits = sum(r.chunks_hit for r, *_ in rows)
    total = max(1, sum(r.chunks_hit + r.chunks_missed for r, *_ in rows))
    ttft = _med_ms(r.ttft_s for r, *_ in rows)
    print(f"summary over {len(rows)} questions after the warm-up: {hits / total:.0%} of retrieved chunks were "
          "already cached")
    print(f"  {'':<26} {'median TTFT':>12}" + ("" if no_baseline else f" {'vs full prefill':>16}"))
    if no_baseline:
        print(f"  {'cachedrag (chunk reuse)':<26} {ttft:>9.0f} ms")
    else:
        full = _med_ms(b.ttft_s for _, b, _ in rows)
        prefix = _med_ms(p.ttft_s for *_, p in rows)
        for name, value in (("cachedrag (chunk reuse)", ttft), ("prefix caching", prefix), ("full prefill", full)):
            print(f"  {name:<26} {value:>9.0f} ms {full / value:>15.2f}x")
    all_hit = [r.ttft_s for r, *_ in rows if r.chunks_missed == 0]
    some_miss = [r.ttft_s for r, *_ in rows if r.chunks_missed > 0]
    print(f"  chunk reuse when every chunk was cached: {_med_ms(all_hit):.0f} ms ({len(all_hit)} questions); "
          f"with misses: {_med_ms(some_miss):.0f} ms ({len(some_miss)} questions)")
    if not no_baseline:
        same = statistics.fmean(float(r.token_ids[:1] == b.token_ids[:1]) for r, b, _ in rows)
        print(f"  first token equal to full prefill's: {same:.0%}")
    print(f"  whole answer with chunk reuse (TTFT + decode): median {_med_ms(r.total_s for r, *_ in rows):.0f} ms")
