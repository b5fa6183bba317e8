"""Chunk-affinity routing policy: which replica should serve a request, given its chunks.

Owns: ``AffinityConfig`` (the load bound) and ``AffinityPolicy.rank`` — pure Python, no torch,
no Ray, so it is unit-tested on plain strings and integers. The Ray Serve request router
(``cachedrag.cluster.router``) feeds it replica ids and queue lengths and turns its ranking
into Serve's ``choose_replicas`` answer.

Does not own: finding a request's chunk fingerprints (``cachedrag.cluster.fingerprints``),
queue-length probing or the replica set (Ray Serve's ``RequestRouter`` base keeps those).

The rule, rendezvous (highest-random-weight) hashing with bounded load:

0. Prefill-aware load (when the caller passes ``pending``: requests routed to a replica that
   have not produced their first token, ``cachedrag.cluster.board``): only replicas with at
   most ``min_pending + prefill_slack`` pending requests are candidates. A pending request
   costs its replica a whole prefill; a decoding one, a share of a batched step.

1. Every chunk fingerprint ranks all replicas by ``hash(fingerprint, replica)``; its first
   replica is its *owner*. Owners are stable: adding or losing a replica moves only the chunks
   that replica owned (the point of rendezvous hashing over ``hash % n``), so a replica's fast
   tiers keep serving the chunks it owned before.
2. Load bound: a replica is *eligible* while taking the request keeps its queue within
   ``cap = max(min_queue + 1 + slack, ceil(load_factor x (total_queue + 1) / replicas))``
   (consistent hashing with bounded loads, Mirrokni et al. 2018: the cap is on the load
   *after* placing the request). A hot chunk set therefore cannot pile onto one replica: once
   its owner is over the bound, each chunk votes for its highest-ranked *eligible* replica
   instead (its rendezvous runner-up, a stable spill target that warms up too). With
   ``slack=0, load_factor=1`` (the defaults) only the least-loaded replicas are eligible:
   affinity breaks ties between equally loaded replicas and never queues a request behind
   another while a replica has less work (the measured best where every replica can read
   every chunk from a cheap shared tier, ``docs/scale-out.md``); a larger slack or factor
   trades balance for locality (where loading from the shared tier is expensive).
3. Each eligible replica gets the summed weight of the chunks voting for it (a chunk's
   weight is its length share when given, else 1); the highest score wins, ties to the
   shorter queue, then to the larger summed hash (deterministic).
4. No fingerprints (or no votes): least-loaded, ties by replica id order given.

``rank`` returns tiers of replica ids, most preferred first (Serve tries the first tier, and
the later ones when every replica of the first refuses: full queues). Why hand-written: the
rule is a dozen lines over ``hashlib``; the libraries that exist (e.g. ``uhashring``) do
ketama rings without load bounds or weighted votes.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping, Sequence

from pydantic import BaseModel, ConfigDict, Field


class AffinityConfig(BaseModel):
    """How far affinity may unbalance the replicas' queues before it yields."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    slack: int = Field(0, ge=0, description="queued requests a replica may hold beyond the least-loaded one "
                                            "and still take requests by affinity (0: only the least loaded)")
    load_factor: float = Field(1.0, ge=1.0, description="bounded-load factor: a replica whose queue would exceed "
                                                         "ceil(factor x mean queue after placing the request) (and "
                                                         "min + 1 + slack) takes no affinity traffic")
    prefill_slack: int = Field(0, ge=0, description="requests before their first token a replica may hold beyond "
                                                    "the replica with the fewest and still be a candidate")
    max_fingerprints: int = Field(64, ge=1, description="chunks of one request considered (the first ones)")


def hrw_weight(fingerprint: str, replica: str) -> int:
    """Rendezvous weight of ``replica`` for ``fingerprint`` (64-bit, stable across processes)."""
    digest = hashlib.blake2b(f"{fingerprint}\x1f{replica}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def owner(fingerprint: str, replicas: Sequence[str]) -> str:
    """The replica a chunk belongs to when every replica is eligible."""
    if not replicas:
        raise ValueError("no replicas")
    return max(replicas, key=lambda r: hrw_weight(fingerprint, r))


class AffinityPolicy:
    """Ranks replicas for a request's chunk fingerprints (stateless, thread-safe)."""

    def __init__(self, config: AffinityConfig | None = None):
        self.config = config or AffinityConfig()

    def load_bound(self, queues: Sequence[int]) -> int:
        """Largest queue length (before placing the request) that still takes affinity traffic."""
        if not queues:
            return 0
        mean_after = (sum(queues) + 1) / len(queues)
        cap = max(min(queues) + 1 + self.config.slack, math.ceil(self.config.load_factor * mean_after - 1e-9))
        return cap - 1

    def rank(self, fingerprints: Sequence[str], queue_lens: Mapping[str, int | None],
             weights: Sequence[float] | None = None, pending: Mapping[str, int] | None = None) -> list[list[str]]:
        """Tiers of replica ids, most preferred first.

        ``queue_lens``: replica id -> requests queued or running there (``None`` = unknown,
        counted as 0). ``weights``: one per fingerprint (e.g. token counts), default 1 each.
        ``pending``: replica id -> requests there before their first token (rule 0; missing = 0).
        The first tier holds the chosen replica alone; the second, the others by load.
        """
        replicas = list(queue_lens)
        if not replicas:
            return []
        queues = {r: max(0, q or 0) for r, q in queue_lens.items()}
        pend = {r: max(0, (pending or {}).get(r, 0)) for r in replicas}
        by_load = sorted(replicas, key=lambda r: (pend[r], queues[r]))  # stable: ties keep the given order
        chosen = self.choose(fingerprints, queues, weights, pend)
        if chosen is None:
            return [[by_load[0]], by_load[1:]] if len(by_load) > 1 else [by_load]
        rest = [r for r in by_load if r != chosen]
        return [[chosen], rest] if rest else [[chosen]]

    def candidates(self, queues: Mapping[str, int], pending: Mapping[str, int] | None = None) -> list[str]:
        """Replicas that may take the request by affinity (rules 0 and 2); never empty when
        ``queues`` is not: the least loaded of the fewest-pending replicas is always one."""
        cand = list(queues)
        if pending:
            least = min(pending.get(r, 0) for r in cand)
            cand = [r for r in cand if pending.get(r, 0) <= least + self.config.prefill_slack]
        bound = self.load_bound([queues[r] for r in cand])
        return [r for r in cand if queues[r] <= bound]

    def choose(self, fingerprints: Sequence[str], queues: Mapping[str, int],
               weights: Sequence[float] | None = None, pending: Mapping[str, int] | None = None) -> str | None:
        """The affinity choice, or ``None`` when the request has no chunks to follow."""
        fps = list(fingerprints)[: self.config.max_fingerprints]
        if weights is not None and len(weights) < len(fps):
            raise ValueError(f"{len(weights)} weights for {len(fps)} fingerprints")
        if not fps or not queues:
            return None
        eligible = self.candidates(queues, pending)
        score = dict.fromkeys(eligible, 0.0)
        tiebreak = dict.fromkeys(eligible, 0)
        for i, fp in enumerate(fps):
            w = 1.0 if weights is None else float(weights[i])
            ranked = {r: hrw_weight(fp, r) for r in eligible}
            best = max(eligible, key=lambda r: ranked[r])
            score[best] += w
            for r in eligible:
                tiebreak[r] += ranked[r]
        top = max(eligible, key=lambda r: (score[r], -queues[r], tiebreak[r]))
        return top if score[top] > 0 else None
