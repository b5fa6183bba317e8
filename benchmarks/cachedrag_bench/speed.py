"""``cachedrag bench speed``: prefill and decode speed of our runner per dtype, against
transformers and llama.cpp on the same model, plus the first-request and cache-miss penalties.

Owns: the speed suite. One RAG prompt (system prompt + top-5 stdlib chunks of 256 tokens + a
question, ~1,300 tokens) is timed through every system, interleaved round by round at each
thread count (medians of the rounds): full-prefill seconds -> tokens/s, and greedy decode
ms/token (one token per step, no speculation).

- ``cachedrag-fp32`` / ``-bf16`` / ``-int8`` / ``-int8-dynamic`` / ``-int4``: ``ModelRunner`` (fast path)
  ``prefill`` + ``decode_step`` (``-int8-dynamic`` only where its VNNI kernel runs).
  Their decode is the runner's default step: the fused native one where it applies (fp32, bf16,
  int8, int4; ``model/fused_decode.py``); ``cachedrag-fp32-torch`` / ``-bf16-torch`` / ``-int8-torch`` /
  ``-int4-torch`` time the op-by-op torch step (``decode_step="torch"``) beside it, ``-compiled`` its
  ``compile=True`` form; ``cachedrag-int4-bf16head`` int4 with the LM head in bf16 (``head_weights="dense"``,
  the reference of int4's int8 head).
- ``transformers-fp32`` / ``-bf16``: HF ``generate`` (sdpa) with 1 and 1 + N new tokens.
- ``llamacpp-f32`` / ``llamacpp-q4_1``: llama.cpp through llama-cpp-python (only when importable),
  on an F32 GGUF dequantised from the shipped Q4_1 file and on that Q4_1 file.

Names carry no suffix at the default thread count and ``@<n>t`` at others. Also:
``first_request_ratio`` (a fresh process: first ``full`` request after ``from_pretrained`` /
the median of later ones), ``miss_ratio`` (``cachedrag`` mode on a cold cache / ``full``, TTFT
medians, interleaved) and ``end_to_end`` (median TTFT of the ``bench ttft`` stream in
``cachedrag`` mode + 128 x decode ms/token, per dtype, against llama.cpp Q4_1's full prefill +
128 x its decode) and ``fidelity`` (each other runner against fp32, teacher-forced through the decode
step on fp32's greedy continuation of a few prompts: top-1 agreement and KL per next token). ``--json OUT`` writes ``{"systems": {name: {"dtype", "threads",
"prefill_tokens_per_s", "decode_ms_per_token"}}, "first_request_ratio", "miss_ratio", ...}``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

from cachedrag_bench import speed_shapes, write_json
from cachedrag_bench.cpu_shapes import CPU_SHAPES

SYSTEM_PROMPT = (
    "You are a helpful assistant. Answer the question using the Python documentation excerpts "
    "given by the user. Be brief."
)
ALL_SYSTEMS = ("cachedrag-fp32", "cachedrag-bf16", "cachedrag-int8", "cachedrag-int8-dynamic", "cachedrag-int4",
               "cachedrag-int4-bf16head", "cachedrag-fp32-torch", "cachedrag-bf16-torch", "cachedrag-int8-torch",
               "cachedrag-int4-torch",
               "cachedrag-fp32-compiled", "cachedrag-int8-compiled", "cachedrag-int4-compiled",
               "transformers-fp32", "transformers-bf16", "llamacpp-f32", "llamacpp-q4_1")
_NUMERICS = {"cachedrag-fp32": ("float32", "dense"), "cachedrag-bf16": ("bfloat16", "dense"),
             "cachedrag-int8": ("bfloat16", "int8"), "cachedrag-int8-dynamic": ("bfloat16", "int8-dynamic"),
             "cachedrag-int4": ("bfloat16", "int4"), "cachedrag-fp32-compiled": ("float32", "dense"),
             "cachedrag-int8-compiled": ("bfloat16", "int8"), "cachedrag-int4-compiled": ("bfloat16", "int4"),
             "cachedrag-fp32-torch": ("float32", "dense"), "cachedrag-bf16-torch": ("bfloat16", "dense"),
             "cachedrag-int8-torch": ("bfloat16", "int8"), "cachedrag-int4-torch": ("bfloat16", "int4"),
             "cachedrag-int4-bf16head": ("bfloat16", "int4")}
# ``decode_step="torch"`` runners: the op-by-op eager step, beside the default (the fused native step
# where it applies, model/fused_decode.py); prefill is the default's, so no miss probe of their own
_TORCH_STEP = ("cachedrag-fp32-torch", "cachedrag-bf16-torch", "cachedrag-int8-torch", "cachedrag-int4-torch")
# ``head_weights="dense"`` runners: the LM head in bf16 (the reference of int4's int8 head), for fidelity and
# decode beside the default; the same prefill KV, so no miss probe of their own
_DENSE_HEAD = ("cachedrag-int4-bf16head",)
# ``compile=True`` runners (model/compiled.py): timed at the default thread count only (the packages'
# kernels are built for one thread count); their prefill is the eager one, so no miss probe of their own
_COMPILED = ("cachedrag-fp32-compiled", "cachedrag-int8-compiled", "cachedrag-int4-compiled")
E2E_TOKENS = 128


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--systems", default=",".join(ALL_SYSTEMS), help="comma-separated subset of " + ",".join(ALL_SYSTEMS))
    parser.add_argument("--threads", default=None, help="thread counts, the first is the default (default: N,1 with N "
                        "the cores this process may use)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds per thread count (medians)")
    parser.add_argument("--new-tokens", type=int, default=24, help="decode steps timed per round")
    parser.add_argument("--stream", type=int, default=14, help="requests of the ttft stream for end_to_end (0: skip it)")
    parser.add_argument("--fidelity-prompts", type=int, default=3, help="prompts of the per-dtype fidelity check (0: skip)")
    parser.add_argument("--fidelity-tokens", type=int, default=32, help="teacher-forced tokens per fidelity prompt")
    parser.add_argument("--skip-first-request", action="store_true", help="skip the fresh-process first-request probe")
    parser.add_argument("--json", dest="json_out", help="write results as JSON to this path")
    parser.add_argument("--shape", default=None, choices=tuple(CPU_SHAPES),
                        help="time a random-weight model of this real shape against llama.cpp instead of the default "
                        "model (speed_shapes.py; artifacts cached under the cache home)")
    speed_shapes.add_arguments(parser)


def _bad_arguments(args) -> str | None:
    """What is wrong with the counts given (None: nothing), checked before anything is measured."""
    if args.rounds < 1 or args.new_tokens < 1:
        return "--rounds and --new-tokens must be at least 1"
    if args.stream == 1 or args.stream < 0:
        return "--stream must be 0 (skip end_to_end) or at least 2 (its first quarter, at least one request, is not timed)"
    if args.fidelity_prompts < 0 or args.fidelity_tokens < 1:
        return "--fidelity-prompts must be at least 0 and --fidelity-tokens at least 1"
    if args.threads is not None:
        counts = [t.strip() for t in args.threads.split(",")]
        if not all(t.isdigit() and int(t) > 0 for t in counts):
            return f"--threads must be positive whole numbers separated by commas, got {args.threads!r}"
    return None


def _median(xs):
    return statistics.median(xs) if xs else None


class _Ours:
    def __init__(self, runner):
        self.runner = runner

    def time(self, ids, new_tokens: int) -> tuple[float, float]:
        import torch

        r = self.runner
        kv = r.new_kv(len(ids) + new_tokens + 1)
        t0 = time.perf_counter()
        logits = r.prefill(torch.tensor(ids), kv=kv)
        prefill = time.perf_counter() - t0
        token = int(logits.argmax())
        t1 = time.perf_counter()
        for step in range(new_tokens):
            token = int(r.decode_step(token, len(ids) + step, kv).argmax())
        return prefill, (time.perf_counter() - t1) / max(1, new_tokens)


class _Transformers:
    def __init__(self, model):
        self.model = model

    def time(self, ids, new_tokens: int) -> tuple[float, float]:
        import torch

        x = torch.tensor([ids])
        kw = {"do_sample": False, "pad_token_id": 0}
        with torch.inference_mode():
            t0 = time.perf_counter()
            self.model.generate(x, max_new_tokens=1, min_new_tokens=1, **kw)
            prefill = time.perf_counter() - t0
            t1 = time.perf_counter()
            self.model.generate(x, max_new_tokens=1 + new_tokens, min_new_tokens=1 + new_tokens, **kw)
            total = time.perf_counter() - t1
        return prefill, max(0.0, total - prefill) / max(1, new_tokens)


def run(args: argparse.Namespace) -> int:
    import torch

    from cachedrag_bench.anchor import LlamaCppTimer, f32_gguf_path, llama_cpp_available
    from cachedrag_bench.workload import build_workload
    from cachedrag.model.loader import default_gguf_path, load_model
    from cachedrag.model.runner import ModelRunner, default_threads, set_threads
    from cachedrag.model.weights import vnni_available

    if args.shape:
        return speed_shapes.run(args)
    bad = _bad_arguments(args)
    if bad:
        print(f"cachedrag: error: {bad}", file=sys.stderr)
        return 2
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = [s for s in systems if s not in ALL_SYSTEMS]
    if unknown:
        print(f"cachedrag: error: unknown systems {unknown}; choose from {', '.join(ALL_SYSTEMS)}", file=sys.stderr)
        return 2
    notes = []
    if not llama_cpp_available():
        dropped = [s for s in systems if s.startswith("llamacpp")]
        systems = [s for s in systems if not s.startswith("llamacpp")]
        if dropped:
            notes.append("llama_cpp not importable (pip install -e './benchmarks[anchor]'): llama.cpp systems skipped")
    if "cachedrag-int8-dynamic" in systems and not vnni_available():
        systems.remove("cachedrag-int8-dynamic")
        notes.append("no VNNI on this CPU: cachedrag-int8-dynamic skipped")
    default = default_threads()
    threads = [int(t) for t in args.threads.split(",")] if args.threads else sorted({default, 1}, reverse=True)

    need = {"float32"} | {_NUMERICS[s][0] for s in systems if s in _NUMERICS}
    need |= {"bfloat16"} if "transformers-bf16" in systems else set()
    models = {d: load_model(None, dtype=getattr(torch, d)) for d in sorted(need)}
    # int4 quantises the fp32 values (as from_pretrained does), so it gets its own fp32 copy, cast after packing
    runners = {name: ModelRunner(*(load_model(None) if w == "int4" else models[d]), dtype=d, weights=w,
                                 threads=threads[0], compile=name in _COMPILED,
                                 decode_step="torch" if name in _TORCH_STEP else "auto",
                                 head_weights="dense" if name in _DENSE_HEAD else "auto")
               for name, (d, w) in _NUMERICS.items() if name in systems or name == "cachedrag-fp32"}
    tokenizer = runners["cachedrag-fp32"].tokenizer
    work = build_workload(tokenizer, top_k=5, chunk_tokens=256, n_requests=max(args.stream, 2 * args.rounds + 2),
                          seed=0)
    from cachedrag.engine import CachedEngine

    probe = CachedEngine(runners["cachedrag-fp32"])
    segments = probe.prompts.chat(work.retrieved[0], work.questions[0], SYSTEM_PROMPT)
    ids = [t for s in segments for t in s.ids]

    timers = {}
    for name in systems:
        if name.startswith("cachedrag"):
            timers[name] = _Ours(runners[name])
        elif name == "transformers-fp32":
            timers[name] = _Transformers(models["float32"][0])
        elif name == "transformers-bf16":
            timers[name] = _Transformers(models["bfloat16"][0])
    for r in runners.values():
        r.warmup(len(ids), 4)

    results = {"config": {"prompt_tokens": len(ids), "new_tokens": args.new_tokens, "rounds": args.rounds,
                          "threads": threads, "default_threads": threads[0], "torch": torch.__version__},
               "systems": {}, "notes": notes}
    for n_threads in threads:
        set_threads(n_threads)
        anchors = {}
        if "llamacpp-f32" in systems:
            anchors["llamacpp-f32"] = LlamaCppTimer(f32_gguf_path(), n_threads)
        if "llamacpp-q4_1" in systems:
            anchors["llamacpp-q4_1"] = LlamaCppTimer(default_gguf_path(), n_threads)
        here = {name: t for name, t in {**timers, **anchors}.items()
                if n_threads == threads[0] or name not in _COMPILED}
        samples = {name: ([], []) for name in here}
        for name, timer in here.items():  # one untimed pass each: allocator, caches
            timer.time(ids[:256], 2)
        for _ in range(args.rounds):
            for name in systems:
                if name in here:
                    p, d = here[name].time(ids, args.new_tokens)
                    samples[name][0].append(p)
                    samples[name][1].append(d)
        for name in systems:
            if name not in here:
                continue
            p, d = _median(samples[name][0]), _median(samples[name][1])
            key = name if n_threads == threads[0] else f"{name}@{n_threads}t"
            dtype = {"llamacpp-f32": "float32", "llamacpp-q4_1": "q4_1"}.get(name) or (
                runners[name].numerics.tag if name in _NUMERICS
                else ("float32" if name.endswith("fp32") else "bfloat16"))
            results["systems"][key] = {"dtype": dtype, "threads": n_threads, "prefill_tokens_per_s": len(ids) / p,
                                       "decode_ms_per_token": d * 1000, "prefill_s": p}
        for a in anchors.values():
            a.close()
    set_threads(threads[0])

    if args.fidelity_prompts > 0:
        prompts = [[t for seg in probe.prompts.chat(work.retrieved[i], work.questions[i], SYSTEM_PROMPT) for t in seg.ids]
                   for i in range(min(args.fidelity_prompts, len(work.questions)))]
        results["fidelity"] = dtype_fidelity(runners, prompts, args.fidelity_tokens)
    misses = {name: _miss_ratio(r, work, 2 * args.rounds + 2)[1] for name, r in runners.items()
              if (name in systems or name == "cachedrag-fp32") and name not in _COMPILED + _TORCH_STEP + _DENSE_HEAD}
    results["miss_ratio"], results["miss"] = misses["cachedrag-fp32"]["ratio"], misses["cachedrag-fp32"]
    results["miss_by_system"] = misses
    results["end_to_end"] = _end_to_end(runners, work, results["systems"], args.stream) if args.stream else {}
    results["first_request_ratio"] = None
    if not args.skip_first_request:
        results["first_request_ratio"], results["first_request"] = _first_request(threads[0])
    results["targets"] = _targets(results)
    _print(results)
    if args.json_out:
        write_json(results, args.json_out)
    return 0


def dtype_fidelity(runners: dict, prompts: list[list[int]], tokens: int) -> dict:
    """Each dtype against fp32, teacher-forced: fp32's greedy continuation of ``tokens`` tokens is
    the teacher; every runner scores it as generation computes it (a prefill of the prompt, then
    one decode step per teacher token), so each of the ``tokens`` next-token distributions is
    compared at the same context, through the kernels decode runs (for int8-dynamic these differ
    from prefill's: its activations are quantised only for few rows). Per runner:
    ``top1_agreement`` (argmax equal to fp32's), ``kl_mean`` / ``kl_max`` (KL(fp32 || dtype) in
    nats), ``first_token_agreement`` (over prompts)."""
    import torch

    ref = runners["cachedrag-fp32"]

    def score(runner, ids: list[int], teacher: list[int]) -> torch.Tensor:
        kv = runner.new_kv(len(ids) + len(teacher) + 1)
        logits = [runner.prefill(torch.tensor(ids), kv=kv)]  # [V]
        for step, token in enumerate(teacher[:-1]):
            logits.append(runner.decode_step(token, len(ids) + step, kv))  # [V]
        return torch.stack(logits).float().log_softmax(-1)  # [m, V]

    teachers = []
    for ids in prompts:
        kv = ref.new_kv(len(ids) + tokens + 1)
        token = int(ref.prefill(torch.tensor(ids), kv=kv).argmax())
        teacher = [token]
        for step in range(tokens - 1):
            token = int(ref.decode_step(token, len(ids) + step, kv).argmax())
            teacher.append(token)
        teachers.append(teacher)
    ref_logp = [score(ref, ids, t) for ids, t in zip(prompts, teachers)]
    out = {}
    for name, runner in runners.items():
        if name == "cachedrag-fp32":
            continue
        agree, kls, first = [], [], []
        for ids, teacher, lp32 in zip(prompts, teachers, ref_logp):
            lp = score(runner, ids, teacher)  # [m, V]
            same = (lp.argmax(-1) == lp32.argmax(-1)).float()  # [m]
            agree.append(float(same.mean()))
            first.append(float(same[0]))
            kls.append((lp32.exp() * (lp32 - lp)).sum(-1))  # [m]
        kl = torch.cat(kls)
        out[name] = {"top1_agreement": statistics.mean(agree), "kl_mean": float(kl.mean()), "kl_max": float(kl.max()),
                     "first_token_agreement": statistics.mean(first), "prompts": len(prompts), "tokens": tokens}
    return out


def _miss_ratio(runner, work, n: int):
    """TTFT of a request whose chunks are all new (a fresh engine: nothing cached) over ``full``'s
    on the same prompt, ``n`` pairs, the order alternating within a pair (medians). Also the
    medians of total time with one token (``total_ratio``): a generation hands its fresh chunks to
    the store after the first token, so that work shows there, not in TTFT."""
    from cachedrag.config import EngineConfig
    from cachedrag.engine import CachedEngine

    full = CachedEngine(runner, config=EngineConfig(mode="full"))
    miss, base, miss_total, base_total = [], [], [], []
    hits = 0  # chunks a "miss" found cached: 0 unless the stream repeats a chunk within one prompt
    for i in range(n):
        chunks, q = work.retrieved[i % len(work.retrieved)], work.questions[i % len(work.questions)]
        cold = CachedEngine(runner, config=EngineConfig(mode="cachedrag"))
        for which in (("miss", "full") if i % 2 == 0 else ("full", "miss")):
            r = (cold if which == "miss" else full).generate(chunks, q, SYSTEM_PROMPT, max_new_tokens=1)
            hits += r.chunks_hit if which == "miss" else 0
            (miss if which == "miss" else base).append(r.ttft_s)
            (miss_total if which == "miss" else base_total).append(r.total_s)
    detail = {"miss_ttft_s": _median(miss), "full_ttft_s": _median(base), "requests": n,
              "miss_total_s": _median(miss_total), "full_total_s": _median(base_total), "chunks_hit": hits}
    detail["ratio"] = detail["miss_ttft_s"] / detail["full_ttft_s"]
    detail["total_ratio"] = detail["miss_total_s"] / detail["full_total_s"]
    return detail["ratio"], detail


def _end_to_end(runners, work, systems: dict, n: int) -> dict:
    """Median TTFT on the ttft stream in ``cachedrag`` mode (first 25% of requests not counted) +
    ``E2E_TOKENS`` x the dtype's decode ms/token; llama.cpp Q4_1: full prefill + the same tokens."""
    from cachedrag.config import EngineConfig
    from cachedrag.engine import CachedEngine

    out = {}
    skip = max(1, n // 4)
    for name, runner in runners.items():
        if name not in systems or name in _TORCH_STEP:  # the same TTFT as the default step's row
            continue
        engine = CachedEngine(runner, config=EngineConfig(mode="cachedrag"))
        ttft = []
        for i in range(n):
            r = engine.generate(work.retrieved[i], work.questions[i], SYSTEM_PROMPT, max_new_tokens=1)
            if i >= skip:
                ttft.append(r.ttft_s)
        t = _median(ttft)
        out[name] = {"ttft_s": t, "seconds": t + E2E_TOKENS * systems[name]["decode_ms_per_token"] / 1000}
    q4 = systems.get("llamacpp-q4_1")
    if q4 is not None:
        out["llamacpp-q4_1"] = {"ttft_s": q4["prefill_s"],
                                "seconds": q4["prefill_s"] + E2E_TOKENS * q4["decode_ms_per_token"] / 1000}
    return out


_CHILD = """
import json, statistics, sys, time
t0 = time.perf_counter()
from cachedrag_bench.workload import build_workload
from cachedrag.config import EngineConfig
from cachedrag.engine import CachedEngine
from cachedrag.model.runner import ModelRunner
runner = ModelRunner.from_pretrained(threads=int(sys.argv[1]))
load_s = time.perf_counter() - t0
work = build_workload(runner.tokenizer, top_k=5, chunk_tokens=256, n_requests=6, seed=1)
engine = CachedEngine(runner, config=EngineConfig(mode="full"))
ttft = []
for chunks, q in zip(work.retrieved, work.questions):
    ttft.append(engine.generate(chunks, q, sys.argv[2], max_new_tokens=1).ttft_s)
print(json.dumps({"load_s": load_s, "ttft_s": ttft}))
"""


def _first_request(threads: int):
    """A fresh process: ``from_pretrained`` (which warms up), then 6 ``full`` requests; the first
    one's TTFT over the median of the others."""
    proc = subprocess.run([sys.executable, "-c", _CHILD, str(threads), SYSTEM_PROMPT], capture_output=True, text=True,
                          timeout=900)
    if proc.returncode != 0:
        return None, {"error": proc.stderr.strip().splitlines()[-1:] or ["child failed"]}
    data = json.loads(proc.stdout.strip().splitlines()[-1])
    first, later = data["ttft_s"][0], statistics.median(data["ttft_s"][1:])
    return first / later, {"first_ttft_s": first, "later_ttft_s": later, "load_s": data["load_s"]}


def _targets(results: dict) -> dict:
    s = results["systems"]

    def get(name, field):
        return s.get(name, {}).get(field)

    out = {}
    f32, ours32 = get("llamacpp-f32", "decode_ms_per_token"), get("cachedrag-fp32", "decode_ms_per_token")
    if f32 and ours32:
        out["fp32 decode <= llama.cpp F32"] = {"ratio": ours32 / f32, "met": ours32 <= f32}
    bf = get("cachedrag-bf16", "decode_ms_per_token")
    if bf and ours32:
        out["bf16 decode <= 0.6x fp32"] = {"ratio": bf / ours32, "met": bf <= 0.6 * ours32}
    i8, q4 = get("cachedrag-int8", "decode_ms_per_token"), get("llamacpp-q4_1", "decode_ms_per_token")
    if i8 and q4:
        out["int8 decode <= llama.cpp Q4_1"] = {"ratio": i8 / q4, "met": i8 <= q4}
    i8d = get("cachedrag-int8-dynamic", "decode_ms_per_token")
    if i8d and q4:
        out["int8-dynamic decode <= llama.cpp Q4_1"] = {"ratio": i8d / q4, "met": i8d <= q4}
    i4 = get("cachedrag-int4", "decode_ms_per_token")
    if i4 and q4:
        out["int4 decode <= llama.cpp Q4_1"] = {"ratio": i4 / q4, "met": i4 <= q4}
    for name, anchor, label in (("cachedrag-fp32-compiled", f32, "fp32"), ("cachedrag-int8-compiled", q4, "int8"),
                                ("cachedrag-int4-compiled", q4, "int4")):
        ours = get(name, "decode_ms_per_token")
        if ours and anchor:
            what = "llama.cpp F32" if label == "fp32" else "llama.cpp Q4_1"
            out[f"{label} decode <= {what} (compile=True)"] = {"ratio": ours / anchor, "met": ours <= anchor}
    p32, lp32 = get("cachedrag-fp32", "prefill_tokens_per_s"), get("llamacpp-f32", "prefill_tokens_per_s")
    if p32 and lp32:
        out["fp32 prefill >= llama.cpp F32"] = {"ratio": p32 / lp32, "met": p32 >= lp32}
    pbf = get("cachedrag-bf16", "prefill_tokens_per_s")
    if pbf and p32:
        out["bf16 prefill >= 1.5x fp32"] = {"ratio": pbf / p32, "met": pbf >= 1.5 * p32}
    e2e = results.get("end_to_end", {})
    if "llamacpp-q4_1" in e2e:
        for name in _NUMERICS:
            if name in e2e:
                ratio = e2e["llamacpp-q4_1"]["seconds"] / e2e[name]["seconds"]
                out[f"end to end {name} >= 1.5x llama.cpp Q4_1"] = {"ratio": ratio, "met": ratio >= 1.5}
    if results.get("first_request_ratio") is not None:
        out["first request <= 1.1x"] = {"ratio": results["first_request_ratio"],
                                        "met": results["first_request_ratio"] <= 1.1}
    out["miss <= 1.05x full"] = {"ratio": results["miss_ratio"], "met": results["miss_ratio"] <= 1.05}
    for name, m in results.get("miss_by_system", {}).items():
        if name != "cachedrag-fp32":
            out[f"miss <= 1.05x full ({name})"] = {"ratio": m["ratio"], "met": m["ratio"] <= 1.05}
    return out


def _print(results: dict) -> None:
    cfg = results["config"]
    print(f"\nspeed: {cfg['prompt_tokens']}-token RAG prompt, {cfg['new_tokens']} decode steps, "
          f"median of {cfg['rounds']} interleaved rounds")
    print(f"{'system':<28} {'dtype':<20} {'threads':>7} {'prefill tok/s':>14} {'prefill s':>10} {'decode ms/tok':>14}")
    for name, row in results["systems"].items():
        print(f"{name:<28} {row['dtype']:<20} {row['threads']:>7} {row['prefill_tokens_per_s']:>14.0f} "
              f"{row['prefill_s']:>10.2f} {row['decode_ms_per_token']:>14.1f}")
    print()
    for name, m in results.get("miss_by_system", {"cachedrag-fp32": results["miss"]}).items():
        print(f"miss ({name}): TTFT {m['miss_ttft_s']:.3f}s vs full {m['full_ttft_s']:.3f}s -> {m['ratio']:.3f}; "
              f"with the store hand-off (1 token) {m['miss_total_s']:.3f}s vs {m['full_total_s']:.3f}s -> "
              f"{m['total_ratio']:.3f}")
    if results.get("first_request"):
        print(f"first request: {results['first_request']} -> first_request_ratio {results['first_request_ratio']}")
    for name, row in results["end_to_end"].items():
        print(f"end to end (TTFT + {E2E_TOKENS} tokens) {name:<18} {row['seconds']:.2f}s (TTFT {row['ttft_s']:.2f}s)")
    for name, row in results.get("fidelity", {}).items():
        print(f"fidelity vs fp32 (teacher-forced, {row['prompts']} prompts x {row['tokens']} tokens) {name:<16} "
              f"top-1 agreement {row['top1_agreement']:.3f}, KL mean {row['kl_mean']:.4f} max {row['kl_max']:.3f}, "
              f"first token {row['first_token_agreement']:.2f}")
    for note in results["notes"]:
        print(f"note: {note}")
    print("\ntargets:")
    for name, row in results["targets"].items():
        print(f"  {'MET    ' if row['met'] else 'NOT MET'} {name}: {row['ratio']:.3f}")
