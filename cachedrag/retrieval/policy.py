"""Lookahead policy: which clusters to prefetch, how many bytes, how to stage a search.

Owns: the pure-Python decisions of the lookahead retriever (no torch here): the prefetch
plan (whole clusters in centroid order up to a byte budget), the profile-guided budget
b_p = bandwidth x mean pre-retrieval LLM time (TeleRAG), and the split of probed clusters
into search stages (RAGCache speculative pipelining). Does not own: moving bytes or scoring
vectors (see ``cluster_store`` and ``ivf``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from statistics import fmean

from cachedrag.errors import ConfigError, EmptyInputError


@dataclass(frozen=True)
class PrefetchPlan:
    """Clusters one prefetch keeps in the fast tier, in centroid order."""

    clusters: tuple[int, ...]  # planned clusters, nearest centroid first
    to_copy: tuple[int, ...]  # planned clusters not yet resident (to move now)
    to_evict: tuple[int, ...]  # resident clusters outside the plan
    planned_bytes: int  # bytes of all planned clusters (<= budget)
    budget_bytes: int


def plan_prefetch(
    centroid_order: Sequence[int],
    cluster_bytes: Mapping[int, int] | Sequence[int],
    budget_bytes: int,
    resident: Sequence[int] = (),
) -> PrefetchPlan:
    """Whole clusters in centroid order while their total fits in ``budget_bytes``.

    The plan is a prefix of ``centroid_order``: it stops at the first cluster that does not
    fit (a farther, smaller cluster is less likely to be probed than the one skipped).
    Resident clusters in the plan are kept and not copied again; resident clusters outside
    it are evicted, so the fast tier never holds more than the budget after a prefetch.
    """
    if budget_bytes < 0:
        raise ConfigError(f"prefetch budget must be >= 0 bytes, got {budget_bytes}")
    chosen: list[int] = []
    total = 0
    for cid in centroid_order:
        size = cluster_bytes[cid]
        if total + size > budget_bytes:
            break
        chosen.append(cid)
        total += size
    planned = set(chosen)
    held = set(resident)
    return PrefetchPlan(
        clusters=tuple(chosen),
        to_copy=tuple(c for c in chosen if c not in held),
        to_evict=tuple(sorted(held - planned)),
        planned_bytes=total,
        budget_bytes=budget_bytes,
    )


def prefetch_budget(bandwidth_bytes_per_s: float, llm_times_s: Sequence[float]) -> int:
    """Profile-guided budget b_p = bandwidth x mean pre-retrieval LLM time (bytes).

    ``llm_times_s`` are the measured durations of the LLM step that precedes retrieval
    (query transformation) on a calibration set of the pipeline.
    """
    if not llm_times_s:
        raise EmptyInputError("prefetch_budget needs at least one measured LLM time")
    if bandwidth_bytes_per_s <= 0 or any(t < 0 for t in llm_times_s):
        raise ConfigError("bandwidth must be > 0 and LLM times >= 0")
    return int(bandwidth_bytes_per_s * fmean(llm_times_s))


def stage_bounds(n_clusters: int, n_stages: int) -> list[tuple[int, int]]:
    """Split ``n_clusters`` probed clusters (centroid order) into contiguous stage ranges.

    Sizes differ by at most one, earlier stages larger; more stages than clusters gives one
    stage per cluster.
    """
    if n_stages < 1:
        raise ConfigError(f"n_stages must be >= 1, got {n_stages}")
    n_stages = min(n_stages, max(n_clusters, 1))
    base, extra = divmod(n_clusters, n_stages)
    bounds, start = [], 0
    for stage in range(n_stages):
        stop = start + base + (1 if stage < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


def hit_fraction(probed: Sequence[int], resident: set[int] | frozenset[int]) -> float:
    """Fraction of ``probed`` clusters found in ``resident`` (1.0 for an empty probe list)."""
    if not probed:
        return 1.0
    return sum(1 for c in probed if c in resident) / len(probed)


def speculation_stages(other_requests: int, max_stages: int, busy_requests: int,
                       expected_search_s: float | None = None, min_search_s: float = 0.0) -> int:
    """Search stages for a request, from the engine's load (RAGCache's dynamic rule).

    Speculative prefill only pays when the engine has spare capacity: with no other request
    in flight the search runs in ``max_stages`` stages (a speculation after each but the
    last); each other request in flight divides the stages; from ``busy_requests`` other
    requests on, one stage (no speculation: the engine's time goes to real work). And only
    when there is search time to hide: with ``expected_search_s`` (recent searches) below
    ``min_search_s``, one stage (each speculative step has a fixed cost that a short search
    cannot pay back).
    """
    if max_stages < 1 or busy_requests < 1 or other_requests < 0 or min_search_s < 0:
        raise ConfigError("max_stages and busy_requests must be >= 1, other_requests and min_search_s >= 0")
    if other_requests >= busy_requests:
        return 1
    if expected_search_s is not None and expected_search_s < min_search_s:
        return 1
    return max(1, max_stages // (1 + other_requests))
