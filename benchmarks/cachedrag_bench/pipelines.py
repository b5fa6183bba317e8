"""``cachedrag bench pipelines``: HyDE, SubQuestion, Iter-RetGen and FLARE end to end.

Owns: the pipeline benchmark (TeleRAG Fig. 10 analogue). Each pipeline answers the same
question stream in four configurations, measured in one run and interleaved per request
(the configuration order rotates from request to request) so machine noise hits all alike:

    a  baseline: plain transformers ``model.generate`` + plain Faiss CPU search over the
       disk-backed index, sequential (``TransformersGenerator`` + ``FaissDiskSearch``)
    b  a + lookahead prefetch (``LookaheadSearch``: prefetch(original question) during the LLM's
       query transformation, tiered search)
    c  a with the chunk-cache engine instead of plain generation (``CachedEngine``, mode cachedrag)
    d  b + c: both

Every request starts with the cluster files dropped from the page cache and an empty fast
tier; chunk caches persist across requests (one engine for c and one for d, each shared by
all pipelines: the shared chunk cache). Reported per pipeline and configuration: end-to-end
latency (median, mean, p95) and its breakdown (LLM time, retrieval time, the rest), prefetch
time and how much of it overlapped LLM work, cluster hit rate, chunk hit rate; per pipeline:
speedup of d over a, ROUGE-L of each configuration's answers against a's, and the cluster
overlap between the original question and the pipeline's transformed queries (nprobe
clusters, TeleRAG's definition). ``--json OUT`` writes it all.

Does not own: the pipelines (``cachedrag.pipelines``), retrieval or the engine.
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

from cachedrag_bench import write_json
from cachedrag_bench.metrics import rouge_l, summary

CONFIGS: dict[str, str] = {
    "a": "plain transformers generate + plain Faiss over disk, sequential",
    "b": "a + lookahead prefetch",
    "c": "a + chunk-cache reuse (CachedEngine, mode cachedrag)",
    "d": "lookahead prefetch + chunk-cache reuse",
}
ALL_PIPELINES = ("hyde", "subquestion", "iter_retgen", "flare")
DEFAULT_REQUESTS = 8
DEFAULT_WARMUP = 2
DEFAULT_MAX_NEW_TOKENS = 32
DEFAULT_TOP_K = 4
DEFAULT_DECOMPOSE_TOKENS = 48  # three short sub-questions as a JSON list
DEFAULT_CACHE_GB = 2.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--pipelines", default=",".join(ALL_PIPELINES), help="comma-separated subset of " + ",".join(ALL_PIPELINES))
    parser.add_argument("--configs", default="a,b,c,d", help="comma-separated subset of a,b,c,d (a is always run)")
    parser.add_argument("--requests", type=int, default=DEFAULT_REQUESTS, help="stream length (Zipf over the stdlib questions)")
    parser.add_argument("--warmup", type=int, default=DEFAULT_WARMUP, help="leading requests not counted")
    parser.add_argument("--max-new-tokens", type=int, default=DEFAULT_MAX_NEW_TOKENS,
                        help="cap of every generation step (answers, passages, sentences)")
    parser.add_argument("--decompose-tokens", type=int, default=DEFAULT_DECOMPOSE_TOKENS, help="cap of SubQuestion's decomposition")
    parser.add_argument("--top-k", type=int, default=DEFAULT_TOP_K, help="chunks per query")
    parser.add_argument("--nprobe", type=int, default=None, help="IVF clusters probed (default: SearchConfig's, at most nlist)")
    parser.add_argument("--corpus", help="corpus directory or JSONL (default: the stdlib docs corpus)")
    parser.add_argument("--questions", help="question file, one per line, used in order (default: Zipf stream)")
    parser.add_argument("--zipf", type=float, default=1.1, help="Zipf exponent of the generated stream")
    parser.add_argument("--seed", type=int, default=0, help="seed of the question stream")
    parser.add_argument("--index", help="use this built index directory (built with the model's tokenizer)")
    parser.add_argument("--index-out", help="keep the index built for the run in this directory")
    parser.add_argument("--chunk-tokens", type=int, default=None, help="LLM tokens per chunk when building the index")
    parser.add_argument("--model", default=None, help="HF model id or path (default: embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--cache-gb", type=float, default=DEFAULT_CACHE_GB, help="chunk-cache budget of each engine (c, d)")
    parser.add_argument("--baseline-tokenization", choices=("chat_template", "segments"), default="chat_template",
                        help="token ids of the baseline's prompts: the chat template over the whole text (plain use), "
                             "or the engine's per-segment tokenisation (isolates reuse effects)")
    parser.add_argument("--engine-linear", choices=("skinny", "reference"), default="skinny",
                        help="the engines' few-row matmul layout (c, d): skinny (default, faster CPU decode) or "
                             "reference (F.linear, as the transformers baseline; ablation)")
    parser.add_argument("--recompute-ratio", type=float, default=None,
                        help="the engines' fixed recompute ratio of reused chunks (default: Cache-Craft's per-chunk CFO counts)")
    parser.add_argument("--draft-tokens", type=int, default=None,
                        help="the engines' prompt-lookup draft length (c, d; default: LookupConfig's; 0 = no speculation)")
    parser.add_argument("--json", dest="json_out", help="write the results as JSON here")
    parser.add_argument("--quiet", action="store_true", help="no progress output")


def run(args: argparse.Namespace) -> int:
    from cachedrag.model.loader import load_model
    from cachedrag.model.runner import ModelRunner

    started = time.perf_counter()
    runner = ModelRunner(*load_model(args.model))
    with tempfile.TemporaryDirectory(prefix="cachedrag-bench-pipelines-") as tmp:
        index, build = _get_index(args, runner.tokenizer, Path(tmp) / "index")
        questions, source = _questions(args)
        results = measure(runner, index, questions, args)
    results["config"].update({"model": args.model or "SmolLM2-135M-Instruct", "questions": source, "index": build})
    results["wall_s"] = round(time.perf_counter() - started, 1)
    results["command"] = _command()
    print_table(results)
    if args.json_out:
        write_json(results, args.json_out)
    return 0


def measure(runner, index, questions: list[str], args: argparse.Namespace) -> dict:
    """Run every pipeline x configuration over ``questions`` (interleaved); JSON-ready results."""
    import torch

    from cachedrag.errors import ConfigError

    names = [p.strip() for p in args.pipelines.split(",") if p.strip()]
    configs = sorted({"a", *(c.strip() for c in args.configs.split(",") if c.strip())})
    if unknown := [p for p in names if p not in ALL_PIPELINES]:
        raise ConfigError(f"unknown pipelines {unknown}; choose from {', '.join(ALL_PIPELINES)}")
    if unknown := [c for c in configs if c not in CONFIGS]:
        raise ConfigError(f"unknown configurations {unknown}; choose from a,b,c,d")
    if not questions:
        raise ConfigError("no questions")
    warmup = max(0, min(len(questions) - 1, args.warmup))
    setup = _Setup(runner, index, configs, args)
    try:
        records = {p: {c: [] for c in configs} for p in names}
        order = [(i, q, p) for i, q in enumerate(questions) for p in names]
        for step, (i, question, name) in enumerate(order):
            rotation = configs[step % len(configs):] + configs[: step % len(configs)]
            for c in rotation:
                run = setup.run(name, c, question)
                records[name][c].append(run)
            if not args.quiet:
                a = records[name]["a"][-1]
                line = " ".join(f"{c}={records[name][c][-1].total_s:.2f}s" for c in configs)
                print(f"[{i + 1}/{len(questions)}] {name:<12} {line}  | a: {a.answer[:60]!r}", file=sys.stderr)
        results = {"config": _config(args, configs, warmup, len(questions), index, setup), "pipelines": {}}
        for name in names:
            results["pipelines"][name] = _pipeline_summary(records[name], warmup, setup)
        results["chunk_warming"] = setup.warming_stats()
        results["config"]["torch_threads"] = torch.get_num_threads()
        return results
    finally:
        setup.close()


class _Setup:
    """Generators, retrievers and pipeline objects of every configuration."""

    def __init__(self, runner, index, configs: list[str], args):
        from cachedrag.config import EngineConfig
        from cachedrag.engine import CachedEngine
        from cachedrag.kvcache.config import CacheConfig
        from cachedrag.model.lookup import LookupConfig
        from cachedrag.pipelines.generators import EngineGenerator, TransformersGenerator
        from cachedrag.pipelines.retrievers import FaissDiskSearch, LookaheadSearch, default_nprobe
        from cachedrag.retrieval.config import LookaheadConfig

        self.args = args
        self.index = index
        self.nprobe = args.nprobe or default_nprobe(index)
        baseline = TransformersGenerator(runner, tokenization=args.baseline_tokenization)
        if args.engine_linear == "reference":  # ablation: the engines' decode through F.linear, as transformers'
            from cachedrag.model.runner import ModelRunner

            runner = ModelRunner(runner.model, runner.tokenizer, skinny_linear=False, fast=False)
        lookup = LookupConfig() if args.draft_tokens is None else LookupConfig(max_draft=args.draft_tokens)
        cache = CacheConfig() if args.recompute_ratio is None else CacheConfig(recompute_ratio=args.recompute_ratio)
        engine_config = EngineConfig(mode="cachedrag", cache_bytes=int(args.cache_gb * 2**30), lookup=lookup, cache=cache)
        self.engines = {c: CachedEngine(runner, config=engine_config) for c in configs if c in ("c", "d")}
        self.generators = {c: (EngineGenerator(self.engines[c]) if c in self.engines else baseline) for c in configs}
        faiss_search = FaissDiskSearch(index, nprobe=self.nprobe)
        self.retrievers = {}
        for c in configs:
            if c in ("b", "d"):
                self.retrievers[c] = LookaheadSearch.from_index(index, device="cpu", config=LookaheadConfig(),
                                                                nprobe=self.nprobe, engine=self.engines.get(c))
            else:
                self.retrievers[c] = faiss_search
        self.bandwidth = None
        if any(c in ("b", "d") for c in configs):
            look = next(r for c, r in self.retrievers.items() if c in ("b", "d"))
            self.bandwidth = look.retriever.measure_bandwidth(n_clusters=index.ivf.nlist).bytes_per_s
        self.windows: dict[tuple[str, str], list[float]] = {}
        self._pipelines: dict[tuple[str, str], object] = {}

    def pipeline(self, name: str, config: str):
        key = (name, config)
        if key not in self._pipelines:
            from cachedrag.pipelines import pipeline_class

            self._pipelines[key] = pipeline_class(name)(self.generators[config], self.retrievers[config],
                                                        **_overrides(name, self.args))
        return self._pipelines[key]

    def run(self, name: str, config: str, question: str):
        retriever = self.retrievers[config]
        retriever.reset()
        retriever.drop_page_cache()
        if config in ("b", "d"):
            self._set_budget(name, config, retriever)
        run = self.pipeline(name, config).run(question)
        if run.prefetch and run.prefetch.get("window_ms") is not None:
            self.windows.setdefault((name, config), []).append(run.prefetch["window_ms"] / 1e3)
        return run

    def _set_budget(self, name: str, config: str, retriever) -> None:
        """TeleRAG's profile-guided budget: bandwidth x mean LLM time before the first search
        (of this pipeline's earlier requests; the default budget until there is one)."""
        from cachedrag.retrieval.policy import prefetch_budget

        windows = self.windows.get((name, config))
        if windows and self.bandwidth:
            budget = prefetch_budget(self.bandwidth, windows)
            retriever.retriever.config = retriever.retriever.config.model_copy(update={"budget_bytes": budget})

    def warming_stats(self) -> dict:
        return {c: dict(r.warmer.stats) for c, r in self.retrievers.items() if getattr(r, "warmer", None) is not None}

    def close(self) -> None:
        for c, r in self.retrievers.items():
            r.close()


def _overrides(name: str, args) -> dict:
    n = args.max_new_tokens
    common = {"top_k": args.top_k, "max_new_tokens": n}
    return {
        "hyde": {**common, "passage_tokens": n},
        "subquestion": {**common, "decompose_tokens": max(args.decompose_tokens, 1)},
        "iter_retgen": common,
        "flare": {**common, "sentence_tokens": n},
    }[name]


def _pipeline_summary(records: dict[str, list], warmup: int, setup: _Setup) -> dict:
    counted = {c: runs[warmup:] for c, runs in records.items()}
    base = counted["a"]
    out: dict = {}
    for c, runs in counted.items():
        lat = [r.total_s for r in runs]
        parts = [r.breakdown() for r in runs]
        row = {
            "latency_median_s": summary(lat)["median"], "latency_mean_s": summary(lat)["mean"],
            "latency_p95_s": summary(lat)["p95"],
            "llm_s": statistics.median(p["llm_s"] for p in parts),
            "retrieval_s": statistics.median(p["retrieval_s"] for p in parts),
            "search_ms": _median([p["search_ms"] for p in parts]),  # retrieval without query embedding
            "other_s": statistics.median(p["other_s"] for p in parts),
            "prefill_s": _median([p["prefill_s"] for p in parts]),  # LLM time to first tokens (sum per request)
            "decode_s": _median([p["decode_s"] for p in parts]),  # LLM time after them
            "llm_calls_mean": statistics.fmean(p["llm_calls"] for p in parts),
            "prompt_tokens_mean": statistics.fmean(p["prompt_tokens"] for p in parts),
            # prompt tokens computed at full depth; the rest were served from the chunk cache
            "computed_token_fraction": _ratio(sum(p["computed_tokens"] for p in parts), sum(p["prompt_tokens"] for p in parts)),
            "cached_token_fraction": _ratio(sum(p["cached_tokens"] for p in parts), sum(p["prompt_tokens"] for p in parts)),
            "chunk_hit_rate": _ratio(sum(p["chunks_hit"] for p in parts),
                                     sum(p["chunks_hit"] + p["chunks_missed"] for p in parts)),
            "rouge_l_vs_a": statistics.fmean(rouge_l(r.answer, b.answer) for r, b in zip(runs, base)),
        }
        caches = [s.cache for r in runs for s in r.steps if s.cache and "draft_tokens" in s.cache]
        if caches:  # the engine's speculative decoding: draft tokens verified, accepted, and all generated
            row["draft_tokens"] = sum(x["draft_tokens"] for x in caches)
            row["draft_accepted"] = sum(x["draft_accepted"] for x in caches)
            row["generated_tokens"] = sum(s.generated_tokens for r in runs for s in r.steps if s.cache)
        rates = [p["cluster_hit_rate"] for p in parts if p.get("cluster_hit_rate") is not None]
        row["cluster_hit_rate"] = statistics.fmean(rates) if rates and c in ("b", "d") else None
        prefetch = [r.prefetch for r in runs if r.prefetch and r.prefetch.get("elapsed_ms") is not None]
        if prefetch:
            row["prefetch_ms"] = statistics.median(p["elapsed_ms"] for p in prefetch)
            row["prefetch_hidden_ms"] = statistics.median(p["hidden_ms"] for p in prefetch)
            row["prefetch_overlap"] = statistics.fmean(p["overlap"] for p in prefetch)
            row["prefetch_window_ms"] = statistics.median(p["window_ms"] for p in prefetch)
        out[c] = row
    for c in counted:
        out[c]["speedup_vs_a"] = _ratio(out["a"]["latency_median_s"], out[c]["latency_median_s"])
    out["speedup_d_vs_a"] = out["d"]["speedup_vs_a"] if "d" in counted else None
    out["rouge_l_vs_a"] = out["d"]["rouge_l_vs_a"] if "d" in counted else None
    out["cluster_overlap"] = cluster_overlap(setup.index, counted.get("d") or counted["a"], setup.nprobe)
    out["n_requests"] = len(base)
    out["example"] = {"question": base[0].question, **{c: counted[c][0].answer for c in counted}} if base else None
    return out


def cluster_overlap(index, runs: list, nprobe: int) -> float | None:
    """Mean fraction of a transformed query's ``nprobe`` clusters that the original question's
    ``nprobe`` clusters also hold (queries equal to the question are skipped)."""
    pairs = [(r.question, q) for r in runs for s in r.steps_of("retrieval") for q in s.input if q != r.question]
    if not pairs:
        return None
    originals = sorted({o for o, _ in pairs})
    row = {o: i for i, o in enumerate(originals)}
    probe_o = index.ivf.assign(index.embed(originals), nprobe).tolist()  # [Q, nprobe]
    probe_t = index.ivf.assign(index.embed([t for _, t in pairs]), nprobe).tolist()  # [P, nprobe]
    fractions = [len(set(probe_o[row[o]]) & set(t)) / nprobe for (o, _), t in zip(pairs, probe_t)]
    return statistics.fmean(fractions)


def _command() -> str | None:
    argv = sys.argv[1:]
    if argv[:2] != ["bench", "pipelines"]:
        return None
    return "cachedrag " + " ".join(shlex.quote(a) for a in argv)


def _median(values: list) -> float | None:
    return statistics.median(values) if values and all(v is not None for v in values) else None


def _ratio(num: float, den: float) -> float | None:
    return num / den if den else None


def _config(args, configs, warmup, n, index, setup: _Setup) -> dict:
    return {
        "pipelines": args.pipelines, "configs": {c: CONFIGS[c] for c in configs}, "n_stream": n, "warmup": warmup,
        "max_new_tokens": args.max_new_tokens, "decompose_tokens": args.decompose_tokens, "top_k": args.top_k,
        "nprobe": setup.nprobe, "nlist": index.ivf.nlist, "n_chunks": index.manifest.n_chunks,
        "chunk_tokens": index.manifest.chunk.chunk_tokens, "cache_gb": args.cache_gb,
        "baseline_tokenization": args.baseline_tokenization, "engine_linear": args.engine_linear, "recompute_ratio": args.recompute_ratio,
        "draft_tokens": setup.engines[next(iter(setup.engines))].config.lookup.max_draft if setup.engines else None,
        "bandwidth_bytes_per_s": setup.bandwidth,
        "index_bytes": int(sum(index.ivf.cluster_nbytes())),
    }


def _questions(args) -> tuple[list[str], str]:
    from cachedrag_bench.workload import zipf_stream
    from cachedrag.corpus import STDLIB_QUESTIONS, load_questions

    if args.questions:
        return load_questions(args.questions), str(args.questions)
    return (zipf_stream(list(STDLIB_QUESTIONS), args.requests, args.zipf, args.seed),
            f"zipf(s={args.zipf}, seed={args.seed}) stream of {args.requests} over {len(STDLIB_QUESTIONS)} stdlib questions")


def _get_index(args, tokenizer, tmp_out: Path):
    from cachedrag.corpus import load_corpus, stdlib_corpus
    from cachedrag.retrieval.config import ChunkConfig, RetrievalConfig, make_config
    from cachedrag.retrieval.embedder import Embedder
    from cachedrag.retrieval.index import build_index, load_index

    embedder = Embedder()
    if args.index:
        index = load_index(args.index, embedder=embedder)
        index.check_tokenizer(tokenizer)
        return index, {"source": "loaded", "path": str(args.index)}
    docs = load_corpus(args.corpus) if args.corpus else stdlib_corpus()
    config = RetrievalConfig(chunk=make_config(ChunkConfig, chunk_tokens=args.chunk_tokens))
    t0 = time.perf_counter()
    index = build_index(docs, tokenizer, embedder, config, out=args.index_out or tmp_out, progress=not args.quiet)
    return index, {"source": "built", "corpus": args.corpus or "stdlib_corpus()", "build_s": round(time.perf_counter() - t0, 1)}


def print_table(results: dict) -> None:
    """The TeleRAG Fig. 10-style breakdown: per pipeline and configuration."""
    cfg = results["config"]
    print(f"\npipelines bench: {cfg['n_stream'] - cfg['warmup']} counted requests (+{cfg['warmup']} warm-up), "
          f"top-k {cfg['top_k']}, nprobe {cfg['nprobe']}/{cfg['nlist']}, max_new_tokens {cfg['max_new_tokens']}, "
          f"{cfg['n_chunks']} chunks of {cfg['chunk_tokens']} tokens")
    for c, text in cfg["configs"].items():
        print(f"  ({c}) {text}")
    head = ("pipeline", "cfg", "latency", "llm", "prefill", "decode", "retrieval", "search_ms", "x_vs_a", "rougeL",
            "calls", "chunk_hit", "clus_hit", "prefetch", "overlap")
    print("  ".join(f"{h:>9}" for h in head))
    for name, p in results["pipelines"].items():
        for c in cfg["configs"]:
            r = p[c]
            vals = [name if c == "a" else "", c, _f(r["latency_median_s"]), _f(r["llm_s"]), _f(r.get("prefill_s")),
                    _f(r.get("decode_s")), _f(r["retrieval_s"], 3), _f(r.get("search_ms")), _f(r["speedup_vs_a"]),
                    _f(r["rouge_l_vs_a"]), _f(r["llm_calls_mean"], 1), _f(r["chunk_hit_rate"]), _f(r["cluster_hit_rate"]),
                    _f(r.get("prefetch_ms"), 1) + ("ms" if r.get("prefetch_ms") is not None else ""),
                    _f(r.get("prefetch_overlap"))]
            print("  ".join(f"{v:>9}" for v in vals))
        overlap = p["cluster_overlap"]
        print(f"{'':>9}  speedup d vs a {_f(p['speedup_d_vs_a'])}x, ROUGE-L(d, a) {_f(p['rouge_l_vs_a'])}, "
              f"cluster overlap {_f(overlap)}")


def _f(value, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"
