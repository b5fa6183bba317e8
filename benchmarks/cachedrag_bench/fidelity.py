"""``cachedrag bench fidelity``: how far chunk reuse moves answers from full prefill, per token choice.

Owns: the fidelity suite. Per corpus (the embedded stdlib docs with the gold QA set, and the GNU
info manuals) and per stream seed, each request (a question, its top-k chunks; for gold items the
chunk holding the answer is always among them) runs on a fresh cache:

1. reference: ``full`` prefill in the retrieved order, greedy answer ``A`` (``max_new_tokens``),
   and its teacher-forced logits over ``A`` (``CachedEngine.score``);
2. order noise + warm-up: the same chunks in another random order (first chunk changed), computed
   from scratch (exact full prefill of that order) while it stores every chunk's KV: its answer and
   teacher-forced logits over ``A`` against the reference are the noise floor
   (``order_noise_rouge_l``, ``order_noise_top1``): what reordering alone does to the answer;
3. every row, on that warm cache, in the retrieved order: ``prefix`` (exact prefix reuse: the
   system prompt only), ``order_aware`` (prefix reuse serving the cached order: exact, reordered),
   ``naive`` (ratio 0), and each token choice at each recompute ratio (non-prefix reuse of every
   chunk, the chunk KV computed behind other neighbours): free-running answer (ROUGE-L, exact
   match, first token vs ``A``; gold accuracy) and teacher-forced logits over ``A`` (top-1
   agreement with the reference per position, KL(full || reuse) per position).

Teacher-forced top-1 is also split by full prefill's own margin (``tf_top1_decisive``: positions
whose top-1 leads top-2 by >= ``DECISIVE_MARGIN``; ``tf_top1_tied``: the near ties), which tells
a shifted distribution from flipped near ties. Early termination is off in every row unless
``--early-termination``; ``--et-choices`` adds ``<choice>/et@<ratio>`` rows with it on. Seeds ask
disjoint slices of one permutation of the questions (``_picks``).

Rows share one loaded model; within a request they run back to back, so TTFT ratios (``x_full``,
``x_prefix``) are measured side by side. ``oracle`` chooses the tokens whose true V (every layer)
deviates most from full prefill's: a ceiling no real choice can see. Prints a table; ``--json OUT``
writes ``{"config", "rows": {row: metrics}, "by_corpus", "by_seed", "noise", "requests"}``;
``--plot PNG`` draws fidelity vs TTFT speedup per choice (matplotlib, cachedrag-bench's ``plot`` extra);
``--replot JSON`` prints and plots an earlier run's JSON without running anything;
``--replot A.json,B.json`` merges runs (e.g. one per seed, each under the time limit) by pooling
their per-request records and summarising them as one run (``--json OUT`` writes the merge).

Task accuracy is also compared with full prefill question by question (``gold_paired`` per row,
``order_noise_gold_paired``; ``bench.paired``): how many questions full gets right and the row
wrong and vice versa, the exact two-sided sign-test (McNemar) p-value, and the accuracy
difference in points with Newcombe's 95% interval. Seeds and corpora are pooled: each gold
question is one pair.

Does not own the engine, the metrics' definitions (``bench.metrics``) or the gold set (``bench.gold``).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time

from cachedrag_bench import write_json
from cachedrag_bench.metrics import first_token_matches, rouge_l
from cachedrag_bench.workload import EMBEDDED_CORPORA
from cachedrag.errors import ConfigError
from cachedrag.kvcache.config import QUESTION_CHOICES

ALL_CHOICES = ("deviation", "question", "question+deviation", "question+inter", "leading", "inter", "random", "oracle")
FULL_RATIOS = "0,0.05,0.1,0.15,0.2,0.3,0.5"
#: strategies beyond token selection, as ``--variants CHOICE/NAME`` rows ``CHOICE/NAME@RATIO``
#: (same recompute budget as ``CHOICE@RATIO``): the CacheConfig fields each sets
VARIANTS = {
    # the recomputed rows' matmuls on bfloat16 copies (CacheConfig.precision.recompute; docs/fidelity.md round 10)
    "bf16": {"precision": {"recompute": "bfloat16"}},
    "fp32": {"precision": {"recompute": "float32"}},  # the reference repairs (the default before round 10)
    # the tie guard (CacheConfig.exact.tie_guard, opt-in; docs/fidelity.md lever 4): a guarded request's exact prefill
    # stores its tree path in the cache the rows share, so give one guard row, one ratio, per run
    "guard15": {"exact": {"tie_guard": 0.15}},
    "guard3": {"exact": {"tie_guard": 0.3}},
    # ``fidelity="guarded"``'s first-token guard plus the guard during decoding (CacheConfig.exact.tie_guard_decode;
    # docs/fidelity.md round 22): a near tie while decoding moves the answer onto an exact prefill (stored
    # too: one such row per run)
    "decode25": {"exact": {"tie_guard": 0.25, "tie_guard_decode": 0.25}},
    "decode10": {"exact": {"tie_guard": 0.25, "tie_guard_decode": 0.1}},
    "decodeinf": {"exact": {"tie_guard": 0.25, "tie_guard_decode": float("inf")}},  # every answer switches before token 1
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--corpora", default="stdlib,info",
                        help="comma-separated: stdlib (embedded pydoc corpus + gold QA), info (GNU info manuals)")
    parser.add_argument("--seeds", default="0,1", help="stream seeds (which questions, which shuffled orders)")
    parser.add_argument("--requests", default="4",
                        help="requests per corpus and seed: N, or per corpus as CORPUS=N,... (e.g. stdlib=21,info=2)")
    parser.add_argument("--ratios", default="0,0.1,0.3",
                        help=f"recompute ratios of the frontier (0 = the naive row); the full one: {FULL_RATIOS}")
    parser.add_argument("--choices", default="deviation,question,question+deviation,oracle",
                        help="token choices, subset of " + ",".join(ALL_CHOICES))
    parser.add_argument("--variants", default="",
                        help="strategy rows CHOICE/NAME (e.g. question+inter/guard3) at every ratio; CHOICE a question "
                             "choice, NAME one of " + ",".join(VARIANTS))
    parser.add_argument("--model", default=None, help="HF model id or path (default: embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--top-k", type=int, default=5)
    parser.add_argument("--chunk-tokens", type=int, default=256)
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--question-layers", default=None, help="CacheConfig.question_layers, e.g. 1 or 1,2")
    parser.add_argument("--early-termination", action="store_true",
                        help="focused-chunk early termination in every row (default: off; it trades fidelity for "
                             "compute, see --et-choices)")
    parser.add_argument("--et-choices", default="question",
                        help="token choices that also get rows with early termination on, named '<choice>/et@<ratio>' "
                             "('' = none)")
    parser.add_argument("--corpus", help="an extra corpus (directory or JSONL) run as 'custom' with --questions")
    parser.add_argument("--questions", help="questions for --corpus, one per line")
    parser.add_argument("--plot", help="write a PNG of fidelity vs TTFT speedup here (needs matplotlib)")
    parser.add_argument("--json", dest="json_out", help="write results as JSON to this path")
    parser.add_argument("--replot", metavar="JSON[,JSON...]",
                        help="run nothing: print the table of an earlier run's --json output (and --plot it); "
                             "several comma-separated files (e.g. one run per seed) are merged into one summary, "
                             "written by --json")


def _floats(text: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ConfigError(f"not a comma-separated list of numbers: {text!r}") from None


def run(args: argparse.Namespace) -> int:
    if args.replot:
        return _replot(args)
    ratios = _floats(args.ratios)
    seeds = [int(x) for x in _floats(args.seeds)]
    choices = [c.strip() for c in args.choices.split(",") if c.strip()]
    corpora = [c.strip() for c in args.corpora.split(",") if c.strip()]
    bad = [c for c in choices + _et_choices(args) if c not in ALL_CHOICES] + [
        c for c in corpora if c not in EMBEDDED_CORPORA] + [
        v for v in _variants(args) if v.partition("/")[0] not in QUESTION_CHOICES or v.partition("/")[2] not in VARIANTS]
    if bad:
        raise ConfigError(f"unknown choices/corpora {bad}; choices: {','.join(ALL_CHOICES)}; "
                          f"corpora: {','.join(EMBEDDED_CORPORA)}")
    per_corpus = _requests(args.requests, corpora + (["custom"] if args.corpus else []))
    if any(not 0 <= r <= 1 for r in ratios) or not seeds:
        raise ConfigError("ratios must be in [0, 1], --seeds non-empty")
    if bool(args.corpus) != bool(args.questions):
        raise ConfigError("--corpus and --questions go together")
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise ConfigError("--plot needs matplotlib: pip install -e './benchmarks[plot]'") from None

    import torch

    from cachedrag.model.loader import load_model
    from cachedrag.model.runner import ModelRunner

    torch.set_grad_enabled(False)
    t0 = time.perf_counter()
    runner = ModelRunner(*load_model(args.model))
    rows = _rows(runner, args, ratios, choices)
    sets = []
    if args.corpus:
        sets.append(("custom", _custom(runner, args)))
    for name in corpora:
        sets.append((name, _corpus(runner, name, args)))
    records: list[dict] = []
    total = sum(per_corpus[name] for name, _ in sets) * len(seeds)
    done = 0
    for corpus_name, (texts, items, system) in sets:
        for seed in seeds:
            rng = random.Random(f"{seed}:{corpus_name}")
            picks = _picks(items, corpus_name, seed, per_corpus[corpus_name])
            for item in picks:
                records.append(_request(runner, rows, item, system, corpus_name, seed, rng, args))
                done += 1
                print(f"bench fidelity: {done}/{total} requests ({time.perf_counter() - t0:.0f} s)", file=sys.stderr,
                      flush=True)
    results = _summarise(records, list(rows), _config(args, records, ratios, choices, time.perf_counter() - t0))
    _print_table(results)
    if args.json_out:
        write_json(results, args.json_out)
    if args.plot:
        plot_frontier(results, args.plot)
    return 0


def _requests(text, corpora: list[str]) -> dict[str, int]:
    """``--requests``: one count for every corpus (``4``) or per corpus (``stdlib=21,info=2``; a corpus
    not named gets none)."""
    text = str(text).strip()
    try:
        if "=" not in text:
            counts = dict.fromkeys(corpora, int(text))
        else:
            pairs = [part.split("=") for part in text.split(",") if part.strip()]
            counts = {name.strip(): int(n) for name, n in pairs}
            unknown = sorted(set(counts) - set(corpora))
            if unknown:
                raise ConfigError(f"--requests names corpora not run: {unknown}")
            counts = {c: counts.get(c, 0) for c in corpora}
    except ValueError:
        raise ConfigError(f"--requests: not N or CORPUS=N,...: {text!r}") from None
    if any(n < 0 for n in counts.values()) or not any(counts.values()):
        raise ConfigError("--requests: counts must be >= 0 and at least one > 0")
    return counts


def _replot(args: argparse.Namespace) -> int:
    import json

    paths = [p.strip() for p in args.replot.split(",") if p.strip()]
    runs = []
    for path in paths:
        try:
            with open(path, encoding="utf-8") as f:
                results = json.load(f)
            results["rows"], results["noise"], results["config"]  # noqa: B018 (shape check)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ConfigError(f"--replot: not a bench fidelity JSON file: {path} ({exc})") from None
        runs.append(results)
    if not runs:
        raise ConfigError("--replot: no JSON file named")
    # re-summarised from the per-request records where there are some (an earlier run's JSON gains
    # the summary's newer fields, e.g. gold_paired); several runs are merged
    resummarise = len(runs) > 1 or bool(runs[0].get("requests"))
    results = merge_runs(runs, paths) if resummarise else runs[0]
    _print_table(results)
    if args.json_out and resummarise:
        write_json(results, args.json_out)
    if args.plot:
        plot_frontier(results, args.plot)
    return 0


def merge_runs(runs: list[dict], names: list[str] | None = None) -> dict:
    """One summary of several runs' JSON (e.g. one run per seed): their per-request records pooled
    and summarised as one run. The runs must have the same rows and the same settings apart from
    seeds, requests and time; a (corpus, seed) stream in two runs is refused (it would count
    questions twice). TTFT medians are over the pooled requests of runs measured apart."""
    first = runs[0]["config"]
    fixed = {k: v for k, v in first.items() if k not in ("seeds", "seconds", "requests_per_corpus_seed")}
    seen: set = set()
    records: list[dict] = []
    for run in runs:
        cfg = run["config"]
        if {k: cfg.get(k) for k in fixed} != fixed or set(run["rows"]) != set(runs[0]["rows"]):
            raise ConfigError("merge: the runs differ in settings or rows (only seeds and requests may differ)")
        streams = {(r["corpus"], r["seed"]) for r in run.get("requests", [])}
        if not run.get("requests") or streams & seen:
            raise ConfigError("merge: a run has no per-request records, or two runs share a (corpus, seed) stream")
        seen |= streams
        records.extend(run["requests"])
    config = {**fixed, "seeds": sorted({r["seed"] for r in records}),
              "requests_per_corpus_seed": [run["config"].get("requests_per_corpus_seed") for run in runs],
              "seconds": round(sum(run["config"].get("seconds", 0.0) for run in runs), 1),
              "merged_from": list(names) if names else len(runs)}
    return _summarise(records, list(records[0]["rows"]), config)


# ---------------------------------------------------------------------------------- setup

def _picks(items: list, corpus: str, seed: int, n: int) -> list:
    """The questions of one (corpus, seed) stream: a slice of one fixed permutation of the corpus's
    items, seed s taking items ``s*n .. s*n+n-1`` (wrapping), so seeds 0 and 1 with ``n`` <= half
    the set ask disjoint questions, and a run per seed asks what the joint run asks."""
    perm = list(items)
    random.Random(f"picks:{corpus}").shuffle(perm)
    n = min(n, len(perm))
    return [perm[(seed * n + j) % len(perm)] for j in range(n)]


def _rows(runner, args, ratios: list[float], choices: list[str]) -> dict:
    """Row name -> (engine, mode). Each engine gets a fresh manager per request (``_bind``)."""
    from cachedrag.config import EngineConfig
    from cachedrag.engine import CachedEngine
    from cachedrag.kvcache.config import CacheConfig

    # the rows share one cache per request and serve the same sequence in turn: with exact repeats on, the
    # second reuse row would promote it and every later row would be an exact hit, not the reuse it measures
    base: dict = {"exact": {"repeats": 0}}
    if args.question_layers:
        base["question_layers"] = tuple(int(x) for x in args.question_layers.split(","))
    oracle = _oracle_class()

    def engine(cls=CachedEngine, order_aware=False, et=args.early_termination, **cache):
        settings = CacheConfig().replace(**base).replace(**cache)  # groups merge: a variant keeps exact.repeats=0
        return cls(runner, config=EngineConfig(cache=settings, early_termination=et, order_aware=order_aware))

    # run order: "prefix" stores the retrieved order as a tree path, so it runs last (the reuse rows
    # compute nothing fresh and store nothing; "noise" computes everything and warms the cache)
    rows = {"full": (engine(oracle), "full"), "noise": (engine(), "naive"),
            "order_aware": (engine(order_aware=True), "prefix")}
    if 0 in ratios:
        rows["naive"] = (engine(), "naive")
    et_choices = [] if args.early_termination else _et_choices(args)
    for choice, et in [(c, args.early_termination) for c in choices] + [(c, True) for c in et_choices]:
        for ratio in (r for r in ratios if r > 0):
            name = f"{choice}{'/et' if et and not args.early_termination else ''}@{ratio:g}"
            if choice == "oracle":
                rows[name] = (engine(oracle, et=et, token_choice="question", recompute_ratio=ratio), "cachedrag")
            elif choice == "random":
                rows[name] = (engine(et=et, recompute_ratio=ratio), "random")
            else:
                rows[name] = (engine(et=et, token_choice=choice, recompute_ratio=ratio), "cachedrag")
    for spec in _variants(args):
        choice, _, variant = spec.partition("/")
        for ratio in (r for r in ratios if r > 0):
            rows[f"{spec}@{ratio:g}"] = (engine(token_choice=choice, recompute_ratio=ratio, **VARIANTS[variant]),
                                         "cachedrag")
    rows["prefix"] = (engine(), "prefix")
    return rows


def _et_choices(args) -> list[str]:
    return [c.strip() for c in args.et_choices.split(",") if c.strip()]


def _variants(args) -> list[str]:
    return [c.strip() for c in getattr(args, "variants", "").split(",") if c.strip()]


def _corpus(runner, name: str, args):
    """(chunk texts, request items, system prompt); an item is (question, retrieved texts, gold or None)."""
    from cachedrag_bench.gold import INFO_QUESTIONS, STDLIB_GOLD

    corpus = EMBEDDED_CORPORA[name]
    asked = ([(g.question, g.doc, g.answer) for g in STDLIB_GOLD] if name == "stdlib"
             else [(q, None, None) for q in INFO_QUESTIONS])
    return _retrieve(runner, corpus.documents(), asked, args) + (corpus.system_prompt,)


def _custom(runner, args):
    from cachedrag.corpus import load_corpus, load_questions

    return _retrieve(runner, load_corpus(args.corpus), [(q, None, None) for q in dict.fromkeys(
        load_questions(args.questions))], args) + (EMBEDDED_CORPORA["stdlib"].system_prompt,)


def _retrieve(runner, docs, questions, args):
    """Chunk, embed, exact top-k; a gold item's answer chunk (first chunk of its document holding
    the answer) replaces the last retrieved chunk when retrieval missed it."""
    import numpy as np

    from cachedrag_bench.gold import gold_match
    from cachedrag.retrieval.chunker import chunk_documents
    from cachedrag.retrieval.config import ChunkConfig
    from cachedrag.retrieval.embedder import Embedder

    chunks = chunk_documents(docs, runner.tokenizer, ChunkConfig(chunk_tokens=args.chunk_tokens, overlap=0),
                             progress=False)
    texts = [c.text for c in chunks]
    embedder = Embedder()
    vecs = embedder.encode(texts)  # [N, d]
    qvecs = embedder.encode([q for q, _, _ in questions])  # [Q, d]
    top = np.argsort(-(qvecs @ vecs.T), axis=1)[:, :args.top_k]  # [Q, k]
    items = []
    for (q, doc, answer), row in zip(questions, top):
        picked = [int(i) for i in row]
        gold = None
        if answer is not None:
            holder = next((i for i, c in enumerate(chunks) if c.doc_id == doc and gold_match(c.text, answer)), None)
            if holder is None:
                print(f"bench fidelity: gold answer {answer!r} is in no chunk of {doc}; question skipped",
                      file=sys.stderr)
                continue
            if holder not in picked:
                picked[-1] = holder
            gold = answer
        items.append((q, [texts[i] for i in picked], gold))
    return texts, items


def _oracle_class():
    from cachedrag.engine import CachedEngine

    class OracleEngine(CachedEngine):
        """The ceiling: ``question`` choice machinery, but tokens ranked by their true V deviation
        (all layers) from the reference full prefill captured by the last ``score`` in ``full`` mode."""

        reference_v = None

        def _teacher_forced(self, pre, start, teacher):
            if pre.info["chunks_hit"] == 0 and pre.info["prefix_hit_tokens"] == 0:  # full prefill: the reference
                type(self).reference_v = pre.kv.v[:, :, :start].clone()  # [L, H_kv, T, D], shared by the oracle rows
            return super()._teacher_forced(pre, start, teacher)

        def _question_scores(self, ids, kv, total, fresh_pos, question_pos, plan, deferred, load_layer,
                             lead=None, hidden=()):  # the oracle shares no rows with the prefill
            for layer in range(self.runner.n_layers):
                load_layer(layer)
            ref = self.reference_v
            if ref is None or ref.shape[2] != total:
                raise RuntimeError("oracle: no reference full prefill of this prompt")
            return (kv.v[:, :, :total] - ref).float().norm(dim=-1).mean((0, 1))  # [T]

    return OracleEngine


def _bind(engine, manager) -> None:
    """Point ``engine`` at ``manager`` (one fresh cache per request, shared by all rows), with the
    planner following this engine's policy (recompute ratio, token choice)."""
    engine.manager = manager
    manager.config = engine.config.cache
    manager.planner.config = engine.config.cache


# ---------------------------------------------------------------------------------- one request

def _request(runner, rows: dict, item, system: str, corpus: str, seed: int, rng: random.Random, args) -> dict:
    import torch

    from cachedrag_bench.gold import gold_match
    from cachedrag.kvcache.manager import ChunkCacheManager
    from cachedrag.model.generation import SamplingParams
    from cachedrag.store.cpu import CPUTier

    question, chunks, gold = item
    full_engine = rows["full"][0]
    params = SamplingParams(max_new_tokens=args.max_new_tokens)
    manager = ChunkCacheManager(CPUTier(2 << 30, namespace=full_engine.model_namespace.digest),
                                full_engine.config.cache, capacity_bytes=2 << 30)
    segs = full_engine.prompts.chat(chunks, question, system)
    _bind(full_engine, manager)
    ref = full_engine.generate_segments(segs, params, mode="full")
    answer = ref.token_ids
    ref_logits = full_engine.score(segs, answer, mode="full")  # [A, V]
    ref_logp = ref_logits.log_softmax(-1)
    ref_top = ref_logits.argmax(-1)  # [A]
    top2 = ref_logp.exp().topk(2, dim=-1).values  # [A, 2]
    decisive = (top2[:, 0] - top2[:, 1]) >= DECISIVE_MARGIN  # [A] full prefill's choice is not a near tie
    order = list(range(len(chunks)))
    while len(chunks) > 1 and order[0] == 0:
        rng.shuffle(order)
    record = {"corpus": corpus, "seed": seed, "question": question, "gold": gold, "answer": ref.text,
              "prompt_tokens": ref.prompt_tokens, "order": order, "rows": {}}

    def measure(r) -> dict:
        logits = r.teacher_logits  # [A, V]
        kl = (ref_logp.exp() * (ref_logp - logits.log_softmax(-1))).sum(-1)  # [A]
        agree = logits.argmax(-1) == ref_top  # [A]
        return {"ttft_s": r.ttft_s, "total_s": r.total_s, "switch": r.tie_guard_switch,
                "computed_fraction": r.computed_fraction,
                "tf_top1": float(agree.float().mean()), "tf_kl": float(kl.mean()),
                "tf_top1_decisive": float(agree[decisive].float().mean()) if decisive.any() else None,
                "tf_top1_tied": float(agree[~decisive].float().mean()) if (~decisive).any() else None,
                "first_token": float(first_token_matches(r, answer)), "rouge_l": rouge_l(r.text, ref.text),
                "exact": float(r.token_ids == answer), "gold": None if gold is None else float(gold_match(r.text, gold)),
                "approximations": r.approximations, "chunks_hit": r.chunks_hit}

    record["decisive_share"] = float(decisive.float().mean())
    record["rows"]["full"] = {"ttft_s": ref.ttft_s, "total_s": ref.total_s, "switch": None, "computed_fraction": 1.0,
                              "tf_top1": 1.0, "tf_kl": 0.0,
                              "tf_top1_decisive": 1.0 if decisive.any() else None,
                              "tf_top1_tied": 1.0 if (~decisive).any() else None,
                              "first_token": 1.0, "rouge_l": 1.0, "exact": 1.0,
                              "gold": None if gold is None else float(gold_match(ref.text, gold)),
                              "approximations": [], "chunks_hit": 0}
    shuffled = full_engine.prompts.chat([chunks[i] for i in order], question, system)
    for name, (engine, mode) in rows.items():
        if name == "full":
            continue
        _bind(engine, manager)
        with torch.inference_mode():
            r = engine.generate_segments(shuffled if name == "noise" else segs, params, mode=mode, teacher=answer)
        record["rows"][name] = measure(r)
        if name == "noise":
            assert r.chunks_hit == 0, "the noise/warm-up pass must compute every chunk fresh"
    return record


# ---------------------------------------------------------------------------------- summary

METRICS = ("tf_top1", "tf_kl", "tf_top1_decisive", "tf_top1_tied", "first_token", "rouge_l", "exact", "gold",
           "computed_fraction")
#: full prefill's top-1 probability minus its top-2 at an answer position: below this it is a near
#: tie (tf_top1_tied), at or above it a decisive choice (tf_top1_decisive)
DECISIVE_MARGIN = 0.2


def _aggregate(recs: list[dict], row: str) -> dict:
    out = {}
    for m in METRICS:
        vals = [r["rows"][row][m] for r in recs if r["rows"][row][m] is not None]
        out[m] = statistics.fmean(vals) if vals else None
    out["gold_n"] = sum(r["rows"][row]["gold"] is not None for r in recs)
    out["ttft_median_s"] = statistics.median(r["rows"][row]["ttft_s"] for r in recs)
    totals = [r["rows"][row]["total_s"] for r in recs if "total_s" in r["rows"][row]]  # (older JSON lacks it)
    out["total_median_s"] = statistics.median(totals) if totals else None
    out["switches"] = sum(r["rows"][row].get("switch") is not None for r in recs)  # CacheConfig.exact.tie_guard_decode
    out["n"] = len(recs)
    return out


def _config(args, records: list[dict], ratios, choices, seconds: float) -> dict:
    import torch

    return {
        "model": args.model or "SmolLM2-135M-Instruct", "corpora": sorted({r["corpus"] for r in records}),
        "seeds": sorted({r["seed"] for r in records}), "requests_per_corpus_seed": _requests(args.requests, sorted({r["corpus"] for r in records})),
        "ratios": ratios, "choices": choices, "top_k": args.top_k, "chunk_tokens": args.chunk_tokens,
        "max_new_tokens": args.max_new_tokens, "early_termination": args.early_termination,
        "et_choices": [] if args.early_termination else _et_choices(args),
        "question_layers": args.question_layers, "variants": {v: VARIANTS[v.partition("/")[2]] for v in _variants(args)},
        "torch_threads": torch.get_num_threads(), "seconds": round(seconds, 1),
    }


def _gold_paired(records: list[dict], row: str) -> dict | None:
    """Task accuracy of ``row`` vs full prefill, question by question (``bench.paired``); None
    without gold questions."""
    from cachedrag_bench.paired import PairedAccuracy

    pairs = [(r["rows"]["full"]["gold"], r["rows"][row]["gold"]) for r in records if r["rows"]["full"]["gold"] is not None]
    return PairedAccuracy.from_pairs(pairs).to_dict() if pairs else None


def _summarise(records: list[dict], row_names: list[str], config: dict) -> dict:
    results = {"config": config, "n_requests": len(records), "rows": {}, "by_corpus": {}, "by_seed": {},
               "decisive_margin": DECISIVE_MARGIN,
               "decisive_share": statistics.fmean(r["decisive_share"] for r in records) if records else None}
    rows = [n for n in row_names if n != "noise"]
    for name in rows:
        results["rows"][name] = _aggregate(records, name)
    full_t = results["rows"]["full"]["ttft_median_s"]
    prefix_t = results["rows"]["prefix"]["ttft_median_s"]
    full_gold = results["rows"]["full"]["gold"]
    for row in results["rows"].values():
        row["x_full"] = full_t / row["ttft_median_s"]
        row["x_prefix"] = prefix_t / row["ttft_median_s"]
        # task accuracy vs full prefill, in points (the target: within 1 point)
        row["gold_delta_pts"] = None if row["gold"] is None else 100.0 * (row["gold"] - full_gold)
    for name in rows:
        results["rows"][name]["gold_paired"] = _gold_paired(records, name)
    noise = _aggregate(records, "noise")
    results["noise"] = {"order_noise_rouge_l": noise["rouge_l"], "order_noise_top1": noise["tf_top1"],
                        "order_noise_kl": noise["tf_kl"], "order_noise_first_token": noise["first_token"],
                        "order_noise_top1_decisive": noise["tf_top1_decisive"],
                        "order_noise_exact": noise["exact"], "order_noise_gold": noise["gold"],
                        "order_noise_gold_paired": _gold_paired(records, "noise")}
    for key, field in (("by_corpus", "corpus"), ("by_seed", "seed")):
        for value in sorted({r[field] for r in records}):
            sub = [r for r in records if r[field] == value]
            results[key][str(value)] = {name: _aggregate(sub, name) for name in rows + ["noise"]}
    results["requests"] = records
    return results


def _print_table(results: dict) -> None:
    cols = ("computed_fraction", "ttft_median_s", "x_full", "x_prefix", "tf_top1", "tf_kl", "tf_top1_decisive",
            "first_token", "rouge_l", "exact", "gold")
    head = ("row", "computed", "ttft_med", "x_full", "x_prefix", "tf_top1", "tf_kl", "tf_decis", "tok1", "rougeL",
            "exact", "gold")
    cfg = results["config"]
    print(f"\nFidelity vs full prefill over {results['n_requests']} requests (corpora {','.join(cfg['corpora'])}, "
          f"seeds {cfg['seeds']}, {cfg['max_new_tokens']} greedy tokens)")
    print("  ".join([f"{head[0]:>22}"] + [f"{h:>9}" for h in head[1:]]))

    def fmt(v):
        return "-" if v is None else f"{v:.3f}"

    for name, row in results["rows"].items():
        print("  ".join([f"{name:>22}"] + [f"{fmt(row.get(c)):>9}" for c in cols]))
    n = results["noise"]
    print(f"order-noise floor (full prefill, chunks shuffled): rougeL {fmt(n['order_noise_rouge_l'])}, "
          f"tf_top1 {fmt(n['order_noise_top1'])}, tf_kl {fmt(n['order_noise_kl'])}, "
          f"tf_decis {fmt(n.get('order_noise_top1_decisive'))}, tok1 {fmt(n['order_noise_first_token'])}, "
          f"gold {fmt(n['order_noise_gold'])}")
    print(f"tf_decis: teacher-forced top-1 on positions where full prefill's top-1 leads its top-2 by >= "
          f"{DECISIVE_MARGIN} probability ({fmt(results.get('decisive_share'))} of positions); the rest are near ties")
    for name, row in results["rows"].items():
        if row.get("switches"):
            print(f"tie guard during decoding, {name}: {row['switches']} of {row['n']} answers moved onto exact KV; "
                  f"answer time median {fmt(row['total_median_s'])} s (full {fmt(results['rows']['full'].get('total_median_s'))} s)")
    _print_gold_paired(results)
    corpora = list(results["by_corpus"])
    if len(corpora) > 1:
        print("per corpus (tf_top1 / tf_kl / tok1 / rougeL / gold):")
        for c in corpora:
            sub = results["by_corpus"][c]
            n_c = sub["full"]["n"]
            print(f"  {c} ({n_c} requests): " + "; ".join(
                f"{name} {fmt(sub[name]['tf_top1'])}/{fmt(sub[name]['tf_kl'])}/{fmt(sub[name]['first_token'])}/"
                f"{fmt(sub[name]['rouge_l'])}/{fmt(sub[name]['gold'])}" for name in sub))
    seeds = list(results["by_seed"])
    if len(seeds) > 1:
        print("per seed (tf_kl / rougeL): " + "; ".join(
            f"{name} " + " ".join(f"{results['by_seed'][s][name]['tf_kl']:.3f}/{results['by_seed'][s][name]['rouge_l']:.2f}"
                                  for s in seeds)
            for name in results["rows"] if "@" in name))


def _print_gold_paired(results: dict) -> None:
    """Task accuracy vs full prefill, question by question: right/n, the difference in points with
    its 95% interval, the discordant counts and the exact sign-test p-value."""
    paired = [(name, row.get("gold_paired")) for name, row in results["rows"].items() if name != "full"]
    paired.append(("order-noise floor", results["noise"].get("order_noise_gold_paired")))
    paired = [(name, p) for name, p in paired if p]
    if not paired:
        return
    n = paired[0][1]["n"]
    full_right = paired[0][1]["both"] + paired[0][1]["full_only"]
    print(f"task accuracy vs full prefill, paired over {n} gold questions (full right: {full_right}/{n} = "
          f"{100.0 * full_right / n:.1f}%); full_only: full right and the row wrong, row_only: the reverse; "
          f"p: exact two-sided sign test (McNemar); 95% interval: Newcombe")
    print("  ".join([f"{'row':>22}", f"{'right':>9}", f"{'delta_pts':>9}", f"{'95% interval (pts)':>20}",
                     f"{'full_only':>9}", f"{'row_only':>9}", f"{'p':>7}"]))
    for name, p in paired:
        right = p["both"] + p["row_only"]
        lo, hi = p["ci95_pts"]
        print("  ".join([f"{name:>22}", f"{str(right) + '/' + str(p['n']):>9}", f"{p['delta_pts']:>+9.1f}",
                         f"{f'[{lo:+.1f}, {hi:+.1f}]':>20}", f"{p['full_only']:>9}", f"{p['row_only']:>9}",
                         f"{p['p_value']:>7.3f}"]))


def plot_frontier(results: dict, path: str) -> None:
    """Three panels vs TTFT speedup over full prefill: teacher-forced KL (log scale), teacher-forced
    top-1 and free-running ROUGE-L; one line per token choice over its recompute ratios (ratio
    labels on the ``question`` line), the order-noise floor dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = results["rows"]
    by_choice: dict[str, list[tuple[float, dict]]] = {}
    for name, row in rows.items():
        if "@" in name:
            choice, ratio = name.split("@")
            by_choice.setdefault(choice, []).append((float(ratio), row))
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.4))
    panels = ((axes[0], "tf_kl", "teacher-forced KL(full || reuse), lower is better", "order_noise_kl"),
              (axes[1], "tf_top1", "teacher-forced top-1 agreement", "order_noise_top1"),
              (axes[2], "rouge_l", "ROUGE-L vs full (free-running)", "order_noise_rouge_l"))
    for ax, metric, label, floor in panels:
        for choice, pts in sorted(by_choice.items()):
            pts.sort()
            style = "--" if choice == "oracle" or "/" in choice else "-"
            width = 2.5 if choice == "question" else 1.2
            ax.plot([p[1]["x_full"] for p in pts], [p[1][metric] for p in pts], style, marker="o", markersize=3.5,
                    linewidth=width, label=choice)
            if choice == "question":
                for ratio, p in pts:
                    ax.annotate(f"{ratio:g}", (p["x_full"], p[metric]), fontsize=7, xytext=(3, 3),
                                textcoords="offset points")
        for name, marker in (("naive", "x"), ("prefix", "s"), ("order_aware", "^")):
            if name in rows:
                ax.plot([rows[name]["x_full"]], [rows[name][metric]], marker, color="black", label=name)
        if results["noise"].get(floor) is not None:
            ax.axhline(results["noise"][floor], color="grey", linestyle=":", label="order-noise floor")
        if metric == "tf_kl":
            ax.set_yscale("log")
        ax.set_xlabel("TTFT speedup vs full prefill (x)")
        ax.set_ylabel(label, fontsize=8)
        ax.grid(alpha=0.3)
    axes[2].legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    cfg = results["config"]
    fig.suptitle(f"{cfg['model']}: {results['n_requests']} requests, corpora {', '.join(cfg['corpora'])}, "
                 f"seeds {cfg['seeds']} (labels on the question line: recompute ratio)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
