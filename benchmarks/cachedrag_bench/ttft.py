"""``cachedrag bench ttft``: time to first token and fidelity of each reuse mode, side by side.

Owns: the TTFT suite. It builds a workload (corpus -> LLM-token chunks -> exact top-k per
question), runs every request through each mode in turn (interleaved, so machine noise hits
all modes alike; each mode has its own engine and cache, sharing one loaded model), and
reports per mode: TTFT median/mean/p95, computed-token fraction, chunk hit rate, ROUGE-L and
first-token agreement against the ``full`` answer of the same request, teacher-forced agreement
over that answer (``teacher_forced_top1``: the mode's top-1 equals full's at each answer position;
``teacher_forced_kl``: mean KL(full || mode) per position; the same prefill as the free-running
answer, so no compounding of an early divergence), where the greedy answers part from full's
(``answer_divergence``: how many, at which position, how near a tie full prefill itself was
there, and what a gap guard watching every decode step would prefill again and prevent;
``answer_divergences``: each parting), and speedups measured in the same run. Also reports the planner micro-benchmark (10k cached chunks) and the
replacement-policy trace simulation. Prints a table; ``--json OUT`` writes
``{"config", "n_requests", "modes": {mode: {...}}, "planning", "policy_simulation"}``.
``--device`` picks where the model runs (CPU by default; on CUDA the clock starts after a device
sync). ``--workload-out`` saves the built workload (``bench.workload.save_workload``) and
``--workload`` replays a saved one without the embedder, e.g. built here and run on a GPU machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import Counter
import sys
import time

from cachedrag_bench import write_json
from cachedrag_bench.metrics import divergence, divergence_summary, first_token_matches, rouge_l, summary
from cachedrag_bench.workload import EMBEDDED_CORPORA, embedded_corpus_of
from cachedrag.errors import ConfigError
from cachedrag.kvcache.config import TOKEN_CHOICES

DEFAULT_SYSTEM_PROMPT = EMBEDDED_CORPORA["stdlib"].system_prompt
ALL_MODES = ("full", "prefix", "naive", "random", "cachedrag")
#: the engine default until the measured frontier chose one (docs/fidelity.md), for before/after rows
PREVIOUS_DEFAULT = {"cache": {"token_choice": "deviation", "recompute_ratio": None},
                    "early_termination": True}
#: the workload options' defaults (None in the parser, so that --workload can tell a given one)
WORKLOAD_DEFAULTS = {"top_k": 5, "chunk_tokens": 256, "requests": 40, "zipf": 1.1}
DEFAULT_MODEL = "SmolLM2-135M-Instruct"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--corpus", help="directory of .txt/.md files or a JSONL of {id, text} (default: stdlib docs)")
    parser.add_argument("--embedded-corpus", choices=tuple(EMBEDDED_CORPORA), default=None,
                        help="without --corpus: the embedded corpus and its Zipf question stream (default stdlib: "
                             "the Python docs; info: the GNU info manuals under /usr/share/info)")
    parser.add_argument("--questions", help="one question per line, used in order (default: a Zipf stream of the "
                        "embedded corpus's questions)")
    parser.add_argument("--model", default=None, help="HF model id or path (default: embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--dtype", default=None, choices=("float32", "bfloat16"),
                        help="the runner's numerics in every mode (default: the model's, float32 for the embedded "
                             "one; bfloat16: what `bench serve` measures servers in, `cachedrag serve --dtype bfloat16`)")
    parser.add_argument("--device", default="cpu", choices=("auto", "cpu", "cuda"),
                        help="where the model runs (default cpu; auto: cuda when torch has it)")
    parser.add_argument("--top-k", type=int, default=None,
                        help=f"chunks retrieved per request (default {WORKLOAD_DEFAULTS['top_k']})")
    parser.add_argument("--chunk-tokens", type=int, default=None,
                        help=f"chunk size in LLM tokens (default {WORKLOAD_DEFAULTS['chunk_tokens']})")
    parser.add_argument("--modes", default=",".join(ALL_MODES), help="comma-separated subset of " + ",".join(ALL_MODES))
    parser.add_argument("--warmup", type=int, default=None, help="leading requests not counted (default 10%% of the stream)")
    parser.add_argument("--requests", type=int, default=None,
                        help=f"stream length when no --questions file is given (default {WORKLOAD_DEFAULTS['requests']})")
    parser.add_argument("--zipf", type=float, default=None,
                        help=f"Zipf exponent of the generated stream (default {WORKLOAD_DEFAULTS['zipf']})")
    parser.add_argument("--workload-out", metavar="FILE", help="also write the built workload (chunks, question stream, "
                        "top-k chunks per request, how it was built, the tokenizer's identity) as JSON to FILE")
    parser.add_argument("--workload-only", action="store_true",
                        help="with --workload-out: write the workload and exit (loads the tokenizer only, not the model)")
    parser.add_argument("--workload", metavar="FILE", help="replay a workload written by --workload-out instead of "
                        "building one (no embedder; --corpus, --questions, --top-k, --chunk-tokens, --requests and "
                        "--zipf come from the file: refused unless equal to its values)")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--alpha", type=float, default=None, help="Cache-Craft alpha (CFO scale)")
    parser.add_argument("--recompute-ratio", type=float, default=None, help="fixed global recompute ratio instead of CFO")
    parser.add_argument("--ratios", default="", help="also run cachedrag at these fixed recompute ratios, e.g. 0.15,0.3,0.5 "
                        "(rows 'cachedrag@R': the fidelity vs computed-fraction frontier)")
    parser.add_argument("--reference-ratios", default="", help="also run cachedrag at these ratios on the reuse path's "
                        "reference settings: float32 question pre-pass, zero-filled request buffer (rows "
                        "'cachedrag@R:ref'; a before/after of those fast paths in one run)")
    parser.add_argument("--pass-fresh-all", action="store_true",
                        help="also run cachedrag with the question pre-pass computing every fresh row "
                        "(CacheConfig.question_pass_fresh='all', the reference; row 'cachedrag:pass_fresh=all')")
    parser.add_argument("--token-choice", default=None, choices=TOKEN_CHOICES,
                        help="which tokens of a reused chunk cachedrag recomputes (default: the CacheConfig default)")
    parser.add_argument("--choices", default="", help="also run cachedrag with these other token choices, e.g. "
                        "inter,leading (rows 'cachedrag:CHOICE', same recompute counts)")
    parser.add_argument("--early-termination", dest="early_termination", action="store_true", default=None,
                        help="focused-chunk early termination on (default: the EngineConfig default, off)")
    parser.add_argument("--no-early-termination", dest="early_termination", action="store_false",
                        help="focused-chunk early termination off")
    parser.add_argument("--exact-repeats", default="", help="also run cachedrag with these exact-repeat settings "
                        "(CacheConfig.exact.repeats): 'off', N (the N-th reuse-served sighting of a chunk sequence gets "
                        "its exact path after the response) or N:inline (that sighting is prefilled exactly), e.g. "
                        "off,2:inline (rows 'cachedrag:repeats=SPEC')")
    parser.add_argument("--tie-guards", default="", help="also run cachedrag with these tie guards, "
                        "comma-separated gaps (CacheConfig.exact.tie_guard, nats, 0 = off), e.g. 0,0.3,1 "
                        "(rows 'cachedrag:tie_guard=SPEC')")
    parser.add_argument("--recompute-dtypes", default="", help="also run cachedrag with the recomputed rows' "
                        "matmuls in these dtypes (CacheConfig.precision.recompute), comma-separated DTYPE[@RATIO], e.g. "
                        "bfloat16,bfloat16@0.35 (rows 'cachedrag:recompute=SPEC'; @RATIO: recompute_ratio, else the default's)")
    parser.add_argument("--cache-rows", default="", help="also run cachedrag with these CacheConfig settings, "
                        "comma-separated rows of FIELD=VALUE joined by '+' (scalar fields: a number, a word, "
                        "true/false or none), e.g. precision.fresh=bfloat16,precision.fresh=bfloat16+exact.tie_guard=0.25 "
                        "(rows 'cachedrag:SPEC'; fields not named keep the default's)")
    parser.add_argument("--previous-default", action="store_true",
                        help="also run the engine default before the frontier picked one (row 'cachedrag:previous': "
                             "deviation choice, per-chunk CFO counts, early termination on), for a before/after")
    parser.add_argument("--no-teacher-forced", action="store_true",
                        help="skip teacher-forced agreement (saves one full-prefill scoring pass per request)")
    parser.add_argument("--order-aware", action="store_true", help="EngineConfig.order_aware for every mode")
    parser.add_argument("--system-prompt", default=None,
                        help="default: the embedded corpus's (the Python docs one for --corpus and --workload files)")
    parser.add_argument("--seed", type=int, default=None,
                        help="seed of the generated stream and of the cache (default 0; with --workload: the file's)")
    parser.add_argument("--planning-chunks", type=int, default=10_000, help="cached chunks in the planning micro-benchmark")
    parser.add_argument("--skip-simulation", action="store_true", help="skip the policy trace simulation")
    parser.add_argument("--json", dest="json_out", help="write results as JSON to this path")


def run(args: argparse.Namespace) -> int:
    import torch
    from tqdm import tqdm

    from cachedrag_bench.workload import build_workload, load_workload, save_workload
    from cachedrag.config import EngineConfig
    from cachedrag.engine import CachedEngine
    from cachedrag.fingerprint import tokenizer_fingerprint
    from cachedrag.kvcache.config import CacheConfig
    from cachedrag.model.loader import load_model, load_tokenizer
    from cachedrag.model.runner import ModelRunner, resolve_device

    device = resolve_device(args.device)
    loaded = tokenizer_id = None
    if args.workload:
        if args.workload_only:
            raise ConfigError("--workload-only builds a workload; it does not go with --workload")
        loaded, tokenizer_id = load_workload(args.workload)  # checked before any model loads
        params = loaded.params
        # what the file fixes: refused beside it, but for a value equal to the file's (a command line kept as it was)
        fixed = (("--corpus", args.corpus, None), ("--embedded-corpus", args.embedded_corpus, None),
                 ("--questions", args.questions, None), ("--top-k", args.top_k, "top_k"),
                 ("--chunk-tokens", args.chunk_tokens, "chunk_tokens"), ("--requests", args.requests, "n_requests"),
                 ("--zipf", args.zipf, "zipf_s"))
        given = [flag for flag, value, key in fixed if value is not None and (key is None or params.get(key) != value)]
        if given:
            values = json.dumps({key: params.get(key) for _, _, key in fixed if key})
            raise ConfigError(f"--workload {args.workload}: {', '.join(given)} come from the workload file ({values}); "
                              f"leave them out")
        args.top_k = params.get("top_k") or max(len(r) for r in loaded.retrieved)
        args.chunk_tokens = params.get("chunk_tokens") or WORKLOAD_DEFAULTS["chunk_tokens"]
        if args.seed is None:
            args.seed = params.get("seed") if isinstance(params.get("seed"), int) else 0
    else:
        if args.corpus and args.embedded_corpus:
            raise ConfigError("--corpus and --embedded-corpus name the corpus twice; give one")
        for name, value in WORKLOAD_DEFAULTS.items():
            if getattr(args, name) is None:
                setattr(args, name, value)
        if args.seed is None:
            args.seed = 0
        if args.workload_only and not args.workload_out:
            raise ConfigError("--workload-only needs --workload-out FILE")
    model_name = args.model or DEFAULT_MODEL

    def build(tokenizer):
        work = build_workload(tokenizer, args.corpus, args.questions, top_k=args.top_k, chunk_tokens=args.chunk_tokens,
                              n_requests=args.requests, zipf_s=args.zipf, seed=args.seed,
                              embedded=args.embedded_corpus or "stdlib")
        if args.workload_out:
            save_workload(work, args.workload_out,
                          tokenizer={"model": model_name, "fingerprint": tokenizer_fingerprint(tokenizer)})
            print(f"wrote workload {args.workload_out}: {len(work.questions)} requests, {len(work.chunks)} chunks, "
                  f"top-{args.top_k}", file=sys.stderr)
        return work

    if args.workload_only:  # the tokenizer cuts the chunks; the model is not needed
        build(load_tokenizer(args.model))
        return 0

    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = [m for m in modes if m not in ALL_MODES]
    if unknown:
        raise ConfigError(f"unknown modes {unknown}; choose from {ALL_MODES}")
    if "full" not in modes:
        modes.insert(0, "full")  # the fidelity reference
    repeats = _settings(args.exact_repeats, _repeat_setting)
    tie_guards = _settings(args.tie_guards, tie_guard_setting)
    recompute = _settings(args.recompute_dtypes, recompute_setting)
    cache_rows = _settings(args.cache_rows, cache_row_setting)
    runner = ModelRunner(*load_model(args.model, device=device), dtype=args.dtype)
    on_cuda = runner.device.type == "cuda"
    if on_cuda:  # CUDA context, kernel selection and JIT, allocator growth: paid here, not by the first requests
        runner.warmup()
    fingerprint = tokenizer_fingerprint(runner.tokenizer)
    if loaded is not None:
        work = loaded
        if args.workload_out:
            save_workload(work, args.workload_out, tokenizer=tokenizer_id)
        if tokenizer_id.get("fingerprint") != fingerprint:
            print(f"cachedrag: warning: {args.workload} was cut in the tokenizer of {tokenizer_id.get('model')!r} "
                  f"(fingerprint {tokenizer_id.get('fingerprint')}), this run's is {fingerprint}: the same texts, "
                  f"but chunk sizes in tokens may differ from a built run's", file=sys.stderr)
    else:
        work = build(runner.tokenizer)
    if args.system_prompt is None:  # the embedded corpus's own (a workload file names its corpus)
        args.system_prompt = embedded_corpus_of(work).system_prompt
    # the first token is read as a Python int (an argmax's .item(): a device sync), so TTFT's end waits for
    # the GPU; its start must not include work still queued by the previous call (scoring, teacher forcing)
    sync = torch.cuda.synchronize if on_cuda else (lambda: None)
    n = len(work.questions)
    warmup = max(0, min(n - 1, args.warmup if args.warmup is not None else n // 10))
    cache_kwargs = {"seed": args.seed}
    if args.alpha is not None:
        cache_kwargs["alpha"] = args.alpha
    if args.recompute_ratio is not None:
        cache_kwargs["recompute_ratio"] = args.recompute_ratio
    if args.token_choice is not None:
        cache_kwargs["token_choice"] = args.token_choice
    engine_kwargs = {} if args.early_termination is None else {"early_termination": args.early_termination}
    config = EngineConfig(cache=CacheConfig(**cache_kwargs), order_aware=args.order_aware, **engine_kwargs)
    engines = {m: CachedEngine(runner, config=config.model_copy(update={"mode": m})) for m in modes}
    for ratio in [float(x) for x in args.ratios.split(",") if x.strip()]:
        name = f"cachedrag@{ratio:g}"
        cache = CacheConfig(**{**cache_kwargs, "recompute_ratio": ratio})
        engines[name] = CachedEngine(runner, config=config.model_copy(update={"mode": "cachedrag", "cache": cache}))
        modes.append(name)
    for ratio in [float(x) for x in args.reference_ratios.split(",") if x.strip()]:
        name = f"cachedrag@{ratio:g}:ref"
        cache = CacheConfig(**cache_kwargs).replace(recompute_ratio=ratio, precision={"question": "float32"})
        engines[name] = CachedEngine(runner, config=config.model_copy(update={"mode": "cachedrag", "cache": cache}))
        engines[name].buffer_fill = 0.0
        modes.append(name)
    if args.pass_fresh_all:
        cache = CacheConfig(**{**cache_kwargs, "question_pass_fresh": "all"})
        engines["cachedrag:pass_fresh=all"] = CachedEngine(runner, config=config.model_copy(update={
            "mode": "cachedrag", "cache": cache}))
        modes.append("cachedrag:pass_fresh=all")
    for choice in [x.strip() for x in args.choices.split(",") if x.strip()]:
        name = f"cachedrag:{choice}"
        cache = CacheConfig(**{**cache_kwargs, "token_choice": choice})
        engines[name] = CachedEngine(runner, config=config.model_copy(update={"mode": "cachedrag", "cache": cache}))
        modes.append(name)

    for spec, setting in tie_guards.items():
        name = f"cachedrag:tie_guard={spec}"
        cache = CacheConfig(**cache_kwargs).replace(**setting)
        engines[name] = CachedEngine(runner, config=config.model_copy(update={"mode": "cachedrag", "cache": cache}))
        modes.append(name)

    for spec, setting in repeats.items():
        name = f"cachedrag:repeats={spec}"
        cache = CacheConfig(**cache_kwargs).replace(**setting)
        engines[name] = CachedEngine(runner, config=config.model_copy(update={"mode": "cachedrag", "cache": cache}))
        modes.append(name)

    for prefix, settings in (("recompute=", recompute), ("", cache_rows)):
        for spec, setting in settings.items():
            name = f"cachedrag:{prefix}{spec}"
            cache = CacheConfig(**cache_kwargs).replace(**setting)
            engines[name] = CachedEngine(runner, config=config.model_copy(update={"mode": "cachedrag", "cache": cache}))
            modes.append(name)

    if args.previous_default:
        cache = CacheConfig(**{**cache_kwargs, **PREVIOUS_DEFAULT["cache"]})
        engines["cachedrag:previous"] = CachedEngine(runner, config=config.model_copy(update={
            "mode": "cachedrag", "cache": cache, "early_termination": PREVIOUS_DEFAULT["early_termination"]}))
        modes.append("cachedrag:previous")

    from cachedrag.model.generation import SamplingParams

    records: dict[str, list] = {m: [] for m in modes}
    teacher: dict[str, list] = {m: [] for m in modes}  # per counted request: (top1, kl) vs full
    parting: dict[str, list] = {m: [] for m in modes}  # per counted request: where its answer leaves full's
    params = SamplingParams(max_new_tokens=args.max_new_tokens)
    for i in tqdm(range(n), desc="bench ttft", unit="req", file=sys.stderr):
        segs = engines["full"].prompts.chat(work.retrieved[i], work.questions[i], args.system_prompt)
        ref_logp = answer = ref_pick = ref_ids = ref_gaps = None
        for m in modes:  # "full" first: its answer is what the other modes are teacher-forced on
            sync()
            with torch.inference_mode():
                r = engines[m].generate_segments(segs, params, teacher=answer)
            if m == "full" and not args.no_teacher_forced and r.token_ids:
                answer = r.token_ids
                ref_logp = engines["full"].score(segs, answer, mode="full").log_softmax(-1)  # [A, V]
                ref_top = ref_logp.topk(2, dim=-1).values  # [A, 2]
                ref_pick = ref_logp.argmax(-1)  # [A] full's top-1 at each answer position
                ref_ids = ref_pick.tolist()
                ref_gaps = (ref_top[:, 0] - ref_top[:, 1]).tolist()
            if i >= warmup:
                records[m].append(r)
                if ref_logp is not None:
                    logp = ref_logp if m == "full" else r.teacher_logits.log_softmax(-1)  # [A, V]
                    kl = (ref_logp.exp() * (ref_logp - logp)).sum(-1)  # [A]
                    pick = logp.argmax(-1)  # [A]
                    top1 = (pick == ref_pick).float()  # [A]
                    teacher[m].append((float(top1.mean()), float(kl.mean())))
                    if m != "full":
                        top = logp.topk(2, dim=-1).values  # [A, 2]
                        parting[m].append({**divergence(
                            ref_ids, pick.tolist(), ref_gaps, (top[:, 0] - top[:, 1]).tolist()),
                            "request": i, "approximate": bool(r.approximations)})

    results = {"config": {
        "model": model_name, "corpus": work.corpus_name, "questions": work.question_source,
        "system_prompt": args.system_prompt, "n_chunks": len(work.chunks), "top_k": args.top_k,
        "chunk_tokens": args.chunk_tokens, "modes": modes,
        "warmup": warmup, "max_new_tokens": args.max_new_tokens, "cache": config.cache.to_dict(),
        "early_termination": config.early_termination, "torch_threads": torch.get_num_threads(),
        "device": str(runner.device), "dtype": str(runner.dtype).removeprefix("torch."),
        "gpu": torch.cuda.get_device_name(runner.device) if on_cuda else None,
        "torch": torch.__version__, "kernel_backend": runner.kernel_backend,
        "prefill_attention": runner.prefill_attention, "decode_step": runner.decode_step_kind,
        "workload": {"file": args.workload, "params": work.params, "tokenizer": fingerprint,
                     "tokenizer_match": None if loaded is None else tokenizer_id.get("fingerprint") == fingerprint},
    }, "n_requests": n - warmup, "modes": {}}
    full = records["full"]
    for m in modes:
        rs = records[m]
        ttft = [r.ttft_s for r in rs]
        ttft_summary, answer_time = summary(ttft), summary([r.total_s for r in rs])
        chunks_total = sum(r.chunks_hit + r.chunks_missed for r in rs)
        results["modes"][m] = {
            "ttft_median_s": ttft_summary["median"], "ttft_mean_s": ttft_summary["mean"],
            "ttft_p95_s": ttft_summary["p95"],
            "computed_token_fraction": statistics.fmean(r.computed_fraction for r in rs),
            "chunk_hit_rate": (sum(r.chunks_hit for r in rs) / chunks_total) if chunks_total else 0.0,
            "rouge_l_vs_full": statistics.fmean(rouge_l(r.text, f.text) for r, f in zip(rs, full)),
            # the first token as decoded (a stream's first): a whole answer's rewind may replace it afterwards
            "first_token_match_vs_full": statistics.fmean(
                float(first_token_matches(r, f.token_ids)) for r, f in zip(rs, full)),
            "answer_match_vs_full": statistics.fmean(float(r.token_ids == f.token_ids) for r, f in zip(rs, full)),
            # the whole answer's time (prefill + decode, and any exact prefill during decoding)
            "total_median_s": answer_time["median"], "total_mean_s": answer_time["mean"],
            "prompt_tokens_mean": statistics.fmean(r.prompt_tokens for r in rs),
            "teacher_forced_top1": statistics.fmean(t[0] for t in teacher[m]) if teacher[m] else None,
            "teacher_forced_kl": statistics.fmean(t[1] for t in teacher[m]) if teacher[m] else None,
            # where the greedy answers leave full's, read off the teacher-forced pass (bench.metrics.divergence)
            "answer_divergence": divergence_summary(parting[m]) if parting[m] else None,
            "answer_divergences": [p for p in parting[m] if p["position"] is not None],
            "token_choices": sorted({r.token_choice for r in rs if r.token_choice}),
            # how many responses named each approximation (EngineResult.approximations)
            "approximations": dict(sorted(Counter(a for r in rs for a in r.approximations).items())),
            # exact repeats: "promoted" (exact path computed after the response), "inline" (prefilled exactly)
            "exact_repeats": dict(sorted(Counter(r.exact_repeat for r in rs if r.exact_repeat).items())),
            "promotion_s": sum(r.promotion_s for r in rs),  # after the responses: in no TTFT, but compute spent
            "tie_guarded": sum(r.tie_guard is not None for r in rs),  # prefilled again exactly (CacheConfig.exact.tie_guard)
            # answers moved onto exact KV while decoding (CacheConfig.exact.tie_guard_decode), and the seconds they paused
            "tie_guard_switches": sum(r.tie_guard_switch is not None for r in rs),
            "tie_guard_switch_s": sum(r.tie_guard_switch_s or 0.0 for r in rs),
            "ttft_sum_s": sum(ttft),
        }
        approx = [(r, f) for r, f in zip(rs, full) if r.prefix_hit_tokens + r.question_tokens < r.prompt_tokens
                  and r.chunks_hit > 0]  # served partly from non-prefix reuse: where fidelity can move
        results["modes"][m]["n_approximate"] = len(approx)
        results["modes"][m]["rouge_l_vs_full_approximate"] = (
            statistics.fmean(rouge_l(r.text, f.text) for r, f in approx) if approx else None)
        results["modes"][m]["requests"] = [request_record(warmup + k, r, f) for k, (r, f) in enumerate(zip(rs, full))]
    base_full = results["modes"]["full"]["ttft_median_s"]
    base_prefix = results["modes"].get("prefix", {}).get("ttft_median_s")
    for m, row in results["modes"].items():
        row["speedup_vs_full"] = base_full / row["ttft_median_s"]
        row["speedup_vs_prefix"] = (base_prefix / row["ttft_median_s"]) if base_prefix else None

    from cachedrag_bench.planning import benchmark_planning

    results["planning"] = benchmark_planning(n_chunks=args.planning_chunks, n_requests=1_000, top_k=args.top_k,
                                             chunk_tokens=args.chunk_tokens)
    if not args.skip_simulation:
        results["policy_simulation"] = _simulate()
    _print_table(results)
    if args.json_out:
        write_json(results, args.json_out)
    return 0


def _number(option: str, text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ConfigError(f"{option}: {text!r} is not a number") from None
    if not value >= 0 or value == float("inf"):
        raise ConfigError(f"{option}: {text!r} must be a finite number >= 0")
    return value


def tie_guard_setting(spec: str) -> dict:
    """``--tie-guards`` spec -> CacheConfig fields: a gap 'G' (``exact.tie_guard``, nats).

    >>> tie_guard_setting("0.3")
    {'exact': {'tie_guard': 0.3}}
    """
    out = {"exact": {"tie_guard": _number("--tie-guards", spec)}}
    from cachedrag.kvcache.config import CacheConfig

    try:
        CacheConfig().replace(**out)  # validated now: a bad spec fails before the model loads
    except ConfigError as exc:
        raise ConfigError(f"--tie-guards: {spec!r}: {exc}") from None
    return out


def _settings(text: str, parse) -> dict[str, dict]:
    """A comma-separated row option (``--tie-guards``, ``--cache-rows``, ...) -> {spec: its CacheConfig fields}."""
    return {spec: parse(spec) for spec in [x.strip() for x in text.split(",") if x.strip()]}


def plan_letters(actions: list[str] | None) -> str | None:
    """A prefill's segment actions (``EngineResult.segment_actions``) as one letter each: T tree,
    R reuse, F fresh, system first.

    >>> plan_letters(["tree", "fresh", "reuse", "fresh"])
    'TFRF'
    """
    return None if actions is None else "".join(a[0].upper() for a in actions)


def request_record(index: int, r, f) -> dict:
    """One counted request of a row in the JSON: its TTFT and answer time, the plan that made the
    answer and, when the tie guard prefilled it again, the approximate plan before (``plan_letters``),
    the answer token where the tie guard during decoding moved it onto exact KV (``switch``), the
    approximate prefill's first-token top-2 gap (``first_token_gap``), how many tokens a whole answer's
    rewind took back (``rewound``), and whether its first token as decoded (``first_token_matches``)
    and whole answer are full prefill's."""
    return {"request": index, "ttft_s": r.ttft_s, "total_s": r.total_s, "plan": plan_letters(r.segment_actions),
            "guarded_plan": plan_letters(r.tie_guard_actions), "first_token_gap": r.first_token_gap,
            "tie_guard": r.tie_guard,
            "switch": r.tie_guard_switch, "switch_s": r.tie_guard_switch_s, "agreed": r.tie_guard_agreed,
            "rewound": r.tie_guard_rewound,
            "exact_repeat": r.exact_repeat, "first_token_match": first_token_matches(r, f.token_ids),
            "answer_match": r.token_ids == f.token_ids}


def cache_row_setting(spec: str) -> dict:
    """``--cache-rows`` spec -> CacheConfig fields: FIELD=VALUE pairs joined by '+' (a group's field
    as GROUP.FIELD), each VALUE a number, true/false, none or a word, validated by CacheConfig before
    any model loads.

    >>> cache_row_setting("precision.fresh=bfloat16+exact.tie_guard=0.25")
    {'precision': {'fresh': 'bfloat16'}, 'exact': {'tie_guard': 0.25}}
    >>> cache_row_setting("exact.repeats=0+recompute_ratio=none")
    {'exact': {'repeats': 0}, 'recompute_ratio': None}
    """
    from cachedrag.kvcache.config import CacheConfig

    out: dict = {}
    for pair in spec.split("+"):
        name, sep, text = (x.strip() for x in pair.partition("="))
        if not sep or not name or not text:
            raise ConfigError(f"--cache-rows: {pair!r} in {spec!r} is not FIELD=VALUE")
        group, _, field = name.rpartition(".")
        target = out.setdefault(group, {}) if group else out
        if field in target:
            raise ConfigError(f"--cache-rows: {spec!r} sets {name} twice")
        target[field] = _scalar(text)
    try:
        CacheConfig().replace(**out)  # validated now: a bad spec fails before the model loads
    except (ConfigError, TypeError, ValueError) as exc:
        raise ConfigError(f"--cache-rows: {spec!r}: {exc}") from None
    return out


def _scalar(text: str):
    """A ``--cache-rows`` VALUE: an int, a float, a bool, None, or the word itself."""
    lowered = text.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    if lowered == "none":
        return None
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def _repeat_setting(spec: str) -> dict:
    """``--exact-repeats`` spec -> CacheConfig fields: 'off', 'N' or 'N:inline'."""
    if spec == "off":
        return {"exact": {"repeats": 0}}
    n, _, when = spec.partition(":")
    if not n.isdigit() or when not in ("", "inline", "after_response"):
        raise ConfigError(f"--exact-repeats: {spec!r} is not 'off', N or N:inline")
    return {"exact": {"repeats": int(n), "repeats_when": when or "after_response"}}


def recompute_setting(spec: str) -> dict:
    """``--recompute-dtypes`` spec -> CacheConfig fields.

    >>> recompute_setting("bfloat16@0.35")
    {'precision': {'recompute': 'bfloat16'}, 'recompute_ratio': 0.35}
    >>> recompute_setting("float32")
    {'precision': {'recompute': 'float32'}}
    """
    from cachedrag.kvcache.config import ROW_DTYPES

    dtype, _, ratio = spec.partition("@")
    if dtype not in ROW_DTYPES:
        raise ConfigError(f"--recompute-dtypes: {spec!r}: the dtype must be one of {list(ROW_DTYPES)}")
    out: dict = {"precision": {"recompute": dtype}}
    if ratio:
        out["recompute_ratio"] = _ratio("--recompute-dtypes", spec, ratio)
        if not 0.0 <= out["recompute_ratio"] <= 1.0:
            raise ConfigError(f"--recompute-dtypes: {spec!r}: the ratio must be in [0, 1]")
    return out


def _ratio(option: str, spec: str, ratio: str) -> float:
    """The ``@RATIO`` of a ``spec`` given to ``option``, as a float (one clear error otherwise)."""
    try:
        return float(ratio)
    except ValueError:
        raise ConfigError(f"{option}: {spec!r}: {ratio!r} is not a ratio") from None


def _simulate() -> dict:
    from cachedrag.kvcache.simulator import compare_policies, make_workload

    t = time.perf_counter()
    table = compare_policies(make_workload(n_requests=3_000, n_docs=2_000, top_k=5, seed=0))
    out = table.to_dict() if hasattr(table, "to_dict") else {"table": str(table)}
    out["seconds"] = round(time.perf_counter() - t, 2)
    return out


def parting_line(mode: str, div: dict) -> str:
    """One printed line of a mode's ``answer_divergence`` (``bench.metrics.divergence_summary``)."""
    return (f"answers parting from full, {mode}: {div['parted']} of {div['answers']} (first token "
            f"{div['first_token_parted']}), median position {div['position_median']:g}, full's own top-2 gap there "
            f"{div['reference_gap_median']:.3f} nats (under {div['near_tie']:g}: {div['parted_at_reference_near_tie']}); "
            f"a gap guard at {div['near_tie']:g} on every step would prefill {div['step_guard_prefills']} of "
            f"{div['approximate']} approximate answers again, preventing {div['step_guard_prevents']}")


def _print_table(results: dict) -> None:
    cols = ["ttft_median_s", "ttft_p95_s", "computed_token_fraction", "chunk_hit_rate", "rouge_l_vs_full",
            "rouge_l_vs_full_approximate", "first_token_match_vs_full", "teacher_forced_top1", "teacher_forced_kl",
            "speedup_vs_full", "speedup_vs_prefix"]
    head = ["mode", "ttft_med", "ttft_p95", "computed", "hit_rate", "rougeL", "rougeL~", "tok1_match", "tf_top1",
            "tf_kl", "x_full", "x_prefix"]
    print(f"\nTTFT over {results['n_requests']} requests ({results['config']['questions']})")
    print("  ".join([f"{head[0]:>14}"] + [f"{h:>10}" for h in head[1:]]))
    for m, row in results["modes"].items():
        vals = [f"{row[c]:.3f}" if isinstance(row[c], float) else "-" for c in cols]
        print("  ".join([f"{m:>14}"] + [f"{v:>10}" for v in vals]))
    print("rougeL~: ROUGE-L vs full over requests served partly from non-prefix chunk reuse; tf_*: teacher-forced "
          "over full's answer")
    for m, row in results["modes"].items():
        div = row.get("answer_divergence")
        if div and div["parted"]:
            print(parting_line(m, div))
    for m, row in results["modes"].items():
        if row.get("tie_guard_switches"):
            print(f"tie guard during decoding, {m}: {row['tie_guard_switches']} answers moved onto exact KV "
                  f"({row['tie_guard_switch_s']:.2f} s of exact prefills); whole answers equal to full's "
                  f"{row['answer_match_vs_full']:.3f}; answer time median {row['total_median_s']:.3f} s, "
                  f"mean {row['total_mean_s']:.3f} s")
    for m, row in results["modes"].items():
        if row.get("exact_repeats"):
            print(f"exact repeats, {m}: {row['exact_repeats']}; {row['promotion_s']:.2f} s computing exact paths "
                  f"after responses (TTFT sum {row['ttft_sum_s']:.2f} s)")
    p = results["planning"]
    print(f"planning: {p['plan_us_mean']} us mean, {p['plan_us_p99']} us p99 per request with {p['n_chunks']} cached chunks")
