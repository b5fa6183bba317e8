"""Paper estimate: how chunk hit rate and TTFT scale with replicas and corpus size.

Owns: ``scale_estimate`` — replays deterministic Zipf RAG traces (``kvcache.simulator``) through
R replicas' caches under the two routings (round-robin; chunk affinity with the real
``AffinityPolicy`` over doc ids) and a shared tier, and turns hit rates into a relative TTFT
with a stated linear cost model. Pure Python (no torch, no Ray): a simulation, not a
measurement; ``cachedrag bench cluster`` measures the 2-replica point on this machine.

Model (one number each, all reported with the table):

- requests repeat ``queries_per_doc x docs`` fixed queries drawn by Zipf (whole doc sets recur,
  as one question's retrieval does), docs by Zipf(``zipf_s``);
- each replica has a local cache of ``replica_cache_tokens`` (the fast tiers; Cache-Craft's
  chunk structure, PGDSF replacement); round-robin sends request i to replica i mod R, affinity
  to ``AffinityPolicy.choose`` of the request's doc ids (queues equal: the load bound is a
  run-time effect, left out here); ``one`` is a single replica holding all R caches (the
  reference of the issue's target: affinity's hit rate vs one replica with the same total cache);
- the shared Redis tier holds ``shared_cache_tokens`` and sees every request's docs (all
  replicas write through), so a local miss is a shared hit when the whole trace replayed
  through one cache of that size would hit (an upper bound of a request-level join);
- relative TTFT of a doc = 1 (computed), ``hit_cost`` (served from the local tier: the
  recompute share plus the question), or ``hit_cost + load_cost`` (from Redis: also its bytes
  over the network); a request's TTFT is the mean over its docs. ``hit_cost`` and
  ``load_cost`` default to shares measured by ``bench cluster``'s ``redis_reuse`` section.
"""

from __future__ import annotations

from collections.abc import Sequence

from cachedrag.cluster.affinity import AffinityPolicy
from cachedrag.kvcache.simulator import make_workload, simulate


def _split(trace: Sequence[Sequence[int]], replicas: int, routing: str) -> list[list[tuple[int, ...]]]:
    parts: list[list[tuple[int, ...]]] = [[] for _ in range(replicas)]
    names = [f"replica-{i}" for i in range(replicas)]
    policy = AffinityPolicy()
    idle = dict.fromkeys(names, 0)
    for i, req in enumerate(trace):
        if routing == "round_robin":
            parts[i % replicas].append(tuple(req))
        else:
            chosen = policy.choose([f"doc-{d}" for d in req], idle) or names[0]
            parts[names.index(chosen)].append(tuple(req))
    return parts


def scale_estimate(replicas: Sequence[int] = (1, 2, 4, 8), corpus_docs: Sequence[int] = (1_000, 4_000, 16_000), *,
                   n_requests: int = 4_000, top_k: int = 5, zipf_s: float = 1.0, queries_per_doc: float = 0.5,
                   replica_cache_tokens: int = 60_000, shared_cache_tokens: int = 2_000_000,
                   hit_cost: float = 0.35, load_cost: float = 0.1, policy: str = "pgdsf",
                   seed: int = 0) -> list[dict]:
    """One row per (corpus size, replicas, routing): local / total doc hit rate, relative TTFT."""
    rows = []
    for n_docs in corpus_docs:
        wl = make_workload(n_requests, n_docs, top_k, zipf_s=zipf_s, n_queries=max(1, int(queries_per_doc * n_docs)),
                           seed=seed)
        warm = n_requests // 5
        shared = simulate(wl.requests, wl.doc_tokens, "lru", shared_cache_tokens, structure="chunk", warmup=warm)
        for r in replicas:
            for routing in ("one", "round_robin", "affinity"):
                if r == 1 and routing != "one":
                    continue  # one replica: routing does not matter
                local_hits = docs = 0
                parts = [list(wl.requests)] if routing == "one" else _split(wl.requests, r, routing)
                cache = replica_cache_tokens * (r if routing == "one" else 1)  # "one": all R caches in one
                for part in parts:
                    if not part:
                        continue
                    s = simulate(part, wl.doc_tokens, policy, cache, structure="chunk", warmup=len(part) // 5)
                    local_hits += s.doc_hits
                    docs += s.docs
                local = local_hits / docs if docs else 0.0
                total = max(local, shared.doc_hit_rate)
                ttft_alone = (1 - local) + local * hit_cost
                ttft_shared = (1 - total) + local * hit_cost + (total - local) * (hit_cost + load_cost)
                rows.append({"corpus_docs": n_docs, "replicas": r, "routing": routing,
                             "local_hit_rate": round(local, 4), "shared_hit_rate": round(total, 4),
                             "ttft_rel_no_sharing": round(ttft_alone, 4), "ttft_rel_with_redis": round(ttft_shared, 4)})
    return rows


def format_estimate(rows: list[dict]) -> str:
    head = f"{'docs':>6} {'R':>2} {'routing':<11} {'local hit':>9} {'+redis hit':>10} {'TTFT no-share':>13} {'TTFT +redis':>11}"
    lines = [head]
    for r in rows:
        lines.append(f"{r['corpus_docs']:>6} {r['replicas']:>2} {r['routing']:<11} {r['local_hit_rate']:>9.3f} "
                     f"{r['shared_hit_rate']:>10.3f} {r['ttft_rel_no_sharing']:>13.3f} {r['ttft_rel_with_redis']:>11.3f}")
    return "\n".join(lines)
