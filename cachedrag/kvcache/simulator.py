"""Trace simulator: hit rates of the replacement policies on skewed RAG traces.

Owns: ``make_workload`` (deterministic Zipf-skewed request traces over a corpus of documents
with variable token lengths), ``simulate`` (one policy, one cache size) and
``compare_policies`` (the RAGCache Table 2 analogue: document and token hit rate per policy x
cache size, plus the share of prefill time saved under a cost profile). Pure Python, runs the
real ``KnowledgeTree`` and ``policy`` code on integer doc ids: no tensors.

Does not own: the policies or the tree (it drives them), real timings (a profile is given).

Run it: ``python -m cachedrag.kvcache.simulator --help`` (prints the table; ``--json OUT``).

Workload model (``make_workload``):
  * document popularity is Zipf(s) over ranks, ranks shuffled onto doc ids; with s = 1 the top
    3% of 2,000 docs take ~57% of retrievals (RAGCache reports 3% -> 60%);
  * a request retrieves ``top_k`` distinct documents, drawn by popularity, in draw order (the
    first is the most relevant); with ``n_queries`` set, requests repeat one of ``n_queries``
    fixed queries chosen by Zipf(``query_zipf_s``), so whole doc sequences recur;
  * optional popularity drift: every ``drift_every`` requests the hottest ``drift_fraction``
    of ranks swap with random ranks (hot documents go cold, cold ones turn hot; fixed queries
    are redrawn), as topics come and go in a real service;
  * document lengths are log-normal (median ``median_doc_tokens``, ``doc_tokens_sigma``),
    clamped to [``min_doc_tokens``, ``max_doc_tokens``], independent of popularity.

Structures (``simulate(structure=...)``):
  * ``"tree"``: RAGCache's knowledge tree, exact prefix reuse: a document hits only if the
    system prompt and every document before it match a tree path in order.
  * ``"chunk"``: a position-independent chunk cache (Cache-Craft style): a document hits if it
    is cached at all; each reuse needs CFO x len tokens recomputed, with CFO from
    ``variants.score`` on synthetic metadata (each doc's CCI drawn in [0.05, 0.5]; inter-attention
    spread evenly over the docs in front of it when it was cached).

Metrics: doc_hit_rate = hit docs / requested docs; token_hit_rate = hit doc tokens / requested
doc tokens (the system prompt and question are not counted); time_saved_fraction =
sum of (T_full - T_with_cache) / sum of T_full under the profile (chunk structure: a hit doc
saves (1 - CFO) x T(start, len)); ``warmup`` requests are simulated but not counted.
"""

from __future__ import annotations

import argparse
import bisect
import itertools
import json
import math
import random
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from cachedrag.kvcache.policy import POLICY_NAMES, make_policy
from cachedrag.kvcache.profile import PrefillProfile
from cachedrag.kvcache.tree import KnowledgeTree
from cachedrag.kvcache.variants import AttentionMetadata, score

DEFAULT_POLICIES: tuple[str, ...] = ("pgdsf", "gdsf", "lru", "lfu", "cachecraft_fr")
DEFAULT_FRACTIONS: tuple[float, ...] = (0.02, 0.05, 0.1, 0.2, 0.4)


class ZipfSampler:
    """Draws ranks 0..n-1 with P(rank r) proportional to 1 / (r + 1)^s."""

    def __init__(self, n: int, s: float) -> None:
        if n < 1:
            raise ValueError(f"ZipfSampler: n must be >= 1, got {n}")
        self.n = n
        self._cum = list(itertools.accumulate(1.0 / (r + 1) ** s for r in range(n)))

    def draw(self, rng: random.Random) -> int:
        return min(self.n - 1, bisect.bisect_left(self._cum, rng.random() * self._cum[-1]))

    def draw_distinct(self, rng: random.Random, k: int) -> list[int]:
        k = min(k, self.n)
        seen: dict[int, None] = {}
        while len(seen) < k:
            seen.setdefault(self.draw(rng), None)
        return list(seen)


@dataclass(frozen=True)
class Workload:
    """requests: per request the ordered doc ids; doc_tokens: tokens of each doc id."""

    requests: tuple[tuple[int, ...], ...]
    doc_tokens: tuple[int, ...]
    system_tokens: int = 64
    question_tokens: int = 32
    params: dict[str, Any] = field(default_factory=dict)

    def unique_doc_tokens(self) -> int:
        """Tokens of the distinct docs the trace requests (the size of a cache that holds all)."""
        return sum(self.doc_tokens[d] for d in {d for r in self.requests for d in r})


def make_workload(
    n_requests: int = 3_000,
    n_docs: int = 2_000,
    top_k: int = 5,
    *,
    zipf_s: float = 1.0,
    n_queries: int | None = None,
    query_zipf_s: float = 1.0,
    median_doc_tokens: int = 300,
    doc_tokens_sigma: float = 0.6,
    min_doc_tokens: int = 32,
    max_doc_tokens: int = 2048,
    fixed_doc_tokens: int | None = None,
    drift_every: int | None = None,
    drift_fraction: float = 0.05,
    system_tokens: int = 64,
    question_tokens: int = 32,
    seed: int = 0,
) -> Workload:
    """A deterministic Zipf-skewed trace (see the module docstring)."""
    if drift_every is not None and (drift_every < 1 or not 0 <= drift_fraction <= 1):
        raise ValueError("make_workload: drift_every must be >= 1 and drift_fraction in [0, 1]")
    if top_k < 1 or n_requests < 0:
        raise ValueError("make_workload: top_k must be >= 1 and n_requests >= 0")
    rng = random.Random(seed)
    perm = list(range(n_docs))
    rng.shuffle(perm)  # popularity rank -> doc id
    docs = ZipfSampler(n_docs, zipf_s)
    if fixed_doc_tokens is not None:
        sizes = tuple([fixed_doc_tokens] * n_docs)
    else:
        mu = math.log(median_doc_tokens)
        sizes = tuple(
            min(max_doc_tokens, max(min_doc_tokens, round(rng.lognormvariate(mu, doc_tokens_sigma))))
            for _ in range(n_docs)
        )
    n_hot = math.ceil(drift_fraction * n_docs)
    qs = ZipfSampler(n_queries, query_zipf_s) if n_queries is not None else None
    queries: list[tuple[int, ...]] = []
    out: list[tuple[int, ...]] = []
    for i in range(n_requests):
        if drift_every is not None and i > 0 and i % drift_every == 0:
            for r in range(n_hot):  # the hottest ranks swap with random ranks
                j = rng.randrange(n_docs)
                perm[r], perm[j] = perm[j], perm[r]
            queries = []  # queries follow the new popularity
        if qs is None:
            out.append(tuple(perm[r] for r in docs.draw_distinct(rng, top_k)))
        else:
            if not queries:
                queries = [tuple(perm[r] for r in docs.draw_distinct(rng, top_k)) for _ in range(n_queries)]
            out.append(queries[qs.draw(rng)])
    requests = tuple(out)
    params = {
        "n_requests": n_requests, "n_docs": n_docs, "top_k": top_k, "zipf_s": zipf_s,
        "n_queries": n_queries, "query_zipf_s": query_zipf_s, "median_doc_tokens": median_doc_tokens,
        "doc_tokens_sigma": doc_tokens_sigma, "fixed_doc_tokens": fixed_doc_tokens,
        "drift_every": drift_every, "drift_fraction": drift_fraction, "seed": seed,
    }
    return Workload(requests, sizes, system_tokens, question_tokens, params)


@dataclass
class SimStats:
    """Counters and rates of one simulation."""

    policy: str
    structure: str
    capacity_tokens: int
    requests: int = 0
    docs: int = 0
    doc_hits: int = 0
    tokens: int = 0
    token_hits: int = 0
    evictions: int = 0
    cfo_sum: float = 0.0
    time_full: float = 0.0
    time_saved: float = 0.0
    has_profile: bool = False

    @property
    def doc_hit_rate(self) -> float:
        return self.doc_hits / self.docs if self.docs else 0.0

    @property
    def token_hit_rate(self) -> float:
        return self.token_hits / self.tokens if self.tokens else 0.0

    @property
    def time_saved_fraction(self) -> float | None:
        return self.time_saved / self.time_full if self.has_profile and self.time_full else None

    @property
    def mean_cfo(self) -> float | None:
        return self.cfo_sum / self.doc_hits if self.structure == "chunk" and self.doc_hits else None

    def to_dict(self) -> dict[str, Any]:
        out = {k: v for k, v in asdict(self).items() if k not in ("cfo_sum", "time_full", "time_saved", "has_profile")}
        out.update(
            doc_hit_rate=round(self.doc_hit_rate, 4),
            token_hit_rate=round(self.token_hit_rate, 4),
            time_saved_fraction=None if self.time_saved_fraction is None else round(self.time_saved_fraction, 4),
            mean_cfo=None if self.mean_cfo is None else round(self.mean_cfo, 4),
        )
        return out


def simulate(
    trace: Sequence[Sequence[int]],
    sizes: Sequence[int],
    policy: str,
    capacity: int,
    profile: PrefillProfile | None = None,
    *,
    structure: str = "tree",
    system_tokens: int = 64,
    question_tokens: int = 32,
    warmup: int = 0,
    cfo_floor: float = 0.05,
    alpha: float = 1.0,
    cold_cci: float = 0.15,
    seed: int = 0,
) -> SimStats:
    """Replay ``trace`` (ordered doc ids per request) through a cache of ``capacity`` tokens.

    ``sizes[d]`` is doc d's token count; bytes = tokens (one byte per token) so the capacity is
    in tokens and includes the system prompt node in the ``tree`` structure. ``profile`` gives
    PGDSF its costs and enables ``time_saved_fraction``. Every document of a request is
    inserted after it is served (evicting by ``policy``); a document that cannot fit ends the
    insertion of that request's path.
    """
    if structure not in ("tree", "chunk"):
        raise ValueError(f"simulate: structure must be 'tree' or 'chunk', got {structure!r}")
    pol = make_policy(policy)
    stats = SimStats(pol.name, structure, capacity, has_profile=profile is not None)
    tree = KnowledgeTree(pol, profile, cfo_floor=cfo_floor)
    if structure == "tree":
        _simulate_tree(tree, trace, sizes, capacity, profile, stats, system_tokens, question_tokens, warmup)
    else:
        _simulate_chunks(
            tree, trace, sizes, capacity, profile, stats, system_tokens, question_tokens, warmup,
            alpha=alpha, cold_cci=cold_cci, seed=seed,
        )
    stats.evictions = tree.evictions
    return stats


def _fit(tree: KnowledgeTree, n_bytes: int, capacity: int) -> bool:
    over = tree.total_bytes + n_bytes - capacity
    if over > 0:
        tree.evict_until(over)
    return tree.total_bytes + n_bytes <= capacity


def _simulate_tree(tree, trace, sizes, capacity, profile, stats, system_tokens, question_tokens, warmup) -> None:
    sys_key = "sys"
    for r, docs in enumerate(trace):
        path = [sys_key] + [f"d{d}" for d in docs]
        toks = [system_tokens] + [sizes[d] for d in docs]
        nodes = tree.match_prefix(path, pin=True)
        if r >= warmup:
            hit_docs = max(0, len(nodes) - 1)
            stats.requests += 1
            stats.docs += len(docs)
            stats.doc_hits += hit_docs
            stats.tokens += sum(toks[1:])
            stats.token_hits += sum(toks[1 : 1 + hit_docs])
            if profile is not None:
                total = sum(toks) + question_tokens
                cached = sum(toks[: len(nodes)])
                full = profile.time(0, total)
                stats.time_full += full
                stats.time_saved += max(0.0, full - profile.time(cached, total - cached))
        tree.touch(nodes)
        pinned = list(nodes)
        for j in range(len(nodes), len(path)):
            if not _fit(tree, toks[j], capacity):
                break
            res = tree.insert(path[: j + 1], [None] * (j + 1), toks[: j + 1], toks[: j + 1])
            tree.pin([res.nodes[-1]])
            pinned.append(res.nodes[-1])
        tree.unpin(pinned)


def _simulate_chunks(
    tree, trace, sizes, capacity, profile, stats, system_tokens, question_tokens, warmup, *, alpha, cold_cci, seed
) -> None:
    crng = random.Random(f"cci:{seed}")
    cci = [crng.uniform(0.05, 0.5) for _ in range(len(sizes))]
    metas: dict[str, AttentionMetadata] = {}
    for r, docs in enumerate(trace):
        keys = [f"d{d}" for d in docs]
        counted = r >= warmup
        if counted:
            stats.requests += 1
            stats.docs += len(docs)
            stats.tokens += sum(sizes[d] for d in docs)
            total = system_tokens + sum(sizes[d] for d in docs) + question_tokens
            if profile is not None:
                stats.time_full += profile.time(0, total)
        start = system_tokens
        pinned = []
        for j, (d, key) in enumerate(zip(docs, keys)):
            n = sizes[d]
            nodes = tree.match_prefix([key], pin=True)
            if nodes:
                pinned.extend(nodes)
                c = score(metas[key], keys[:j], alpha=alpha, cold_cci=cold_cci).cfo
                tree.touch(nodes, cfo=c)
                if counted:
                    stats.doc_hits += 1
                    stats.token_hits += n
                    stats.cfo_sum += c
                    if profile is not None:
                        stats.time_saved += (1.0 - c) * profile.marginal_cost(start, n)
            elif _fit(tree, n, capacity):
                res = tree.insert([key], [None], [n], [n], pin=True)
                pinned.extend(res.nodes)
                prior = tuple(dict.fromkeys(k for k in keys[:j] if k != key))
                if prior:
                    share = cci[d] / len(prior)
                    metas[key] = AttentionMetadata(prior, {k: share for k in prior}, 1.0 - cci[d], [0.0])
                else:
                    metas[key] = AttentionMetadata.standalone(1)
            start += n
        tree.unpin(pinned)
        if len(metas) > 4 * max(1, len(tree)) + 1024:
            live = {n.key for n in tree.nodes()}
            for k in [k for k in metas if k not in live]:
                del metas[k]


@dataclass
class PolicyTable:
    """Rows of ``SimStats``: one per (policy, capacity)."""

    rows: list[SimStats]
    fractions: tuple[float, ...]
    unique_tokens: int
    structure: str
    workload: dict[str, Any]

    def get(self, policy: str, fraction: float) -> SimStats:
        i = self.fractions.index(fraction)
        return [r for r in self.rows if r.policy == make_policy(policy).name][i]

    def format(self) -> str:
        """A markdown table: per policy, doc / token hit rate (and time saved) per cache size."""
        head = "| policy | " + " | ".join(f"{f:.0%} ({int(f * self.unique_tokens)} tok)" for f in self.fractions) + " |"
        sep = "|---|" + "---|" * len(self.fractions)
        lines = [f"structure: {self.structure}; cells: doc hit / token hit / prefill time saved", head, sep]
        for name in dict.fromkeys(r.policy for r in self.rows):
            cells = []
            for r in (r for r in self.rows if r.policy == name):
                t = r.time_saved_fraction
                cells.append(f"{r.doc_hit_rate:.3f} / {r.token_hit_rate:.3f}" + (f" / {t:.3f}" if t is not None else ""))
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return {
            "structure": self.structure,
            "fractions": list(self.fractions),
            "unique_tokens": self.unique_tokens,
            "workload": self.workload,
            "rows": [r.to_dict() for r in self.rows],
        }


def compare_policies(
    workload: Workload,
    fractions: Sequence[float] = DEFAULT_FRACTIONS,
    policies: Sequence[str] = DEFAULT_POLICIES,
    profile: PrefillProfile | None = None,
    *,
    structure: str = "tree",
    warmup: int | None = None,
) -> PolicyTable:
    """Simulate every policy at capacities = fraction x the trace's unique doc tokens.

    ``profile`` defaults to ``PrefillProfile.analytic()`` (prefill-shaped, quadratic part in
    length); ``warmup`` defaults to 10% of the trace.
    """
    profile = profile if profile is not None else PrefillProfile.analytic()
    unique = workload.unique_doc_tokens()
    warm = len(workload.requests) // 10 if warmup is None else warmup
    rows = []
    for name in policies:
        for f in fractions:
            cap = int(f * unique)
            if structure == "tree":
                cap += workload.system_tokens
            rows.append(
                simulate(
                    workload.requests, workload.doc_tokens, name, cap, profile, structure=structure,
                    system_tokens=workload.system_tokens, question_tokens=workload.question_tokens, warmup=warm,
                )
            )
    return PolicyTable(rows, tuple(fractions), unique, structure, dict(workload.params))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m cachedrag.kvcache.simulator", description=__doc__.split("\n")[0])
    p.add_argument("--requests", type=int, default=3_000)
    p.add_argument("--docs", type=int, default=2_000)
    p.add_argument("--top-k", type=int, default=5)
    p.add_argument("--zipf", type=float, default=1.0, help="document popularity skew s")
    p.add_argument("--queries", type=int, default=None, help="repeat one of this many fixed queries (Zipf)")
    p.add_argument("--median-tokens", type=int, default=300)
    p.add_argument("--sigma", type=float, default=0.6, help="log-normal sigma of doc lengths (0 = fixed)")
    p.add_argument("--drift-every", type=int, default=None, help="requests between popularity shifts")
    p.add_argument("--drift-fraction", type=float, default=0.05, help="share of hottest ranks reshuffled per shift")
    p.add_argument("--structure", choices=("tree", "chunk"), default="tree")
    p.add_argument("--fractions", type=float, nargs="+", default=list(DEFAULT_FRACTIONS))
    p.add_argument("--policies", nargs="+", default=list(DEFAULT_POLICIES), choices=sorted(POLICY_NAMES))
    p.add_argument("--profile", help="a PrefillProfile JSON (default: the analytic prefill shape)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="also write the table as JSON here")
    args = p.parse_args(argv)
    wl = make_workload(
        args.requests, args.docs, args.top_k, zipf_s=args.zipf, n_queries=args.queries,
        median_doc_tokens=args.median_tokens, doc_tokens_sigma=args.sigma,
        fixed_doc_tokens=args.median_tokens if args.sigma == 0 else None,
        drift_every=args.drift_every, drift_fraction=args.drift_fraction, seed=args.seed,
    )
    prof = PrefillProfile.load(args.profile) if args.profile else None
    table = compare_policies(wl, args.fractions, args.policies, prof, structure=args.structure)
    print(table.format())
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(table.to_dict(), fh, indent=1)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
