"""Which requests each replica has not started yet: the prefill-aware half of the load signal.

Owns: ``PrefillBoard`` (ticket -> replica of every request routed and still before its first
token) and ``BOARD``, the one board of a process. Pure Python, no torch, no Ray, thread-safe.

Why: a replica's queue length (requests in flight) cannot tell a replica that is about to spend
a second prefilling a request that just arrived from one whose requests are all decoding
(a batched decode step costs tens of milliseconds). Measured on 2 replicas (docs/scale-out.md):
least-loaded by count sent the two requests of clients that finished together to the replica
that had just emptied; the second waited for the first's whole prefill, both then decoded and
finished together again, and the pair stayed in lock-step: TTFT p50 0.95 s against 0.57 s for
round-robin at equal throughput. Counting requests before their first token separately breaks
that convoy.

Who writes it: the router records its choice when it makes it (``routed``); the ingress
corrects it with the replica that actually answered (its ``x-cachedrag-replica`` header) and
clears the ticket at the first content event of a streamed answer, or when a non-streamed
answer completes (``started``). The router and the ingress run in the same process (Serve
routes a deployment handle's calls in the caller), so a module-level board connects them.

Does not own: the routing rule (``affinity``), the Serve router (``router``).
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Iterable


class PrefillBoard:
    """Requests routed to each replica that have not produced their first token yet.

    ``max_age_s``: a ticket older than this is dropped (a response whose relay never ran, e.g.
    the client left before its first byte, must not count against its replica forever)."""

    def __init__(self, max_age_s: float = 120.0, clock=time.monotonic):
        self._lock = threading.Lock()
        self._where: dict[str, tuple[str, float]] = {}
        self.max_age_s = max_age_s
        self._clock = clock

    def routed(self, ticket: str, replica: str) -> None:
        """``ticket`` went (or was re-sent) to ``replica``."""
        with self._lock:
            self._where[ticket] = (replica, self._clock())

    def started(self, ticket: str) -> None:
        """``ticket``'s first token arrived (or it ended): no longer pending. Idempotent."""
        with self._lock:
            self._where.pop(ticket, None)

    def pending(self, replicas: Iterable[str] | None = None) -> dict[str, int]:
        """Pending requests per replica (every replica of ``replicas``, 0 when none)."""
        with self._lock:
            self._expire()
            counts = Counter(replica for replica, _ in self._where.values())
        if replicas is None:
            return dict(counts)
        return {r: counts.get(r, 0) for r in replicas}

    def __len__(self) -> int:
        with self._lock:
            self._expire()
            return len(self._where)

    def _expire(self) -> None:
        old = self._clock() - self.max_age_s
        for ticket in [t for t, (_, since) in self._where.items() if since < old]:
            del self._where[ticket]


BOARD = PrefillBoard()
