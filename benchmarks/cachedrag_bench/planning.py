"""The planning micro-benchmark: ``Planner.plan`` timed on a large synthetic registry.

Owns ``benchmark_planning`` (``cachedrag bench ttft`` reports its figures). Planning itself is
``cachedrag.kvcache.planner``'s; this module only builds a registry and a trace and times it.
"""

from __future__ import annotations

import math
import random
import statistics
import time
from typing import Any

from cachedrag.kvcache.config import CacheConfig
from cachedrag.kvcache.index import VariantIndex
from cachedrag.kvcache.planner import Action, Mode, PlanRequest, Planner, Segment
from cachedrag.kvcache.tree import KnowledgeTree


def benchmark_planning(
    n_chunks: int = 10_000,
    n_requests: int = 2_000,
    top_k: int = 5,
    *,
    variants_per_chunk: int = 2,
    chunk_tokens: int = 256,
    system_tokens: int = 64,
    question_tokens: int = 32,
    tree_fraction: float = 0.2,
    mode: str | Mode = Mode.CACHEDRAG,
    seed: int = 0,
) -> dict[str, Any]:
    """Time ``Planner.plan`` on a registry of ``n_chunks`` x ``variants_per_chunk`` variants.

    Builds synthetic metadata (random prior chunks, masses and per-token fractions), a tree
    holding the paths of the first ``tree_fraction`` of the requests, and a Zipf trace of
    ``n_requests`` top-``top_k`` requests (repeated queries hit the tree). Each request is
    planned (timed), then released as used (timed apart). Returns plain numbers (microseconds)
    for ``cachedrag bench ttft``; the target is < 1 ms per request at 10k chunks. ``plan_us_*``
    is wall time (includes preemption on a loaded machine); ``plan_cpu_us_*`` is this thread's
    CPU time, the noise-robust figure.
    """
    from array import array

    from cachedrag.kvcache.simulator import make_workload
    from cachedrag.kvcache.variants import AttentionMetadata

    t_build = time.perf_counter()
    rng = random.Random(seed)
    workload = make_workload(
        n_requests=n_requests, n_docs=n_chunks, top_k=top_k, seed=seed,
        system_tokens=system_tokens, question_tokens=question_tokens, fixed_doc_tokens=chunk_tokens,
    )
    keys = [f"{i:064x}" for i in range(n_chunks)]
    pool = [array("f", (rng.random() for _ in range(chunk_tokens))) for _ in range(32)]
    cfg = CacheConfig(max_chunks=n_chunks, max_variants_per_chunk=max(1, variants_per_chunk), seed=seed)
    index = VariantIndex.from_config(cfg)
    for i, key in enumerate(keys):
        for v in range(variants_per_chunk):
            if v == 0:
                meta = AttentionMetadata((), {}, 1.0, pool[rng.randrange(len(pool))])
            else:
                prior = tuple(keys[rng.randrange(n_chunks)] for _ in range(rng.randint(1, max(1, top_k - 1))))
                prior = tuple(dict.fromkeys(k for k in prior if k != key)) or (keys[(i + 1) % n_chunks],)
                inter = {k: rng.random() for k in prior}
                meta = AttentionMetadata(prior, inter, rng.uniform(0.5, 3.0), pool[rng.randrange(len(pool))])
            index.add(key, ("kv", i, v), meta)
    tree = KnowledgeTree.from_config(cfg)
    sys_key = "s" * 64
    n_tree = int(len(workload.requests) * tree_fraction)
    for docs in workload.requests[:n_tree]:
        path = [sys_key] + [keys[d] for d in docs]
        tokens = [system_tokens] + [chunk_tokens] * len(docs)
        tree.insert(path, [None] * len(path), tokens, [t * 1024 for t in tokens])
    planner = Planner(tree, index, cfg)
    requests = [
        PlanRequest((Segment(sys_key, system_tokens),), tuple(Segment(keys[d], chunk_tokens) for d in docs), question_tokens)
        for docs in workload.requests
    ]
    build_s = time.perf_counter() - t_build

    plan_us: list[float] = []
    cpu_us: list[float] = []
    release_us: list[float] = []
    reused = tree_hits = chunks = 0
    compute_fraction = 0.0
    for req in requests:
        c0 = time.thread_time()
        t0 = time.perf_counter()
        plan = planner.plan(req, mode)
        t1 = time.perf_counter()
        c1 = time.thread_time()
        planner.release(plan, used=True)
        t2 = time.perf_counter()
        plan_us.append((t1 - t0) * 1e6)
        cpu_us.append((c1 - c0) * 1e6)
        release_us.append((t2 - t1) * 1e6)
        for s in plan.chunks:
            chunks += 1
            reused += s.action is Action.REUSE
            tree_hits += s.action is Action.TREE
        compute_fraction += plan.compute_fraction
    plan_us.sort()
    cpu_us.sort()

    def pct(p: float, xs: list[float] = plan_us) -> float:
        return round(xs[min(len(xs) - 1, math.ceil(p / 100 * len(xs)) - 1)], 2)

    n = len(requests)
    return {
        "n_chunks": n_chunks,
        "n_variants": len(index),
        "tree_nodes": len(tree),
        "n_requests": n,
        "top_k": top_k,
        "chunk_tokens": chunk_tokens,
        "mode": Mode(mode).value,
        "build_s": round(build_s, 3),
        "plan_us_mean": round(statistics.fmean(plan_us), 2),
        "plan_us_p50": pct(50),
        "plan_us_p90": pct(90),
        "plan_us_p99": pct(99),
        "plan_us_max": round(plan_us[-1], 2),
        "plan_cpu_us_mean": round(statistics.fmean(cpu_us), 2),
        "plan_cpu_us_p99": pct(99, cpu_us),
        "release_us_mean": round(statistics.fmean(release_us), 2),
        "under_1ms_fraction": round(sum(1 for t in plan_us if t < 1000) / n, 4),
        "tree_hit_chunk_fraction": round(tree_hits / chunks, 4) if chunks else 0.0,
        "reused_chunk_fraction": round(reused / chunks, 4) if chunks else 0.0,
        "mean_compute_fraction": round(compute_fraction / n, 4),
    }
