"""Ray Serve request routers for the engine replicas (Serve's custom request-router interface).

Owns: ``ChunkAffinityRouter`` — Serve's ``RequestRouter.choose_replicas`` over
``cachedrag.cluster.affinity`` (rendezvous hashing of the request's chunk fingerprints with a
queue-length bound, least-loaded fallback) — and ``RoundRobinRouter`` (the baseline of
``cachedrag bench cluster``). Both also honour a pinned replica (``replica=<id>`` keyword of
the call: admin calls that must reach one given replica, e.g. its stats).

Does not own: the policy (torch-free, in ``affinity``), fingerprinting (the ingress does it
once per request and passes ``route=Fingerprints`` to the replica call, so the router never
parses bodies), queue-length probing and backoff (Serve's ``RequestRouter`` base: within a
returned tier Serve picks the replica with the shortest queue that accepts the request, and
moves to the next tier when all refuse).

Load: Serve's replica queue lengths (when an entry is missing or stale, the router's own count
of requests it sent and that have not completed stands in) and, for the affinity router, the
requests of each replica still before their first token (``cachedrag.cluster.board``, kept
with the ingress; a call passes its ``ticket=`` keyword).

Configure on the deployment (``serve.yaml`` or Python):

    request_router_config:
      request_router_class: cachedrag.cluster.router:ChunkAffinityRouter
      request_router_kwargs: {slack: 0, load_factor: 1.0}
"""

from __future__ import annotations

import itertools
import logging
from collections import Counter

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from cachedrag.cluster.affinity import AffinityConfig, AffinityPolicy
from cachedrag.cluster import board  # board.BOARD at call time: Serve ships this class pickled by value,
#                                     which would copy a global imported by name (not the ingress's board)
from cachedrag.cluster.fingerprints import Fingerprints

log = logging.getLogger("cachedrag.cluster")


def _backoff_after(pending: PendingRequest | None) -> None:
    """Our tiers list every replica: once Serve has tried them all, it must back off before
    asking again (without this flag its routing loop re-asks at once, spinning when a pinned
    replica is gone)."""
    if pending is not None:
        pending.routing_context.should_backoff = True


def _pinned(candidates: list[RunningReplica], pending: PendingRequest | None) -> list[list[RunningReplica]] | None:
    pin = None if pending is None else pending.kwargs.get("replica")
    if pin is None:
        return None
    match = [r for r in candidates if r.replica_id.unique_id == pin]
    return [match] if match else []  # an unknown or dead replica: nothing (Serve retries with backoff)


class _CountingRouter(RequestRouter):
    """Keeps its own in-flight count per replica (stands in for missing queue-length info).

    No ``FIFOMixin``: with it Serve hands a chosen replica to the *oldest* pending request,
    not to the one it was chosen for, which would defeat affinity."""

    def _ensure(self) -> None:
        if not hasattr(self, "_inflight"):
            self._inflight: Counter[ReplicaID] = Counter()
            self.decisions: Counter[str] = Counter()

    def on_request_routed(self, pending_request, replica_id, result) -> None:
        self._ensure()
        self._inflight[replica_id] += 1

    def on_request_completed(self, replica_id, internal_request_id) -> None:
        self._ensure()
        if self._inflight[replica_id] > 0:
            self._inflight[replica_id] -= 1

    def on_replica_actor_died(self, replica_id) -> None:
        self._ensure()
        self._inflight.pop(replica_id, None)
        super().on_replica_actor_died(replica_id)

    def queue_len(self, replica: RunningReplica) -> int:
        self._ensure()
        cached = self.replica_queue_len_cache.get(replica.replica_id)
        return cached if cached is not None else self._inflight[replica.replica_id]

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        """Serve's entry point: a pinned replica, else the subclass's ``rank`` tiers."""
        _backoff_after(pending_request)
        pinned = _pinned(candidate_replicas, pending_request)
        if pinned is not None:
            return pinned
        if not candidate_replicas:
            return []
        return self.rank(candidate_replicas, pending_request)

    def rank(self, candidates: list[RunningReplica], pending: PendingRequest | None) -> list[list[RunningReplica]]:
        raise NotImplementedError


class ChunkAffinityRouter(_CountingRouter):
    """Sends a request to the replica that owns most of its chunks (rendezvous hashing),
    unless that replica's queue is over the load bound; no chunks: least-loaded."""

    def initialize_state(self, **kwargs: object):
        self._ensure()
        fields = {k: v for k, v in kwargs.items() if k in AffinityConfig.model_fields}
        self.policy = AffinityPolicy(AffinityConfig(**fields))

    def rank(self, candidates: list[RunningReplica], pending: PendingRequest | None) -> list[list[RunningReplica]]:
        if not hasattr(self, "policy"):
            self.initialize_state()
        route = None if pending is None else pending.kwargs.get("route")
        fps = route if isinstance(route, Fingerprints) else Fingerprints()
        by_id = {r.replica_id.unique_id: r for r in candidates}
        queues = {rid: self.queue_len(r) for rid, r in by_id.items()}
        tiers = self.policy.rank(fps.digests, queues, fps.weights or None, board.BOARD.pending(by_id))
        ticket = None if pending is None else pending.kwargs.get("ticket")
        if ticket is not None and tiers:
            board.BOARD.routed(ticket, tiers[0][0])  # at once: a request routed next must see it (the ingress corrects it)
        self.decisions["affinity" if fps.digests else "least_loaded"] += 1
        return [[by_id[rid] for rid in tier] for tier in tiers if tier]


class RoundRobinRouter(_CountingRouter):
    """Cycles through the replicas (the cache-oblivious baseline)."""

    def initialize_state(self, **_: object):
        self._ensure()
        self._turn = itertools.count()

    def rank(self, candidates: list[RunningReplica], pending: PendingRequest | None) -> list[list[RunningReplica]]:
        if not hasattr(self, "_turn"):
            self.initialize_state()
        ordered = sorted(candidates, key=lambda r: r.replica_id.unique_id)
        first = ordered[next(self._turn) % len(ordered)]
        return [[first], [r for r in ordered if r is not first]]


