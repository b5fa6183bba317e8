"""``cachedrag bench retrieval``: IVF recall, cluster overlap, lookahead search latency.

Owns: the retrieval benchmark, measured side by side in one run:
recall@10 of the IVF index against exact search at several nprobe (and Faiss's own IVF at
the same nprobe); cluster overlap between original and transformed queries (TeleRAG
Table 1 analogue: mean fraction of the transformed query's probed clusters that the
original query also probes, and that the budgeted prefetch actually covered); search
latency of plain Faiss in RAM (baseline), of the disk-backed cluster store cold (page cache
dropped, nothing prefetched) and of the lookahead search after a prefetch window. Prints a
summary and writes JSON (``--json OUT``). ``--scale`` runs ``retrieval_scale`` instead (a 1M-vector
on-disk index, lookahead and speculative pipelining end to end). Does not own: any retrieval logic.

Without ``--transformed`` the transformed query is built deterministically: the question plus
the first sentence of its top exact-search chunk (a stand-in for a HyDE rewrite); a pipeline's
real rewrites can be passed as a file, one per line, aligned with the questions.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from cachedrag.retrieval.config import IndexConfig, LookaheadConfig, SearchConfig
from cachedrag_bench import write_json
from cachedrag_bench.retrieval_scale import add_arguments as add_scale_arguments
from cachedrag_bench.retrieval_scale import print_summary, run_scale
from cachedrag_bench.rewrite import TRANSFORM_NOTE, default_transformations

_INDEX = IndexConfig()
_SEARCH = SearchConfig()
DEFAULT_NPROBE_LIST = "1,2,4,8,16,32"
DEFAULT_WINDOW_MS = 20.0
DEFAULT_REPEATS = 3
DEFAULT_BUDGET_FRACTIONS = "0.125,0.25,0.5"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--corpus", help="corpus directory or JSONL (default: the stdlib docs corpus)")
    parser.add_argument("--questions", help="question file, one per line (default: STDLIB_QUESTIONS)")
    parser.add_argument("--transformed", help="transformed queries, one per line aligned with the questions")
    parser.add_argument("--index", help="use this built index directory instead of building one from --corpus")
    parser.add_argument("--index-out", help="keep the index built for the run in this directory")
    parser.add_argument("--nlist", type=int, help=f"IVF clusters (default {_INDEX.nlist})")
    parser.add_argument("--nprobe", type=int, default=_SEARCH.nprobe, help=f"nprobe of the latency runs (default {_SEARCH.nprobe})")
    parser.add_argument("--nprobe-list", default=DEFAULT_NPROBE_LIST, help="nprobe values of the recall table")
    parser.add_argument("--chunk-tokens", type=int, help="LLM tokens per chunk")
    parser.add_argument("--overlap", type=int, help="chunk overlap in tokens")
    parser.add_argument("--tokenizer", help="LLM tokenizer name or path (default: the default model's)")
    parser.add_argument("--embedder", help="sentence-transformers name or path (default: all-MiniLM-L6-v2)")
    parser.add_argument("-k", type=int, default=_SEARCH.k, help="results per query (recall@k)")
    parser.add_argument(
        "--prefetch-window-ms", type=float, default=DEFAULT_WINDOW_MS,
        help="simulated pre-retrieval LLM time between prefetch start and search (also sizes the budget)",
    )
    parser.add_argument("--budget-bytes", type=int, help="prefetch budget (default: measured bandwidth x window)")
    parser.add_argument("--budget-fractions", default=DEFAULT_BUDGET_FRACTIONS,
                        help="extra lookahead runs with budgets of these fractions of the index (empty: none)")
    parser.add_argument("--repeats", type=int, default=DEFAULT_REPEATS, help="latency repetitions per query")
    parser.add_argument("--json", dest="json_out", help="write the results as JSON here")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    add_scale_arguments(parser)


def run(args: argparse.Namespace) -> int:
    if args.scale:
        results = run_scale(args)
        print_summary(results)
        if args.json_out:
            write_json(results, args.json_out)
        return 0
    results = run_bench(args)
    _print_summary(results)
    if args.json_out:
        write_json(results, args.json_out)
    return 0


def run_bench(args: argparse.Namespace) -> dict:
    """All measurements of one run, as a JSON-ready dict."""
    from cachedrag.corpus import STDLIB_QUESTIONS, load_questions

    questions = load_questions(args.questions) if args.questions else list(STDLIB_QUESTIONS)
    with tempfile.TemporaryDirectory(prefix="cachedrag-bench-") as tmp:
        index, build = _get_index(args, Path(tmp) / "index")
        return _measure(args, index, questions, build)


def _get_index(args, tmp_out: Path):
    from cachedrag.corpus import load_corpus, stdlib_corpus
    from cachedrag.errors import ConfigError, ModelNotFoundError
    from cachedrag.retrieval.chunker import load_tokenizer
    from cachedrag.retrieval.config import ChunkConfig, RetrievalConfig, make_config
    from cachedrag.retrieval.embedder import Embedder, default_embedder_path
    from cachedrag.retrieval.index import build_index, load_index

    embedder = Embedder(model=args.embedder) if args.embedder else Embedder()
    if args.index:
        return load_index(args.index, embedder=embedder), {"source": "loaded", "path": str(args.index)}
    build: dict = {"source": "built", "corpus": args.corpus or "stdlib_corpus()"}
    try:
        tokenizer = load_tokenizer(args.tokenizer)
    except (ConfigError, ModelNotFoundError) as exc:
        if args.tokenizer:
            raise
        tokenizer = load_tokenizer(default_embedder_path())
        build["tokenizer_fallback"] = f"default LLM tokenizer unavailable ({exc}); chunked with the embedder's tokenizer"
        print(f"note: {build['tokenizer_fallback']}")
    docs = load_corpus(args.corpus) if args.corpus else stdlib_corpus()
    config = RetrievalConfig(
        chunk=make_config(ChunkConfig, chunk_tokens=args.chunk_tokens, overlap=args.overlap),
        index=make_config(IndexConfig, nlist=args.nlist),
    )
    t0 = time.perf_counter()
    index = build_index(docs, tokenizer, embedder, config, out=args.index_out or tmp_out,
                        progress=False if args.quiet else None)
    build["build_s"] = round(time.perf_counter() - t0, 2)
    return index, build


def _measure(args, index, questions: list[str], build: dict) -> dict:
    import numpy as np
    import torch

    from cachedrag.errors import ConfigError
    from cachedrag.retrieval.ivf import check_nprobe

    ivf, k = index.ivf, args.k
    check_nprobe(args.nprobe, ivf.nlist)
    if args.transformed:
        from cachedrag.corpus import load_questions

        transformed = load_questions(args.transformed)
        if len(transformed) != len(questions):
            raise ConfigError(f"{len(transformed)} transformed queries for {len(questions)} questions")
        transform_note = f"from {args.transformed}"
    else:
        transformed, transform_note = default_transformations(index, questions), TRANSFORM_NOTE
    q_orig, q_trans = index.embed(questions), index.embed(transformed)  # [Q, d] each

    nprobes = sorted({int(n) for n in args.nprobe_list.split(",") if n.strip()} | {args.nprobe})
    nprobes = [n for n in nprobes if 1 <= n <= ivf.nlist]
    table = _recall_table(index, q_orig, q_trans, nprobes, k)
    at_default = next(row for row in table if row["nprobe"] == args.nprobe)
    latency = _latency(args, index, q_orig, q_trans)
    return {
        "recall_at_10": at_default["recall_original"],
        "recall_at_10_transformed": at_default["recall_transformed"],
        "cluster_overlap": at_default["cluster_overlap"],
        "prefetch_hit_rate": latency.pop("prefetch_hit_rate"),
        "faiss_search_ms": latency.pop("faiss_search_ms"),
        "cold_search_ms": latency.pop("cold_search_ms"),
        "lookahead_search_ms": latency.pop("lookahead_search_ms"),
        "lookahead_speedup": latency.pop("lookahead_speedup"),
        "prefetch_window_ms": args.prefetch_window_ms,
        **latency,
        "recall_table": table,
        "k": k,
        "nprobe": args.nprobe,
        "transformation": transform_note,
        "n_questions": len(questions),
        "index": {
            "n_chunks": index.manifest.n_chunks,
            "n_docs": index.manifest.n_docs,
            "nlist": ivf.nlist,
            "dim": ivf.dim,
            "metric": ivf.metric,
            "cluster_sizes": {"min": min(ivf.cluster_sizes()), "max": max(ivf.cluster_sizes()),
                              "mean": float(np.mean(ivf.cluster_sizes()))},
            "index_bytes": int(sum(ivf.cluster_nbytes())),
            "chunk": index.manifest.chunk.model_dump(),
            "embedder": index.manifest.embedder,
            "tokenizer": index.manifest.tokenizer.get("name"),
            **build,
        },
        "config": {"repeats": args.repeats, "torch_threads": torch.get_num_threads()},
    }


def _recall(found, exact) -> float:
    """Mean fraction of each row's exact ids (padding dropped) that ``found`` also has."""
    fractions = []
    for f_row, e_row in zip(found.tolist(), exact.tolist()):
        truth = {i for i in e_row if i >= 0}
        fractions.append(len(truth & set(f_row)) / len(truth) if truth else 1.0)
    return sum(fractions) / len(fractions)


def _recall_table(index, q_orig, q_trans, nprobes: list[int], k: int) -> list[dict]:
    import torch

    ivf = index.ivf
    faiss_index = ivf.to_faiss()
    _, exact_o = ivf.exact_search(q_orig, k)  # [Q, k]
    _, exact_t = ivf.exact_search(q_trans, k)
    rows = []
    for nprobe in nprobes:
        _, ids_o = ivf.search(q_orig, k, nprobe)  # [Q, k]
        _, ids_t = ivf.search(q_trans, k, nprobe)
        faiss_index.nprobe = nprobe
        _, faiss_o = faiss_index.search(q_orig.numpy(), k)  # [Q, k]
        probe_o, probe_t = ivf.assign(q_orig, nprobe), ivf.assign(q_trans, nprobe)  # [Q, nprobe]
        overlap = [len(set(a) & set(b)) / nprobe for a, b in zip(probe_o.tolist(), probe_t.tolist())]
        rows.append({
            "nprobe": nprobe,
            "recall_original": round(_recall(ids_o, exact_o), 4),
            "recall_transformed": round(_recall(ids_t, exact_t), 4),
            "faiss_recall_original": round(_recall(torch.from_numpy(faiss_o), exact_o), 4),
            "ivf_equals_faiss": bool((ids_o.numpy() == faiss_o).all()),
            "cluster_overlap": round(sum(overlap) / len(overlap), 4),
        })
    return rows


def _latency(args, index, q_orig, q_trans) -> dict:
    """Faiss in RAM vs disk-backed store cold vs lookahead after a prefetch window, interleaved."""
    from cachedrag.retrieval.lookahead import LookaheadRetriever
    from cachedrag.retrieval.policy import prefetch_budget

    ivf, k, nprobe = index.ivf, args.k, args.nprobe
    window_s = args.prefetch_window_ms / 1e3
    faiss_index = ivf.to_faiss()
    faiss_index.nprobe = nprobe
    retriever = LookaheadRetriever.from_index(index, device="cpu", config=LookaheadConfig(candidate_chunks=0),
                                              search_config=SearchConfig(k=k, nprobe=nprobe))
    try:
        bandwidth = retriever.measure_bandwidth(n_clusters=ivf.nlist)
        budget = args.budget_bytes if args.budget_bytes is not None else prefetch_budget(bandwidth.bytes_per_s, [window_s])
        q_t_np = q_trans.numpy()
        faiss_index.search(q_t_np[:1], k)  # warm-up
        retriever.search(q_trans[:1])
        faiss_ms, cold_ms, cold_no_window_ms = [], [], []
        main = _LookaheadRun(budget)
        for _ in range(args.repeats):
            for i in range(q_trans.shape[0]):
                t0 = time.perf_counter()
                faiss_index.search(q_t_np[i : i + 1], k)
                faiss_ms.append((time.perf_counter() - t0) * 1e3)
                cold_no_window_ms.append(_cold_search(retriever, q_trans[i]).total_ms)
                cold = _cold_search(retriever, q_trans[i], window_s)
                cold_ms.append(cold.total_ms)
                main.measure(retriever, q_orig[i], q_trans[i], window_s, cold)
        index_bytes = sum(ivf.cluster_nbytes())
        sweep = []
        for fraction in _fractions(args.budget_fractions):
            run = _LookaheadRun(int(fraction * index_bytes))
            for _ in range(args.repeats):
                for i in range(q_trans.shape[0]):
                    cold = _cold_search(retriever, q_trans[i], window_s)
                    run.measure(retriever, q_orig[i], q_trans[i], window_s, cold)
            sweep.append({"budget_fraction_of_index": fraction, **run.summary()})
    finally:
        retriever.close()
    med = statistics.median
    summary = main.summary()
    return {
        "faiss_search_ms": round(med(faiss_ms), 4),
        "cold_search_ms": round(med(cold_ms), 4),
        "lookahead_search_ms": summary["lookahead_search_ms"],
        "lookahead_speedup": round(med(cold_ms) / summary["lookahead_search_ms"], 2),
        "prefetch_hit_rate": summary["prefetch_hit_rate"],
        "prefetch_coverage": summary["prefetch_coverage"],
        "cold_search_ms_mean": round(statistics.fmean(cold_ms), 4),
        "cold_search_ms_no_window": round(med(cold_no_window_ms), 4),
        "lookahead_search_ms_mean": summary["lookahead_search_ms_mean"],
        "prefetch_elapsed_ms": summary["prefetch_elapsed_ms"],
        "prefetch_copied_bytes": summary["prefetch_copied_bytes"],
        "prefetch_budget_bytes": int(budget),
        "bandwidth_bytes_per_s": round(bandwidth.bytes_per_s),
        "lookahead_equals_cold": summary["lookahead_equals_cold"],
        "latency_samples": len(cold_ms),
        "budget_sweep": sweep,
    }


def _fractions(text: str) -> list[float]:
    return [float(f) for f in text.split(",") if f.strip()]


def _cold_search(retriever, q, window_s: float = 0.0):
    """Search with an empty fast tier and the cluster files dropped from the page cache.

    With ``window_s`` the search starts after the same idle window the lookahead run waits
    (without a prefetch), so the two differ only by the prefetch: an idle machine answers
    I/O a little slower than a busy one, and that must not count for or against lookahead.
    """
    retriever.clear_fast_tier()
    retriever.slow.drop_page_cache()
    time.sleep(window_s)
    return retriever.search(q)


class _LookaheadRun:
    """Lookahead searches at one budget: prefetch(original), wait the window, search(transformed)."""

    def __init__(self, budget: int):
        self.budget = budget
        self.search_ms, self.hit_rates, self.covered, self.prefetch_ms, self.copied = [], [], [], [], []
        self.cold_ms = []  # the cold search of the same query just before (interleaved baseline)
        self.mismatches = 0

    def measure(self, retriever, q_orig, q_trans, window_s: float, cold) -> None:
        import torch

        retriever.config = retriever.config.model_copy(update={"budget_bytes": self.budget})
        retriever.clear_fast_tier()
        retriever.slow.drop_page_cache()
        started = time.perf_counter()
        handle = retriever.prefetch(q_orig)
        time.sleep(max(0.0, window_s - (time.perf_counter() - started)))
        look = retriever.search(q_trans)
        report = handle.wait()
        self.search_ms.append(look.total_ms)
        self.cold_ms.append(cold.total_ms)
        self.hit_rates.append(look.hit_rate)
        self.prefetch_ms.append(report.elapsed_ms)
        self.copied.append(report.copied_bytes)
        planned, probed = set(report.clusters), look.probe[0].tolist()
        self.covered.append(sum(c in planned for c in probed) / len(probed))
        self.mismatches += int(not torch.equal(look.ids, cold.ids))

    def summary(self) -> dict:
        med = statistics.median
        return {
            "budget_bytes": self.budget,
            "lookahead_search_ms": round(med(self.search_ms), 4),
            "lookahead_search_ms_mean": round(statistics.fmean(self.search_ms), 4),
            "cold_search_ms": round(med(self.cold_ms), 4),
            "speedup_vs_cold": round(med(self.cold_ms) / med(self.search_ms), 2),
            "prefetch_hit_rate": round(statistics.fmean(self.hit_rates), 4),
            "prefetch_coverage": round(statistics.fmean(self.covered), 4),
            "prefetch_elapsed_ms": round(med(self.prefetch_ms), 3),
            "prefetch_copied_bytes": int(med(self.copied)),
            "lookahead_equals_cold": self.mismatches == 0,
        }


def _print_summary(r: dict) -> None:
    idx = r["index"]
    print(f"retrieval bench: {idx['n_chunks']} chunks, nlist={idx['nlist']}, d={idx['dim']}, metric={idx['metric']}, "
          f"{r['n_questions']} questions, k={r['k']}")
    print(f"transformed queries: {r['transformation']}")
    print(f"{'nprobe':>7} {'recall@k':>9} {'recall@k(tr)':>13} {'faiss':>7} {'==faiss':>8} {'overlap':>8}")
    for row in r["recall_table"]:
        print(f"{row['nprobe']:>7} {row['recall_original']:>9.3f} {row['recall_transformed']:>13.3f} "
              f"{row['faiss_recall_original']:>7.3f} {str(row['ivf_equals_faiss']):>8} {row['cluster_overlap']:>8.3f}")
    print(f"at nprobe={r['nprobe']}: recall@{r['k']} {r['recall_at_10']:.3f} of exact, cluster overlap {r['cluster_overlap']:.3f}")
    print(f"search latency (median of {r['latency_samples']}): faiss in RAM {r['faiss_search_ms']:.3f} ms | "
          f"disk store cold {r['cold_search_ms']:.3f} ms ({r['cold_search_ms_no_window']:.3f} ms without the idle "
          f"window) | lookahead after {r['prefetch_window_ms']:.0f} ms window {r['lookahead_search_ms']:.3f} ms "
          f"-> {r['lookahead_speedup']:.2f}x")
    print(f"prefetch: budget {r['prefetch_budget_bytes']} B (bandwidth {r['bandwidth_bytes_per_s'] / 1e6:.1f} MB/s x window), "
          f"copied {r['prefetch_copied_bytes']} B in {r['prefetch_elapsed_ms']:.2f} ms, hit rate {r['prefetch_hit_rate']:.3f}, "
          f"results equal cold search: {r['lookahead_equals_cold']}")
    for row in r["budget_sweep"]:
        print(f"  budget {row['budget_fraction_of_index']:>5.3f} of index ({row['budget_bytes']} B): lookahead "
              f"{row['lookahead_search_ms']:.3f} ms vs cold {row['cold_search_ms']:.3f} ms ({row['speedup_vs_cold']:.2f}x), "
              f"hit rate {row['prefetch_hit_rate']:.3f}, equal to cold: {row['lookahead_equals_cold']}")
