"""``cachedrag bench shapes``: end to end at real model shapes (random weights), on the GPU.

Owns: the real-shape suite. A random-weight model of a named shape (Llama-3.1-8B, Qwen2.5-7B;
``tiny`` for tests) is built on the device in ``--dtype`` (no weights are downloaded: speed does
not depend on their values), with the byte tokenizer (every id is one byte, so a chunk of N
characters is N tokens). Measured side by side in one run:

- TTFT on a reordered-chunk stream: every request takes ``n`` chunks of ``--chunk-tokens`` from a
  pool, all cached, in a fresh random order (so exact-prefix reuse finds only the system prompt
  and whatever chunk happens to lead). Interleaved per request: Hugging Face ``transformers`` with
  SDPA (one forward, cache built, last logits), our runner's full prefill (``mode="full"``),
  prefix reuse (``mode="prefix"``), and cachedrag at ``--recompute`` (chunk caches in a GPU tier);
  cachedrag again with the caches in a pinned-CPU tier and on disk, which shows what layer-wise
  loading hides: ``overlap`` = 1 - (TTFT_tier - TTFT_gpu) / (n x load time per chunk); on CUDA,
  cachedrag again with its question pre-pass replayed from a captured graph
  (``cachedrag_graph_pass``, ``model/question_graph.py``) beside the default op-by-op pass;
- decode: tokens/s of the one-token step as the runner runs it (the CUDA-graph step on CUDA) and
  the eager step, after an ``n``-chunk prompt; the graph capture time; the weight-bandwidth limit
  (projection and LM-head bytes over the device's measured copy bandwidth) and the ratio to it;
- store loads: per chunk, read from each tier (GPU, pinned CPU, disk with its pages dropped) and
  copied to the device, against recomputing that chunk behind the system prompt.

With ``--profile``, one more cachedrag request at the largest chunk count runs under
``torch.profiler`` and is reported under ``"profile"``: wall time, device time by kernel (the
top 15), CUDA runtime calls by name (launches, copies, synchronisations), and on CUDA the call
sites where the host waited for the GPU (``torch.cuda.set_sync_debug_mode("warn")``, a second
request): where a request's time goes when the GPU is not the limit (docs/gpu.md).

Prints a table; ``--json OUT`` writes ``{"config", "ttft", "decode", "loads", "targets"}``.
Does not own: the engine, the runner or the stores (it drives them as a user would).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from cachedrag_bench import write_json
from cachedrag.errors import ConfigError

SYSTEM_PROMPT = "You are a helpful assistant. Answer the question using the documents given by the user. Be brief."
GiB = 1 << 30

#: config fields per shape (transformers config classes); random weights, so only shapes matter
SHAPES: dict[str, tuple[str, dict]] = {
    "llama-3.1-8b": ("llama", dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                   num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                                   max_position_embeddings=131072, rope_theta=500000.0, rms_norm_eps=1e-5,
                                   tie_word_embeddings=False)),
    "qwen2.5-7b": ("qwen2", dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                                 num_attention_heads=28, num_key_value_heads=4, vocab_size=152064,
                                 max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6,
                                 tie_word_embeddings=False, use_sliding_window=False)),
    "tiny": ("llama", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, vocab_size=260, max_position_embeddings=8192,
                           rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=False)),
}
TTFT_ARMS = ("hf_sdpa", "full", "prefix", "cachedrag")
TIER_ARMS = ("cachedrag_cpu", "cachedrag_disk")
#: on CUDA: cachedrag with the question pre-pass replayed from a captured graph instead of run op by op
GRAPH_PASS_ARM = "cachedrag_graph_pass"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--shape", choices=tuple(SHAPES), default="llama-3.1-8b", help="model shape (random weights)")
    parser.add_argument("--layers", type=int, default=None, help="override the shape's layer count (quick runs)")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto", help="auto: cuda when present")
    parser.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16")
    parser.add_argument("--chunks", default="5,10,20", help="chunks per request, comma-separated")
    parser.add_argument("--chunk-tokens", type=int, default=512, help="tokens per chunk")
    parser.add_argument("--pool", type=int, default=None, help="distinct chunks in the stream (default: 2 x the most chunks)")
    parser.add_argument("--requests", type=int, default=5, help="timed requests per chunk count (after one warm-up)")
    parser.add_argument("--recompute", type=float, default=0.15, help="cachedrag's recompute ratio")
    parser.add_argument("--decode-tokens", type=int, default=64, help="decode steps timed per step kind")
    parser.add_argument("--no-hf", action="store_true", help="skip the transformers SDPA arm")
    parser.add_argument("--no-tiers", action="store_true", help="skip the pinned-CPU and disk cachedrag arms")
    parser.add_argument("--cache-gib", type=float, default=8.0, help="budget of each engine's chunk-cache tier (GiB)")
    parser.add_argument("--profile", action="store_true",
                        help="profile one more cachedrag request at the largest chunk count (device time by kernel, "
                             "runtime calls, host waits)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", metavar="OUT", default=None, help="also write the results as JSON to OUT")


def run(args: argparse.Namespace) -> int:
    try:
        results = measure(args)
    except ConfigError as exc:
        print(f"cachedrag bench shapes: {exc}")
        return 2
    print(format_table(results))
    if args.json:
        write_json(results, args.json)
    return 0


# ----------------------------------------------------------------------------------------------
# setup


def _check(args: argparse.Namespace) -> list[int]:
    try:
        counts = [int(x) for x in str(args.chunks).split(",") if x.strip()]
    except ValueError:
        raise ConfigError(f"--chunks must be comma-separated integers, got {args.chunks!r}") from None
    if not counts or min(counts) < 1:
        raise ConfigError(f"--chunks needs positive counts, got {args.chunks!r}")
    for name in ("chunk_tokens", "requests", "decode_tokens"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 1")
    if not 0.0 < args.recompute <= 1.0:
        raise ConfigError(f"--recompute must be in (0, 1], got {args.recompute}")
    if args.layers is not None and args.layers < 1:
        raise ConfigError("--layers must be >= 1")
    if args.pool is not None and args.pool < max(counts):
        raise ConfigError(f"--pool {args.pool} is smaller than the most chunks per request ({max(counts)})")
    return counts


def build_model(shape: str, dtype, device, layers: int | None = None, seed: int = 0):
    """A random-weight causal LM of ``shape`` on ``device`` (initialised there: no host copy)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    model_type, fields = SHAPES[shape]
    fields = dict(fields, **({"num_hidden_layers": layers} if layers else {}))
    config = AutoConfig.for_model(model_type, **fields)
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


def _chunk_texts(n: int, tokens: int, seed: int) -> list[str]:
    """``n`` distinct texts of exactly ``tokens`` bytes (the byte tokenizer: one token each)."""
    rng = random.Random(seed)
    words = ["cache", "chunk", "layer", "token", "value", "query", "index", "block", "graph", "store", "tier",
             "prefill", "decode", "rotary", "kernel", "stream", "merge", "probe", "shard", "vector"]
    out = []
    for i in range(n):
        text = f"doc{i}: "
        while len(text) < tokens:
            text += rng.choice(words) + " "
        out.append(text[:tokens])
    return out


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _copy_gbs(device) -> float:
    """Device copy bandwidth (bytes read + written per second) of a large ``copy_``, in GB/s."""
    import torch

    n = (1 << 30 if device.type == "cuda" else 1 << 26) // 4
    src = torch.empty(n, dtype=torch.float32, device=device).uniform_()  # [N]
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    _sync(device)
    samples = []
    for _ in range(10):
        t0 = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        samples.append(time.perf_counter() - t0)
    return 2 * n * 4 / statistics.median(samples) / 1e9


# ----------------------------------------------------------------------------------------------
# measurement


def measure(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from cachedrag.config import EngineConfig
    from cachedrag.engine import CachedEngine
    from cachedrag.kvcache.config import CacheConfig
    from cachedrag.kvcache.manager import ChunkCacheManager
    from cachedrag.model.runner import ModelRunner, resolve_device
    from cachedrag.store.config import StoreConfig
    from cachedrag.store.tiered import TieredStore
    from cachedrag.testing import byte_tokenizer

    counts = _check(args)
    device = resolve_device(args.device)
    dtype = getattr(torch, args.dtype)
    tok = byte_tokenizer()
    t0 = time.perf_counter()
    model = build_model(args.shape, dtype, device, args.layers, args.seed)
    model.generation_config.eos_token_id = None  # random weights: never stop early
    runner = ModelRunner(model, tok, dtype=args.dtype)
    build_s = time.perf_counter() - t0
    copy_gbs = _copy_gbs(device)
    pool = args.pool or 2 * max(counts)
    texts = _chunk_texts(pool, args.chunk_tokens, args.seed)
    budget = int(args.cache_gib * GiB)
    on_cuda = device.type == "cuda"
    tmp = tempfile.TemporaryDirectory(prefix="cachedrag-shapes-")
    probe = CachedEngine(runner, config=EngineConfig(mode="full"))
    namespace = probe.model_namespace.digest

    def engine(mode: str, **store_kw) -> CachedEngine:
        cache = CacheConfig(recompute_ratio=args.recompute) if mode == "cachedrag" else CacheConfig()
        store = TieredStore.from_config(StoreConfig(namespace=namespace, **store_kw))
        manager = ChunkCacheManager(store, cache, capacity_bytes=None)
        return CachedEngine(runner, config=EngineConfig(mode=mode, cache=cache), manager=manager)

    fast_tier = {"gpu_bytes": budget} if on_cuda else {"cpu_bytes": budget}
    engines = {"full": engine("full", cpu_bytes=64 << 20), "prefix": engine("prefix", **fast_tier),
               "cachedrag": engine("cachedrag", **fast_tier)}
    if on_cuda:
        engines[GRAPH_PASS_ARM] = engine("cachedrag", **fast_tier)
        engines[GRAPH_PASS_ARM].question_pass = "cuda-graph"
    if not args.no_tiers:
        engines["cachedrag_cpu"] = engine("cachedrag", cpu_bytes=budget)
        engines["cachedrag_disk"] = engine("cachedrag", disk_dir=str(Path(tmp.name) / "disk"), disk_bytes=budget,
                                           disk_fsync=False)
    rng = random.Random(args.seed + 1)
    group = max(counts)
    for start in range(0, pool, group):  # warm: every pool chunk cached in every engine
        for name, e in engines.items():
            if name != "full":
                e.generate(texts[start:start + group], "warm up", SYSTEM_PROMPT, max_new_tokens=1)
    _sync(device)
    ttft: dict[str, Any] = {}
    for n in counts:
        arms = [a for a in (*TTFT_ARMS, GRAPH_PASS_ARM, *TIER_ARMS)
                if a in engines or (a == "hf_sdpa" and not args.no_hf)]
        times: dict[str, list[float]] = {a: [] for a in arms}
        stats: dict[str, list[dict]] = {a: [] for a in arms}
        for r in range(args.requests + 1):
            chunks = rng.sample(texts, n)
            question = f"question {r}: which {rng.choice(['cache', 'layer', 'token'])} matters most here?"
            order = arms[:]
            rng.shuffle(order)
            for arm in order:
                seconds, result = _ttft(arm, engines, model, chunks, question, device)
                if r > 0:  # the first request of each count warms shapes and kernels
                    times[arm].append(seconds)
                    if result is not None:
                        stats[arm].append({"prompt_tokens": result.prompt_tokens,
                                           "computed_tokens": result.computed_tokens,
                                           "prefix_hit_tokens": result.prefix_hit_tokens,
                                           "chunks_hit": result.chunks_hit, "load_s": result.load_s})
        ttft[str(n)] = {a: _summary(times[a], stats[a]) for a in arms}
    profile = None
    if args.profile:
        question = "question p: which cache matters most here?"
        draws = [rng.sample(texts, max(counts)) for _ in range(2)]
        profile = _profile(engines["cachedrag"], draws, question, device)
    decode = _decode(runner, texts[:min(counts)], args.decode_tokens, copy_gbs, device)
    loads = _loads(engines, runner, texts[0], device, Path(tmp.name))
    for n, row in ttft.items():
        per_chunk = {t: loads.get(t, {}).get("load_ms") for t in ("cpu", "disk")}
        for arm, tier in (("cachedrag_cpu", "cpu"), ("cachedrag_disk", "disk")):
            if arm in row and per_chunk[tier]:
                visible = row[arm]["median_ms"] - row["cachedrag"]["median_ms"]
                row[arm]["overlap"] = 1.0 - visible / (int(n) * per_chunk[tier])
    tmp.cleanup()
    results = {
        "config": {
            "shape": args.shape, "layers": runner.n_layers, "dtype": args.dtype, "device": str(device),
            "device_name": torch.cuda.get_device_name(device) if on_cuda else "cpu",
            "torch": torch.__version__, "triton": _version("triton"), "transformers": _version("transformers"),
            "date": time.strftime("%Y-%m-%d"), "chunk_tokens": args.chunk_tokens, "chunks": counts, "pool": pool,
            "requests": args.requests, "recompute": args.recompute, "copy_gb_per_s": copy_gbs,
            "weight_bytes": runner.weight_bytes, "build_s": build_s, "kernel_backend": runner.kernel_backend,
            "decode_step": runner.decode_step_kind,
        },
        "ttft": ttft, "decode": decode, "loads": loads,
        "question_pass": {arm: _question_pass(engines[arm]) for arm in ("cachedrag", GRAPH_PASS_ARM) if arm in engines},
    }
    if profile is not None:
        results["profile"] = profile
    results["targets"] = _targets(results)
    return results


def _question_pass(engine) -> dict[str, Any]:
    """How an arm ran its question pre-pass: the kind, graphs captured, padded passes served, a failed capture."""
    graphs = engine.question_graphs
    return {"kind": engine.question_pass, "captures": graphs.captures if graphs is not None else 0,
            "passes": graphs.passes if graphs is not None else 0,
            "capture_failed": graphs.failed if graphs is not None else None}


def _version(module: str) -> str | None:
    try:
        return __import__(module).__version__
    except ImportError:
        return None


def _ttft(arm: str, engines: dict, model, chunks: list[str], question: str, device):
    """(seconds to the first token, EngineResult or None) of one request through ``arm``."""
    import torch

    if arm == "hf_sdpa":
        prompts = engines["full"].prompts
        ids = [t for seg in prompts.chat(chunks, question, SYSTEM_PROMPT) for t in seg.ids]
        x = torch.tensor([ids], device=device)  # [1, T]
        _sync(device)
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = model(x, use_cache=True, logits_to_keep=1)
            int(out.logits[0, -1].argmax())  # the first token (synchronises)
        seconds = time.perf_counter() - t0
        del out
        return seconds, None
    e = engines[arm]
    _sync(device)
    t0 = time.perf_counter()
    result = e.generate(chunks, question, SYSTEM_PROMPT, max_new_tokens=1)
    _sync(device)
    return time.perf_counter() - t0, result


def _profile(engine, samples: list[list[str]], question: str, device) -> dict[str, Any]:
    """One cachedrag request (chunks ``samples[0]``) under ``torch.profiler``: wall ms, device ms
    (total and the top 15 kernels), CUDA runtime calls by name; on CUDA a second request (another
    draw, ``samples[1]``: a repeat of the first would be promoted to an exact path) under the sync
    debug mode names the call sites (ours) where the host waited for the GPU, first token and
    store hand-off included."""
    import collections
    import traceback
    import warnings

    import torch
    from torch.profiler import ProfilerActivity, profile

    on_cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_cuda else [])
    _sync(device)
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        engine.generate(samples[0], question, SYSTEM_PROMPT, max_new_tokens=1)
        _sync(device)
        wall = time.perf_counter() - t0
    events = prof.key_averages()
    kernels = sorted(((e.key, e.self_device_time_total / 1e3, e.count) for e in events
                      if e.device_type == torch.autograd.DeviceType.CUDA), key=lambda k: -k[1])
    out: dict[str, Any] = {
        "wall_ms": wall * 1e3,
        "device_ms": sum(ms for _, ms, _ in kernels),
        "host_ms": sum(e.self_cpu_time_total for e in events) / 1e3,
        "kernels": [{"name": name, "ms": ms, "calls": n} for name, ms, n in kernels[:15]],
        "runtime_calls": {e.key: e.count for e in events if e.key.startswith("cuda")},
    }
    if on_cuda:
        sites: collections.Counter = collections.Counter()

        def record(message, category, filename, lineno, file=None, line=None):
            ours = [f for f in traceback.extract_stack()[:-1] if "cachedrag" in f.filename]
            sites[" <- ".join(f"{Path(f.filename).name}:{f.lineno}:{f.name}" for f in ours[::-1][:3])] += 1

        with warnings.catch_warnings():
            warnings.simplefilter("always")
            shown, warnings.showwarning = warnings.showwarning, record
            torch.cuda.set_sync_debug_mode("warn")
            try:
                engine.generate(samples[1], question, SYSTEM_PROMPT, max_new_tokens=1)
            finally:
                torch.cuda.set_sync_debug_mode("default")
                warnings.showwarning = shown
        out["host_waits"] = dict(sites.most_common())
    return out


def _summary(times: list[float], stats: list[dict]) -> dict:
    row: dict[str, Any] = {"median_ms": statistics.median(times) * 1e3, "mean_ms": statistics.fmean(times) * 1e3,
                           "min_ms": min(times) * 1e3, "max_ms": max(times) * 1e3, "n": len(times)}
    if stats:
        for key in stats[0]:
            row[f"mean_{key}"] = statistics.fmean(s[key] for s in stats)
    return row


def _decode(runner, chunks: list[str], steps: int, copy_gbs: float, device) -> dict:
    """Tokens/s of the runner's decode step (graph on CUDA) and of the eager step, same prompt."""
    import torch

    ids = torch.tensor([t for text in chunks for t in runner.tokenizer(text)["input_ids"]])  # [T]
    t = ids.shape[0]
    kinds = {runner.decode_step_kind: runner.cuda_graphs}
    if runner.cuda_graphs is not None:
        kinds["eager"] = None
    out: dict[str, Any] = {"prompt_tokens": t, "steps": steps}
    graphs = runner.cuda_graphs
    try:
        for kind, graph in kinds.items():
            runner.cuda_graphs = graph  # None: the eager op-by-op step (the reference path)
            kv = runner.new_kv(t + steps + 1)
            token = int(runner.prefill(ids, kv=kv).argmax())
            _sync(device)
            t0 = time.perf_counter()
            token = int(runner.decode_step(token, t, kv).argmax())  # the first step (captures on CUDA)
            first = time.perf_counter() - t0
            samples = []
            for s in range(1, steps):
                t0 = time.perf_counter()
                token = int(runner.decode_step(token, t + s, kv).argmax())
                samples.append(time.perf_counter() - t0)
            step = statistics.median(samples)
            out[kind] = {"step_ms": step * 1e3, "tokens_per_s": 1.0 / step, "first_step_ms": first * 1e3}
            del kv
    finally:
        runner.cuda_graphs = graphs
    limit = runner.weight_bytes / (copy_gbs * 1e9)  # reading every projection and the LM head once
    out["weight_bandwidth_limit_ms"] = limit * 1e3
    out["ratio_to_limit"] = out[runner.decode_step_kind]["step_ms"] / (limit * 1e3)
    return out


def _loads(engines: dict, runner, chunk_text: str, device, root: Path) -> dict:
    """Per tier: one chunk's entry read and copied to the device, vs recomputing it."""
    import torch

    from cachedrag_bench.tiers import _recompute_s

    src = engines["cachedrag"]
    prompts = src.prompts
    layout = prompts.chat([], "x", SYSTEM_PROMPT)
    system = layout[0]
    chunk = prompts.chunk_segment(chunk_text)
    handles = [v.handle for v in src.manager.index.variants(chunk.key)]
    out: dict[str, Any] = {"chunk_tokens": len(chunk.ids)}
    recompute = [_recompute_s(runner, system.ids, chunk.ids) for _ in range(4)]
    out["recompute_ms"] = statistics.median(recompute[1:]) * 1e3
    tiers = {"gpu" if device.type == "cuda" else "memory": src}
    if "cachedrag_cpu" in engines:
        tiers["cpu"] = engines["cachedrag_cpu"]
    if "cachedrag_disk" in engines:
        tiers["disk"] = engines["cachedrag_disk"]
    for name, e in tiers.items():
        store = e.manager.store
        mine = [h for h in (v.handle for v in e.manager.index.variants(chunk.key)) if store.info(h) is not None]
        if not mine:
            out[name] = {"skipped": "no entry of the chunk in this tier"}
            continue
        samples, nbytes = [], 0
        for _ in range(6):
            if name == "disk":
                _drop_pages(root / "disk")
            t0 = time.perf_counter()
            entry = store.get(mine[0], promote=False)
            if entry is None:  # read as a miss (the store says why in a warning)
                break
            moved = entry.to(device)
            _sync(device)
            samples.append(time.perf_counter() - t0)
            nbytes = sum(x.numel() * x.element_size() for x in moved.tensors.values())
            del entry, moved
        if len(samples) < 6:
            out[name] = {"skipped": "the entry was read as a miss"}
            continue
        load = statistics.median(samples[1:])
        out[name] = {"load_ms": load * 1e3, "bytes": nbytes, "gb_per_s": nbytes / load / 1e9,
                     "of_recompute": load / (out["recompute_ms"] / 1e3)}
    out["handles"] = len(handles)
    return out


def _drop_pages(directory: Path) -> None:
    """Ask the kernel to drop the page cache of every file under ``directory`` (cold reads)."""
    for path in directory.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def _targets(res: dict) -> dict:
    """The issue's targets, read off this run (largest chunk count for TTFT)."""
    out: dict[str, Any] = {}
    n = str(max(int(k) for k in res["ttft"]))
    row = res["ttft"][n]
    if "cachedrag" in row:
        out["cachedrag_vs_full"] = row["full"]["median_ms"] / row["cachedrag"]["median_ms"]
        out["cachedrag_vs_prefix"] = row["prefix"]["median_ms"] / row["cachedrag"]["median_ms"]
        if "hf_sdpa" in row:
            out["cachedrag_vs_hf_sdpa"] = row["hf_sdpa"]["median_ms"] / row["cachedrag"]["median_ms"]
        if GRAPH_PASS_ARM in row:  # what the captured question pre-pass saves
            out["graph_pass_vs_full"] = row["full"]["median_ms"] / row[GRAPH_PASS_ARM]["median_ms"]
            out["graph_pass_vs_eager_pass"] = row["cachedrag"]["median_ms"] / row[GRAPH_PASS_ARM]["median_ms"]
    cpu = res["loads"].get("cpu", {})
    if "of_recompute" in cpu:
        out["pinned_cpu_load_of_recompute"] = cpu["of_recompute"]
    out["decode_ratio_to_weight_limit"] = res["decode"]["ratio_to_limit"]
    return out


# ----------------------------------------------------------------------------------------------
# report


def format_table(res: dict) -> str:
    cfg = res["config"]
    lines = [f"cachedrag bench shapes  {cfg['shape']} ({cfg['layers']} layers, random weights)  {cfg['dtype']}  "
             f"device={cfg['device_name']}  backend={cfg['kernel_backend']}  decode={cfg['decode_step']}",
             f"  chunks of {cfg['chunk_tokens']} tokens, reordered stream over a pool of {cfg['pool']}, "
             f"recompute {cfg['recompute']:.0%}; copy bandwidth {cfg['copy_gb_per_s']:.0f} GB/s", "",
             "TTFT median ms (mean tokens computed at full depth)"]
    arms = list(next(iter(res["ttft"].values())))
    lines.append(f"  {'chunks':>6}" + "".join(f"{a:>17}" for a in arms))
    for n, row in res["ttft"].items():
        cells = []
        for a in arms:
            r = row[a]
            extra = f" ({r['mean_computed_tokens']:.0f})" if "mean_computed_tokens" in r else ""
            cells.append(f"{r['median_ms']:.1f}{extra}".rjust(17))
        lines.append(f"  {n:>6}" + "".join(cells))
        for a in TIER_ARMS:
            if a in row and "overlap" in row[a]:
                lines.append(f"  {'':>6}  {a}: load hidden by layer-wise loading {row[a]['overlap']:.0%}")
    d = res["decode"]
    lines += ["", f"decode after {d['prompt_tokens']} prompt tokens ({d['steps']} steps):"]
    for kind in (cfg["decode_step"], "eager"):
        if kind in d:
            lines.append(f"  {kind:<12} {d[kind]['step_ms']:.2f} ms/token  {d[kind]['tokens_per_s']:.1f} tok/s  "
                         f"(first step {d[kind]['first_step_ms']:.1f} ms)")
    lines.append(f"  weight-bandwidth limit {d['weight_bandwidth_limit_ms']:.2f} ms/token; "
                 f"ratio {d['ratio_to_limit']:.2f}x")
    ld = res["loads"]
    lines += ["", f"chunk load ({ld['chunk_tokens']} tokens) vs recompute {ld['recompute_ms']:.2f} ms:"]
    for tier in ("gpu", "memory", "cpu", "disk"):
        if tier in ld and "load_ms" in ld[tier]:
            r = ld[tier]
            lines.append(f"  {tier:<7} {r['load_ms']:.3f} ms  {r['gb_per_s']:.1f} GB/s  {r['of_recompute']:.1%} of recompute")
    prof = res.get("profile")
    if prof is not None:
        lines += ["", f"profile of one cachedrag request: wall {prof['wall_ms']:.1f} ms, "
                  f"device {prof['device_ms']:.1f} ms, host (profiler) {prof['host_ms']:.1f} ms"]
        lines += [f"  {k['ms']:8.2f} ms  x{k['calls']:<5d} {k['name'][:70]}" for k in prof["kernels"][:8]]
        if "host_waits" in prof:
            lines.append(f"  host waits: {sum(prof['host_waits'].values())} "
                         + "; ".join(f"{n} at {site}" for site, n in prof["host_waits"].items()))
    lines += ["", "targets: " + ", ".join(f"{k} {v:.2f}" for k, v in res["targets"].items())]
    return "\n".join(lines)
