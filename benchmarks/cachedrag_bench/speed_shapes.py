"""``cachedrag bench speed --shape S``: our runner against llama.cpp at a real model size on the CPU.

Owns: the real-shape CPU speed suite. ``S`` is one of ``cpu_shapes.CPU_SHAPES`` (random weights of
the published config, the default model's tokenizer; ``cpu_shapes.py`` makes and caches them and the
GGUFs). One RAG prompt (system prompt + ``--chunks`` chunks of ``--chunk-tokens`` stdlib tokens + a
question) and, per weight format, our runner beside llama.cpp on a GGUF of the same weights in the
same precision class (``bf16`` / F16, ``int8`` / Q8_0, ``int4`` / Q4_K_M), measured alternately
(ours, theirs, then theirs, ours in the next round):

- full prefill of the prompt (seconds, tokens/s) and greedy decode ms/token after it;
- RSS each adds to the process when loaded (our runner: loaded from the very GGUF llama.cpp runs,
  as a user's file loads, packed layer by layer; without llama.cpp (no GGUFs) from the random
  weights' Hugging Face directory; plus warm-up buffers; llama.cpp: the touched pages of its mapped
  GGUF, its buffers and KV), and our runner's resident weight bytes (``weights_gib``);
- unless ``--no-reuse``: TTFT after request A has run (its chunks cached: ours in ``cachedrag``
  mode, llama.cpp with ``LlamaRAMCache`` and its context's common-prefix reuse), for request B with
  the same chunks in a new order (reversed) and another question: ours reuses every chunk;
  llama.cpp reuses the common prefix (the system prompt). Beside them llama.cpp's full prefill of
  B's prompt (from the rounds above).

Formats run one after another in one process (one model in memory at a time). ``--json OUT``
writes ``{"config", "formats": {fmt: {...}}, "targets", "notes"}``.
Does not own: the default-model speed suite (``speed.py``) or the artifacts (``cpu_shapes.py``).
"""

from __future__ import annotations

import gc
import statistics
import time

from cachedrag_bench import write_json

SYSTEM_PROMPT = ("You are a helpful assistant. Answer the question using the Python documentation excerpts "
                 "given by the user. Be brief.")
#: our format -> (runner weights, llama.cpp GGUF type)
PAIRS = {"bf16": ("dense", "F16"), "int8": ("int8", "Q8_0"), "int4": ("int4", "Q4_K_M")}


def add_arguments(parser) -> None:
    """The flags of the real-shape mode (``bench speed`` adds them to its own)."""
    parser.add_argument("--formats", default="bf16,int8,int4",
                        help="with --shape: our weight formats, each beside llama.cpp's (bf16/F16, int8/Q8_0, "
                        "int4/Q4_K_M), comma-separated")
    parser.add_argument("--chunks", type=int, default=5, help="with --shape: chunks in the RAG prompt")
    parser.add_argument("--chunk-tokens", type=int, default=512, help="with --shape: tokens per chunk")
    parser.add_argument("--no-reuse", action="store_true", help="with --shape: skip the chunk-reuse TTFT arms")
    parser.add_argument("--anchor-buffers", choices=("repack", "plain"), default="repack",
                        help="with --shape: llama.cpp's weights in its repacked CPU buffers (its default) or plain ones")
    parser.add_argument("--prepare-only", action="store_true",
                        help="with --shape: make the cached artifacts (random weights, GGUFs) and stop")


def _rss() -> int:
    """This process's resident set in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


class _Ours:
    """Times our runner: full prefill of token ids, then greedy decode steps."""

    def __init__(self, runner):
        self.runner = runner

    def time(self, ids: list[int], new_tokens: int) -> tuple[float, float]:
        """(prefill seconds, decode seconds per token)."""
        import torch

        r = self.runner
        kv = r.new_kv(len(ids) + new_tokens + 1)
        t0 = time.perf_counter()
        token = int(r.prefill(torch.tensor(ids), kv=kv).argmax())
        prefill = time.perf_counter() - t0
        t1 = time.perf_counter()
        for step in range(new_tokens):
            token = int(r.decode_step(token, len(ids) + step, kv).argmax())
        return prefill, (time.perf_counter() - t1) / new_tokens


def _check(args) -> str | None:
    formats = [f.strip() for f in args.formats.split(",") if f.strip()]
    if not formats or any(f not in PAIRS for f in formats):
        return f"--formats takes a comma-separated subset of {', '.join(PAIRS)}, got {args.formats!r}"
    if args.chunks < 1 or args.chunk_tokens < 16 or args.rounds < 1 or args.new_tokens < 1:
        return "--chunks, --rounds and --new-tokens must be at least 1 and --chunk-tokens at least 16"
    return None


def run(args) -> int:
    import sys

    from cachedrag_bench import cpu_shapes
    from cachedrag_bench.anchor import llama_cpp_available

    bad = _check(args)
    if bad:
        print(f"cachedrag: error: {bad}", file=sys.stderr)
        return 2
    formats = [f.strip() for f in args.formats.split(",") if f.strip()]
    anchor = llama_cpp_available()
    notes = [] if anchor else ["llama_cpp not importable (make anchor): llama.cpp arms skipped"]
    t0 = time.perf_counter()
    artifacts = cpu_shapes.prepare(args.shape, [PAIRS[f][1] for f in formats] if anchor else [])
    prepare_s = time.perf_counter() - t0
    if args.prepare_only:
        for name, path in artifacts.items():
            print(f"{name}: {path}")
        print(f"prepared in {prepare_s:.0f}s")
        return 0
    results = measure(args, formats, anchor)
    results["config"]["prepare_s"] = prepare_s
    results["notes"] += notes
    results["targets"] = targets(results)
    print_table(results)
    if args.json_out:
        write_json(results, args.json_out)
    return 0


def _requests(tokenizer, chunks: int, chunk_tokens: int):
    """Request A (chunks in retrieval order, question 0) and B (the same chunks reversed, question 1)."""
    from cachedrag_bench.workload import build_workload

    work = build_workload(tokenizer, top_k=chunks, chunk_tokens=chunk_tokens, n_requests=8, seed=0)
    a = (list(work.retrieved[0]), work.questions[0])
    other = next((q for q in work.questions if q != a[1]), a[1] + " Explain briefly.")
    return a, (a[0][::-1], other)


def measure(args, formats: list[str], anchor: bool) -> dict:
    import torch

    from cachedrag.model.runner import default_threads, set_threads
    from cachedrag_bench import cpu_shapes

    threads = int(args.threads.split(",")[0]) if args.threads else default_threads()
    set_threads(threads)
    tokenizer = cpu_shapes.load_tokenizer(args.shape)
    req_a, req_b = _requests(tokenizer, args.chunks, args.chunk_tokens)
    results = {"config": {"shape": args.shape, "threads": threads, "rounds": args.rounds,
                          "new_tokens": args.new_tokens, "chunks": args.chunks, "chunk_tokens": args.chunk_tokens,
                          "torch": torch.__version__, "fields": cpu_shapes.CPU_SHAPES[args.shape][1]},
               "formats": {}, "notes": []}
    for fmt in formats:
        results["formats"][fmt] = _measure_format(args, fmt, threads, anchor, req_a, req_b)
        gc.collect()
    probe = results["formats"][formats[0]]
    results["config"]["prompt_tokens"] = probe["prompt_tokens"]
    return results


def _measure_format(args, fmt: str, threads: int, anchor: bool, req_a, req_b) -> dict:
    """Ours in ``fmt`` beside llama.cpp's GGUF of the same class: load, rounds, reuse arms."""
    from cachedrag.engine import CachedEngine
    from cachedrag.model.runner import ModelRunner
    from cachedrag.model.weight_views import resident_bytes
    from cachedrag_bench import cpu_shapes

    weights, gguf_type = PAIRS[fmt]
    base = _rss()
    t0 = time.perf_counter()
    if anchor:  # ours loads the very GGUF llama.cpp runs, as a user's file loads (its RSS comparable)
        source = f"gguf {gguf_type}"
        runner = ModelRunner.from_pretrained(str(cpu_shapes.gguf_path(args.shape, gguf_type)), dtype="bfloat16",
                                             weights=weights, threads=threads, warmup=False)
    else:
        source = "hf bf16"
        model, tokenizer = cpu_shapes.load_hf(args.shape)
        runner = ModelRunner(model, tokenizer, dtype="bfloat16", weights=weights, threads=threads,
                             release_weights=True)  # the model is this runner's alone
        del model
    ours_weights = resident_bytes(runner.model, (runner.fast_layers, runner.fast_head))
    runner.warmup(512, 4)
    ours_load = time.perf_counter() - t0
    ours_rss = _rss() - base
    probe = CachedEngine(runner)
    ids = {k: [t for s in probe.prompts.chat(chunks, q, SYSTEM_PROMPT) for t in s.ids]
           for k, (chunks, q) in (("a", req_a), ("b", req_b))}
    timers = {"ours": _Ours(runner)}
    row = {"ours": {"weights": weights, "source": source, "numerics": runner.numerics.tag, "load_s": ours_load,
                    "rss_gib": ours_rss / 2**30,
                    "weights_gib": ours_weights / 2**30, "decode_step": runner.decode_step_kind},
           "prompt_tokens": len(ids["b"])}
    theirs = None
    if anchor:
        from cachedrag_bench.anchor import LlamaCppTimer

        before = _rss()
        t1 = time.perf_counter()
        theirs = LlamaCppTimer(cpu_shapes.gguf_path(args.shape, gguf_type), threads,
                               n_ctx=max(map(len, ids.values())) + args.new_tokens + 64,
                               extra_buffers=args.anchor_buffers == "repack")
        theirs.time(ids["b"][:512], 4)
        row["llamacpp"] = {"gguf": gguf_type, "buffers": args.anchor_buffers, "load_s": time.perf_counter() - t1,
                           "rss_gib": (_rss() - before) / 2**30}
        timers["llamacpp"] = theirs
    samples = {name: ([], []) for name in timers}
    for r in range(args.rounds):
        for name in (list(timers) if r % 2 == 0 else list(timers)[::-1]):
            p, d = timers[name].time(ids["b"], args.new_tokens)
            samples[name][0].append(p)
            samples[name][1].append(d)
    for name, (p, d) in samples.items():
        row[name].update(prefill_s=statistics.median(p), decode_ms_per_token=1000 * statistics.median(d),
                         prefill_tokens_per_s=len(ids["b"]) / statistics.median(p), prefill_samples_s=p)
    if not args.no_reuse:
        row["reuse"] = _reuse(runner, theirs, req_a, req_b, ids)
    if theirs is not None:
        theirs.close()
    del runner, timers, probe
    return row


#: fidelity levels timed on request B (config.FIDELITY_PRESETS): the default, and "fast" (10% recompute;
#: order-aware, so a cached order holding B's chunks is served as an exact prefix, the order changed)
REUSE_LEVELS = ("balanced", "fast")


def _reuse(runner, theirs, req_a, req_b, ids) -> dict:
    """TTFT of request B after A (every chunk of B cached, in a new order): ours in ``cachedrag`` mode
    at each of ``REUSE_LEVELS`` (engines sharing one chunk cache), llama.cpp with its prompt cache;
    A's own TTFT (a cold cache) beside them. Alternating ours / theirs."""
    from cachedrag.config import EngineConfig
    from cachedrag.engine import CachedEngine

    first = CachedEngine(runner, config=EngineConfig(fidelity=REUSE_LEVELS[0]))
    engines = {level: first if i == 0 else CachedEngine(runner, config=EngineConfig(fidelity=level),
                                                         manager=first.manager)
               for i, level in enumerate(REUSE_LEVELS)}
    out: dict = {}

    def ours(name, engine, req):
        r = engine.generate(req[0], req[1], SYSTEM_PROMPT, max_new_tokens=1)
        out[f"ours_{name}"] = {"ttft_s": r.ttft_s, "chunks_hit": r.chunks_hit, "computed_tokens": r.computed_tokens,
                               "recomputed_tokens": r.recomputed_tokens, "prompt_tokens": r.prompt_tokens,
                               "prefix_hit_tokens": r.prefix_hit_tokens, "chunk_order": r.chunk_order,
                               "approximations": r.approximations}

    def llama(name, key):
        t0 = time.perf_counter()
        theirs.llm.create_completion(ids[key], max_tokens=1, temperature=0.0)
        out[f"llamacpp_{name}"] = {"ttft_s": time.perf_counter() - t0}

    if theirs is not None:
        import llama_cpp

        theirs.llm.reset()
        theirs.llm.set_cache(llama_cpp.LlamaRAMCache(capacity_bytes=4 << 30))
    ours("cold", first, req_a)
    if theirs is not None:
        llama("cold", "a")
        llama("prompt_cache_new_order", "b")
    for level, engine in engines.items():
        ours(f"cached_{level}", engine, req_b)
    return out


def targets(results: dict) -> dict:
    """The issue's targets that these figures decide (ratio, met)."""
    out = {}
    f = results["formats"]
    for fmt, label in (("int4", "Q4_K_M"), ("int8", "Q8_0")):
        row = f.get(fmt, {})
        if "llamacpp" in row:
            ratio = row["ours"]["decode_ms_per_token"] / row["llamacpp"]["decode_ms_per_token"]
            out[f"{fmt} decode <= llama.cpp {label}"] = {"ratio": ratio, "met": ratio <= 1.0}
    for fmt, row in f.items():
        if "llamacpp" in row:
            ratio = row["ours"]["prefill_tokens_per_s"] / row["llamacpp"]["prefill_tokens_per_s"]
            out[f"{fmt} prefill tok/s >= llama.cpp {row['llamacpp']['gguf']}"] = {"ratio": ratio, "met": ratio >= 1.0}
    reuse = f.get("int4", {}).get("reuse", {})
    if "llamacpp_prompt_cache_new_order" in reuse:
        full = f["int4"]["llamacpp"]["prefill_s"]
        cached = reuse["llamacpp_prompt_cache_new_order"]["ttft_s"]
        for level in REUSE_LEVELS:
            ours = reuse[f"ours_cached_{level}"]["ttft_s"]
            out[f"int4 TTFT all cached ({level}) >= 8x below llama.cpp Q4_K_M full prefill"] = {
                "ratio": full / ours, "met": full / ours >= 8}
            out[f"int4 TTFT all cached ({level}) >= 3x below llama.cpp Q4_K_M prompt cache, new order"] = {
                "ratio": cached / ours, "met": cached / ours >= 3}
    return out


def print_table(results: dict) -> None:
    cfg = results["config"]
    print(f"\nspeed at the {cfg['shape']} shape (random weights), {cfg['prompt_tokens']}-token RAG prompt "
          f"({cfg['chunks']} x {cfg['chunk_tokens']}), {cfg['threads']} threads, {cfg['new_tokens']} decode steps, "
          f"median of {cfg['rounds']} alternating rounds")
    print(f"{'system':<26} {'prefill tok/s':>13} {'prefill s':>10} {'decode ms/tok':>14} {'RSS GiB':>8} {'load s':>7} "
          f"{'weights GiB':>11}")
    for fmt, row in results["formats"].items():
        for who in ("ours", "llamacpp"):
            if who in row:
                r = row[who]
                name = f"cachedrag-{fmt}" if who == "ours" else f"llama.cpp-{r['gguf']}"
                print(f"{name:<26} {r['prefill_tokens_per_s']:>13.1f} {r['prefill_s']:>10.2f} "
                      f"{r['decode_ms_per_token']:>14.1f} {r['rss_gib']:>8.2f} {r['load_s']:>7.1f} "
                      f"{r.get('weights_gib', float('nan')):>11.2f}")
        for key, value in row.get("reuse", {}).items():
            extra = {k: v for k, v in value.items() if k in ("computed_tokens", "prompt_tokens", "chunk_order")}
            print(f"  {fmt} TTFT {key:<34} {value['ttft_s']:>8.2f}s {extra if extra else ''}")
    for note in results["notes"]:
        print(f"note: {note}")
    print("\ntargets:")
    for name, row in results["targets"].items():
        print(f"  {'MET    ' if row['met'] else 'NOT MET'} {name}: {row['ratio']:.2f}")
