"""``cachedrag bench tiers``: chunk caches served from each store tier, against recomputing them.

Owns: the tiers suite. Inputs are those of ``bench ttft`` (corpus, questions, model, top-k,
chunk tokens; ``bench.workload``). For each tier (GPU when CUDA is present, CPU RAM, local
disk, Redis when a server can run) one engine whose store is that tier alone warms up on the
request stream, then replays it with its chunks cached. The replay is interleaved across the
tier engines, a ``full`` engine (recompute everything) and a *mixed* engine (a CPU tier of a
quarter of the working set over a disk tier of 80% of it: demotions and drops under load), so machine noise hits all alike. Reported:

- per tier: KV load time per chunk (read from the tier + copy to the compute device; and the
  time until its first layer is usable, for layer-wise loading) next to the time to recompute
  that chunk behind the system prompt; the engine's own load time per cached chunk; TTFT
  (median, p95) with the caches served from that tier; the share of the ideal TTFT gain the
  loading costs (``load_cost_of_gain`` = load / (TTFT_full - (TTFT_tier - load))) and the
  gain kept relative to CPU RAM; bytes per cached token against the theoretical
  ``layers x 2 x kv_heads x head_dim x dtype_bytes``;
- ``budget_overruns``: moments any tier of any engine was found above its byte budget (every
  tier sampled in a background thread and after every request, the disk directory's real
  allocated bytes included); must be 0;
- a restart run: a second process opens the disk tier's directory and replays the stream;
  ``restart_chunk_hit_rate`` is its chunk hit rate over that first pass.

``--json OUT`` writes everything; top-level keys include ``tiers``, ``restart_chunk_hit_rate``,
``budget_overruns`` and ``bytes_per_token_ratio`` (the largest over the tiers).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from cachedrag_bench import write_json
from cachedrag_bench.metrics import summary
from cachedrag_bench.ttft import DEFAULT_SYSTEM_PROMPT
from cachedrag.errors import ConfigError

ALL_TIERS = ("gpu", "cpu", "disk", "redis")
GiB = 1 << 30


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--corpus", help="directory of .txt/.md files or a JSONL of {id, text} (default: stdlib docs)")
    parser.add_argument("--questions", help="one question per line, used in order (default: a Zipf stream of stdlib questions)")
    parser.add_argument("--model", default=None, help="HF model id or path (default: embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--device", default="auto", help="compute device: auto (cuda when present), cpu, cuda")
    parser.add_argument("--top-k", type=int, default=5)
    parser.add_argument("--chunk-tokens", type=int, default=256)
    parser.add_argument("--requests", type=int, default=16, help="stream length when no --questions file is given")
    parser.add_argument("--zipf", type=float, default=1.1, help="Zipf exponent of the generated stream")
    parser.add_argument("--max-new-tokens", type=int, default=4, help="tokens generated per request (TTFT is measured)")
    parser.add_argument("--mode", default="cachedrag", help="reuse mode of the tier engines (default cachedrag)")
    parser.add_argument("--tiers", default=",".join(ALL_TIERS), help="subset of " + ",".join(ALL_TIERS))
    parser.add_argument("--tier-bytes", type=int, default=8 * GiB, help="budget of each single-tier store")
    parser.add_argument("--redis-url", default=None, help="use this Redis server (default: start a private one)")
    parser.add_argument("--disk-dir", default=None, help="directory for the disk tiers (default: a temp dir, removed)")
    parser.add_argument("--load-samples", type=int, default=12, help="chunks timed for load vs recompute")
    parser.add_argument("--no-mixed", action="store_true", help="skip the mixed small-CPU + disk engine")
    parser.add_argument("--no-restart", action="store_true", help="skip the second-process restart run")
    parser.add_argument("--system-prompt", default=DEFAULT_SYSTEM_PROMPT)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (both processes; default: torch's)")
    parser.add_argument("--json", dest="json_out", help="write results as JSON to this path")
    parser.add_argument("--restart-child", default=None, help=argparse.SUPPRESS)  # internal: the second process


# ---------------------------------------------------------------------------------- engines
@dataclass
class Arm:
    """One engine under test and what it recorded."""

    name: str
    engine: object
    store: object | None = None
    disk_dir: Path | None = None
    records: list = field(default_factory=list)
    warm_ttft: list = field(default_factory=list)


def _engine(runner, config, store):
    from cachedrag.engine import CachedEngine
    from cachedrag.kvcache.manager import ChunkCacheManager

    manager = ChunkCacheManager(store, config.cache, capacity_bytes=None)  # the tiers' budgets govern
    return CachedEngine(runner, config=config, manager=manager)


def _store(namespace: str, **kwargs):
    from cachedrag.store.config import StoreConfig
    from cachedrag.store.tiered import TieredStore

    return TieredStore.from_config(StoreConfig(namespace=namespace, **kwargs))


def _tier_kwargs(tier: str, budget: int, root: Path, redis_url: str | None, prefix: str) -> dict:
    if tier == "gpu":
        return {"gpu_bytes": budget}
    if tier == "cpu":
        return {"cpu_bytes": budget}
    if tier == "disk":
        return {"disk_dir": root / "disk", "disk_bytes": budget}
    return {"redis_url": redis_url, "redis_bytes": budget, "redis_prefix": prefix}


class BudgetSampler:
    """Counts moments any tier of any store is above its budget (a thread, plus ``check()``)."""

    def __init__(self, interval_s: float = 0.02):
        self.stores: list = []
        self.disk_tiers: dict[Path, object] = {}  # directory -> its DiskTier
        self.samples = 0
        self.overruns: list[str] = []
        self._interval = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="budget-sampler", daemon=True)

    def watch(self, store, disk_dir: Path | None = None) -> None:
        self.stores.append(store)
        if disk_dir is not None:
            self.disk_tiers[disk_dir] = store.tier("disk")

    def check(self) -> None:
        for store in list(self.stores):
            for tier in store.tiers:
                used, budget = tier.used_bytes, tier.budget_bytes
                if used > budget:
                    self.overruns.append(f"{tier.name}: {used} > {budget}")
        for directory, tier in self.disk_tiers.items():
            on_disk, budget = tier.allocated_bytes(), tier.budget_bytes  # a consistent snapshot (tier's lock)
            if on_disk > budget:
                self.overruns.append(f"{directory}: {on_disk} bytes on disk > {budget}")
        self.samples += 1

    def _loop(self) -> None:
        while not self._stop.wait(self._interval):
            self.check()

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


# ---------------------------------------------------------------------------------- run
def run(args: argparse.Namespace) -> int:
    if args.restart_child:
        return _restart_child(args.restart_child)
    import torch

    threads = torch.get_num_threads()
    try:
        return _run(args)
    finally:
        torch.set_num_threads(threads)  # --threads must not outlive the suite (in-process callers)


def _run(args: argparse.Namespace) -> int:
    import torch

    from cachedrag_bench.workload import build_workload
    from cachedrag.config import EngineConfig
    from cachedrag.kvcache.config import CacheConfig
    from cachedrag.model.loader import load_model
    from cachedrag.model.runner import ModelRunner

    if args.threads:
        torch.set_num_threads(args.threads)
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    runner = ModelRunner(*load_model(args.model, device=device))
    work = build_workload(runner.tokenizer, args.corpus, args.questions, top_k=args.top_k,
                          chunk_tokens=args.chunk_tokens, n_requests=args.requests, zipf_s=args.zipf, seed=args.seed)
    config = EngineConfig(mode=args.mode, cache=CacheConfig(seed=args.seed))
    from cachedrag.engine import CachedEngine

    full = Arm("recompute", CachedEngine(runner, config=config.model_copy(update={"mode": "full"})))
    namespace = full.engine.namespace.digest
    tmp = None
    root = Path(args.disk_dir) if args.disk_dir else Path(tmp := tempfile.mkdtemp(prefix="cachedrag-bench-tiers-"))
    skipped: dict[str, str] = {}
    server = None
    try:
        arms, server = _tier_arms(args, runner, config, namespace, root, skipped)
        results = _measure(args, runner, config, namespace, work, full, arms, root)
    finally:
        if server is not None:
            server.stop()
        if tmp is not None:
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)
    results["skipped"] = skipped
    results["config"] = {
        "model": args.model or "SmolLM2-135M-Instruct", "device": str(runner.device), "corpus": work.corpus_name,
        "questions": work.question_source, "n_chunks": len(work.chunks), "top_k": args.top_k,
        "chunk_tokens": args.chunk_tokens, "mode": args.mode, "max_new_tokens": args.max_new_tokens,
        "tier_bytes": args.tier_bytes, "torch_threads": torch.get_num_threads(),
    }
    _print_table(results)
    if args.json_out:
        write_json(results, args.json_out)
    return 0


def _tier_arms(args, runner, config, namespace: str, root: Path, skipped: dict) -> tuple[list[Arm], object]:
    import uuid

    import torch

    wanted = [t.strip() for t in args.tiers.split(",") if t.strip()]
    unknown = [t for t in wanted if t not in ALL_TIERS]
    if unknown:
        raise ConfigError(f"unknown tiers {unknown}; choose from {ALL_TIERS}")
    server, redis_url = None, args.redis_url
    if "gpu" in wanted and (not torch.cuda.is_available() or runner.device.type != "cuda"):
        wanted.remove("gpu")
        skipped["gpu"] = "no CUDA device (or the model is not on it)"
    if "redis" in wanted and redis_url is None:
        from cachedrag.store.redis_server import RedisUnavailableError, start_redis_server

        try:
            server = start_redis_server()
            redis_url = server.url
        except RedisUnavailableError as exc:
            wanted.remove("redis")
            skipped["redis"] = str(exc)
    prefix = f"cdbench{uuid.uuid4().hex[:8]}"
    arms = []
    for tier in wanted:
        kwargs = _tier_kwargs(tier, args.tier_bytes, root, redis_url, prefix)
        store = _store(namespace, **kwargs)
        arms.append(Arm(tier, _engine(runner, config, store), store, kwargs.get("disk_dir")))
    return arms, server


def _measure(args, runner, config, namespace, work, full: Arm, arms: list[Arm], root: Path) -> dict:
    from tqdm import tqdm

    n = len(work.questions)
    sampler = BudgetSampler()
    for arm in arms:
        sampler.watch(arm.store, arm.disk_dir)
    sampler.start()
    try:
        for i in tqdm(range(n), desc="bench tiers: warm", unit="req", file=sys.stderr):
            for arm in arms:
                arm.warm_ttft.append(_ask(args, arm, work, i).ttft_s)
                sampler.check()
        mixed = None
        if not args.no_mixed and any(a.name == "cpu" for a in arms):
            mixed = _mixed_arm(args, runner, config, namespace, work, arms, root, sampler)
        replay = [full, *arms, *([mixed] if mixed is not None else [])]
        for i in tqdm(range(n), desc="bench tiers: serve", unit="req", file=sys.stderr):
            shift = i % len(replay)  # rotate the order so no arm always runs first
            for arm in replay[shift:] + replay[:shift]:
                arm.records.append(_ask(args, arm, work, i))
                sampler.check()
        loads = _load_vs_recompute(args, runner, work, arms)
    finally:
        sampler.stop()
    results = {"n_requests": n, "theoretical_bytes_per_token": _theoretical(runner)}
    results["recompute"] = _ttft_row(full)
    results["tiers"] = {arm.name: _tier_row(arm, full, loads, runner) for arm in arms}
    _relative_to_cpu(results["tiers"])
    ratios = [row["bytes_per_token_ratio"] for row in results["tiers"].values() if row["bytes_per_token_ratio"]]
    results["bytes_per_token_ratio"] = max(ratios) if ratios else None
    if mixed is not None:
        results["mixed"] = _mixed_row(mixed, full)
    results["budget_overruns"] = len(sampler.overruns)
    results["budget_overrun_examples"] = sampler.overruns[:5]
    results["budget_samples"] = sampler.samples
    for arm in [*arms, *([mixed] if mixed is not None else [])]:
        problems = arm.store.check_invariants() + arm.engine.manager.check()
        if problems:
            results.setdefault("invariant_problems", {})[arm.name] = problems[:5]
    disk = next((a for a in arms if a.name == "disk"), None)
    results["restart_chunk_hit_rate"] = None
    if disk is not None and not args.no_restart:
        for arm in replay[1:]:
            arm.store.close()
        results["restart"] = _restart(args, work, disk)
        results["restart_chunk_hit_rate"] = results["restart"]["chunk_hit_rate"]
    else:
        for arm in replay[1:]:
            arm.store.close()
    results["targets"] = _targets(results)
    return results


def _ask(args, arm: Arm, work, i: int):
    import torch

    with torch.inference_mode():
        return arm.engine.generate(work.retrieved[i], work.questions[i], args.system_prompt,
                                   max_new_tokens=args.max_new_tokens)


def _mixed_arm(args, runner, config, namespace, work, arms: list[Arm], root: Path, sampler: BudgetSampler) -> Arm:
    """Small CPU tier (a quarter of the working set) over a disk tier holding ~80% of it."""
    from tqdm import tqdm

    working_set = next(a for a in arms if a.name == "cpu").store.tier("cpu").used_bytes
    block = 4096
    cpu_bytes = max(block, working_set // 4)
    disk_bytes = max(16 * block, int(working_set * 0.8))
    store = _store(namespace, cpu_bytes=cpu_bytes, disk_dir=root / "mixed", disk_bytes=disk_bytes)
    arm = Arm("mixed", _engine(runner, config, store), store, root / "mixed")
    sampler.watch(store, arm.disk_dir)
    for i in tqdm(range(len(work.questions)), desc="bench tiers: warm mixed", unit="req", file=sys.stderr):
        arm.warm_ttft.append(_ask(args, arm, work, i).ttft_s)
        sampler.check()
    return arm


# ---------------------------------------------------------------------------------- load vs recompute
def _load_vs_recompute(args, runner, work, arms: list[Arm]) -> dict:
    """Per sampled chunk entry (present in every tier): time to recompute it behind the system
    prompt, and per tier the time to read it + copy it to the device, and to its first layer."""
    import torch

    from cachedrag.kvcache.catalog import CatalogError, StoredSegment

    common = set.intersection(*(set(a.engine.manager.handles()) for a in arms)) if arms else set()
    chunks = []
    for h in sorted(common):
        info = arms[0].store.info(h)
        try:
            seg = StoredSegment.parse(h, info.meta, info.nbytes, info.n_tokens) if info is not None else None
        except CatalogError:
            seg = None
        if seg is not None and seg.role == "chunk":
            chunks.append(seg)
    chunks = chunks[: args.load_samples]
    system, by_key = None, {}
    if arms:
        prompts = arms[0].engine.prompts
        layout = prompts.chat([], "x", args.system_prompt)
        system = layout[0] if len(layout) > 1 else None
        by_key = {seg.key: seg for seg in (prompts.chunk_segment(t) for t in {t for r in work.retrieved for t in r})}
    out: dict = {"recompute": [], "tokens": []}
    for arm in arms:
        out[arm.name] = {"load": [], "first_layer": []}
    device = runner.device
    for seg in chunks:
        chunk = by_key.get(seg.segment_key)
        if chunk is None or system is None:
            continue
        out["recompute"].append(_recompute_s(runner, system.ids, chunk.ids))
        out["tokens"].append(seg.n_tokens)
        for arm in arms:
            t0 = time.perf_counter()
            entry = arm.store.get(seg.handle, promote=False)
            if entry is None:
                continue
            moved = entry.to(device)  # the copy the compute needs
            if device.type == "cuda":
                torch.cuda.synchronize()
            out[arm.name]["load"].append(time.perf_counter() - t0)
            del moved
            t0 = time.perf_counter()
            with arm.store.open_layers(seg.handle, device, depth=1) as loader:
                got = loader.layer(0)
                if device.type == "cuda":
                    torch.cuda.synchronize()
                if got is not None:
                    out[arm.name]["first_layer"].append(time.perf_counter() - t0)
    return out


def _recompute_s(runner, system_ids, chunk_ids) -> float:
    """Prefill of ``chunk_ids`` behind ``system_ids`` (already computed), timed."""
    import torch

    s, t = len(system_ids), len(chunk_ids)
    kv = runner.new_kv(s + t)
    with torch.inference_mode():
        runner.prefill(torch.tensor(system_ids), kv=kv)
        if runner.device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        runner.prefill(torch.tensor(chunk_ids), positions=torch.arange(s, s + t), kv=kv)
        if runner.device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t0


# ---------------------------------------------------------------------------------- rows
def _theoretical(runner) -> int:
    import torch

    dtype_bytes = torch.empty((), dtype=runner.dtype).element_size()
    return runner.n_layers * 2 * runner.n_kv_heads * runner.head_dim * dtype_bytes


def _mean(values) -> float | None:
    return statistics.fmean(values) if values else None


def _ttft_row(arm: Arm) -> dict:
    rs = arm.records
    s = summary([r.ttft_s for r in rs])
    chunks = sum(r.chunks_hit + r.chunks_missed for r in rs)
    return {"ttft_median_s": s["median"], "ttft_p95_s": s["p95"], "ttft_mean_s": s["mean"],
            "load_s_median": statistics.median(r.load_s for r in rs), "prefill_s_median": statistics.median(r.prefill_s for r in rs),
            "chunk_hit_rate": sum(r.chunks_hit for r in rs) / chunks if chunks else 0.0,
            "segments_recomputed_by_fallback": sum(len(r.notes) for r in rs)}


def _tier_row(arm: Arm, full: Arm, loads: dict, runner) -> dict:
    row = _ttft_row(arm)
    rs = arm.records
    loaded = sum(r.chunks_hit for r in rs) + sum(1 for r in rs if r.prefix_hit_tokens)  # chunks + system prefixes
    row["engine_load_s_per_segment"] = sum(r.load_s for r in rs) / loaded if loaded else None
    recompute = _mean(loads.get("recompute", []))
    tier = loads.get(arm.name, {})
    row["load_s_per_chunk"] = _mean(tier.get("load", []))
    row["first_layer_s_per_chunk"] = _mean(tier.get("first_layer", []))
    row["recompute_s_per_chunk"] = recompute
    row["load_vs_recompute"] = (row["load_s_per_chunk"] / recompute) if recompute and row["load_s_per_chunk"] else None
    full_ttft = full.records and summary([r.ttft_s for r in full.records])["median"]
    row["speedup_vs_recompute"] = full_ttft / row["ttft_median_s"] if row["ttft_median_s"] else None
    row["gain_s"] = full_ttft - row["ttft_median_s"]
    ideal_gain = full_ttft - (row["ttft_median_s"] - row["load_s_median"])
    row["load_cost_of_gain"] = row["load_s_median"] / ideal_gain if ideal_gain > 0 else None
    row["warm_ttft_median_s"] = summary(arm.warm_ttft)["median"]
    row.update(_bytes_per_token(arm, runner))
    return row


def _bytes_per_token(arm: Arm, runner) -> dict:
    """The tier's charged bytes over the tokens its entries hold (headers, not K/V, read)."""
    tier = arm.store.tiers[0]
    keys = tier.keys()
    tokens = 0
    for k in keys:
        info = tier.info(k)
        tokens += info.n_tokens if info is not None else 0
    used = tier.used_bytes
    per = used / tokens if tokens else None
    theory = _theoretical(runner)
    return {"entries": len(keys), "cached_tokens": tokens, "used_bytes": used, "budget_bytes": tier.budget_bytes,
            "bytes_per_token": per, "bytes_per_token_ratio": per / theory if per else None}


def _relative_to_cpu(tiers: dict) -> None:
    cpu = tiers.get("cpu")
    for row in tiers.values():
        row["gain_kept_vs_cpu"] = (row["gain_s"] / cpu["gain_s"]) if cpu and cpu["gain_s"] > 0 else None


def _mixed_row(arm: Arm, full: Arm) -> dict:
    row = _ttft_row(arm)
    full_ttft = summary([r.ttft_s for r in full.records])["median"]
    row["speedup_vs_recompute"] = full_ttft / row["ttft_median_s"]
    stats = arm.store.stats_dict()
    row["store"] = {k: stats["store"][k] for k in ("promotions", "demotions", "demotion_writes_saved", "drops",
                                                   "puts_refused")}
    row["tiers"] = {name: {k: t[k] for k in ("used_bytes", "budget_bytes", "entries", "hits")}
                    for name, t in stats["tiers"].items()}
    row["manager"] = {k: v for k, v in arm.engine.manager.stats().items() if k != "last_refresh"}
    return row


def _targets(results: dict) -> dict:
    tiers = results["tiers"]
    out = {"budget_overruns_zero": results["budget_overruns"] == 0}
    if "cpu" in tiers and tiers["cpu"]["load_cost_of_gain"] is not None:
        out["cpu_load_cost_of_gain_below_10pct"] = tiers["cpu"]["load_cost_of_gain"] < 0.10
    if "disk" in tiers:
        out["disk_gain_kept_vs_cpu"] = tiers["disk"]["gain_kept_vs_cpu"]
    if results["bytes_per_token_ratio"] is not None:
        out["bytes_per_token_within_5pct"] = abs(results["bytes_per_token_ratio"] - 1) <= 0.05
    if results["restart_chunk_hit_rate"] is not None:
        out["restart_reuses_caches"] = results["restart_chunk_hit_rate"] > 0
    return out


# ---------------------------------------------------------------------------------- restart
def _restart(args, work, disk: Arm) -> dict:
    """Replay the stream in a second process over the disk tier's directory."""
    with tempfile.TemporaryDirectory(prefix="cachedrag-restart-") as tmp:
        spec = {"model": args.model, "device": str(disk.engine.runner.device), "disk_dir": str(disk.disk_dir),
                "threads": args.threads,
                "disk_bytes": args.tier_bytes, "mode": args.mode, "seed": args.seed,
                "system_prompt": args.system_prompt, "max_new_tokens": args.max_new_tokens,
                "requests": [[work.retrieved[i], work.questions[i]] for i in range(len(work.questions))],
                "out": str(Path(tmp) / "restart.json")}
        spec_path = Path(tmp) / "spec.json"
        spec_path.write_text(json.dumps(spec))
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "cachedrag.cli", "bench", "tiers", "--restart-child",
                               str(spec_path)], capture_output=True, text=True)
        if proc.returncode != 0:
            return {"error": proc.stderr[-2000:], "chunk_hit_rate": 0.0}
        out = json.loads(Path(spec["out"]).read_text())
    out["process_s"] = time.perf_counter() - t0
    return out


def _restart_child(spec_path: str) -> int:
    """The second process: same model, same disk directory, one pass over the stream."""
    import torch

    from cachedrag.config import EngineConfig
    from cachedrag.engine import CachedEngine
    from cachedrag.fingerprint import namespace_for
    from cachedrag.kvcache.config import CacheConfig
    from cachedrag.model.loader import load_model
    from cachedrag.model.runner import ModelRunner

    spec = json.loads(Path(spec_path).read_text())
    if spec.get("threads"):
        torch.set_num_threads(spec["threads"])
    runner = ModelRunner(*load_model(spec["model"], device=spec["device"]))
    config = EngineConfig(mode=spec["mode"], cache=CacheConfig(seed=spec["seed"]))
    namespace = namespace_for(runner.model, runner.tokenizer, config.tenant_salt).digest
    t0 = time.perf_counter()
    store = _store(namespace, disk_dir=Path(spec["disk_dir"]), disk_bytes=spec["disk_bytes"])
    engine = _engine(runner, config, store)
    startup = time.perf_counter() - t0
    records = []
    for chunks, question in spec["requests"]:
        with torch.inference_mode():
            records.append(engine.generate(chunks, question, spec["system_prompt"],
                                           max_new_tokens=spec["max_new_tokens"]))
    total = sum(r.chunks_hit + r.chunks_missed for r in records)
    first = records[0]
    out = {
        "chunk_hit_rate": sum(r.chunks_hit for r in records) / total if total else 0.0,
        "first_request_chunk_hit_rate": first.chunks_hit / max(1, first.chunks_hit + first.chunks_missed),
        "first_request_ttft_s": first.ttft_s,
        "ttft_median_s": statistics.median(r.ttft_s for r in records),
        "store_open_and_rebuild_s": startup,
        "rebuild": engine.manager.last_refresh.as_dict() if engine.manager.last_refresh else None,
        "disk_corrupt": store.tier("disk").stats.corrupt,
        "problems": store.check_invariants() + engine.manager.check(),
    }
    store.close()
    Path(spec["out"]).write_text(json.dumps(out))
    return 0


# ---------------------------------------------------------------------------------- print
def _fmt(value, digits: int = 4) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def _print_table(results: dict) -> None:
    cols = [("load_s_per_chunk", "load/chunk"), ("first_layer_s_per_chunk", "layer0/chunk"),
            ("recompute_s_per_chunk", "recomp/chunk"), ("ttft_median_s", "ttft_med"), ("speedup_vs_recompute", "x_recomp"),
            ("load_cost_of_gain", "load/gain"), ("gain_kept_vs_cpu", "gain_vs_cpu"), ("bytes_per_token_ratio", "B/tok_ratio"),
            ("chunk_hit_rate", "hit_rate")]
    print(f"\nchunk caches per tier over {results['n_requests']} requests ({results['config']['questions']})")
    print(f"{'tier':>10}" + "".join(f"{h:>13}" for _, h in cols))
    for name, row in results["tiers"].items():
        print(f"{name:>10}" + "".join(f"{_fmt(row.get(c)):>13}" for c, _ in cols))
    rec = results["recompute"]
    print(f"{'recompute':>10}{'':>13}{'':>13}{'':>13}{_fmt(rec['ttft_median_s']):>13}")
    if "mixed" in results:
        m = results["mixed"]
        print(f"{'mixed':>10}{'':>39}{_fmt(m['ttft_median_s']):>13}{_fmt(m['speedup_vs_recompute']):>13}"
              f"   hit rate {m['chunk_hit_rate']:.3f}, store {m['store']}")
    print(f"theoretical bytes/token {results['theoretical_bytes_per_token']}; "
          f"bytes_per_token_ratio (max over tiers) {_fmt(results['bytes_per_token_ratio'])}")
    print(f"budget overruns: {results['budget_overruns']} in {results['budget_samples']} samples; "
          f"restart chunk hit rate: {_fmt(results['restart_chunk_hit_rate'])}")
    if results.get("skipped"):
        print(f"skipped: {results['skipped']}")
    print(f"targets: {results['targets']}")
