"""Which waiting requests get prefill next: the serving scheduler's policy, apart from execution.

Owns: ``SchedulerPolicy``, a waiting queue of ``Ticket`` s with a queue limit (a full queue
rejects: the server answers 503), and ``admit``, which picks the requests to prefill this
step given the free batch slots. Two orders:

- ``fifo``: arrival order.
- ``cache_aware`` (RAGCache, Jin et al. 2024, section 5.3): highest ``cached_len /
  compute_len`` first (requests whose context is mostly cached cost little prefill and free
  their slot sooner, and requests sharing what another request just cached get served while it
  is still cached), with two bounds on how far a request can be pushed back. A request is
  *due* once it has been overtaken ``max_overtakes`` times (admitted younger requests went
  ahead of it) or has waited ``starvation_s``; due requests go before any younger one, oldest
  first. So no request is ever passed by more than ``max_overtakes`` younger ones, and none
  waits longer than ``starvation_s`` behind reordered ones (beyond it, only behind older
  requests and the work already admitted, which is never preempted). The overtake cap bounds
  the tail in admissions, whatever the load: under a queue a request waits at most that many
  admissions longer than in arrival order would have put ahead of it; the time window alone
  let a cold request wait the whole window under load (docs/serving.md, the queue level).

Counters ``admitted`` / ``contested`` (admitted while more requests waited than there were
slots, i.e. the order had a choice) / ``reordered`` (admitted ahead of an older waiting
request) tell how much the order can matter under a given load: with few requests in flight
and free batch slots, most admissions have no choice to make.

``cached_len`` / ``compute_len`` are estimates the executor refreshes before each decision
(``estimate`` callback): the cache changes while a request waits. Pure Python, no torch;
time is passed in, so tests drive it with a fake clock.

Does not own: running prefills or decode steps (``cachedrag.server.loop``), cache lookups.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

Order = Literal["fifo", "cache_aware"]
MAX_OVERTAKES = 2  # the default cap (chosen on `cachedrag bench serve`'s queue level: docs/serving.md)


class QueueFullError(Exception):
    """The waiting queue is at its limit (the server answers 503)."""


@dataclass
class Ticket:
    """A waiting request as the policy sees it."""

    id: int
    arrival: float  # seconds, the caller's clock
    prompt_tokens: int
    cached_len: int = 0  # estimated prompt tokens served from cache
    overtaken: int = 0  # younger requests admitted ahead of this one so far
    payload: object = field(default=None, repr=False, compare=False)  # the executor's request object

    @property
    def compute_len(self) -> int:
        return max(1, self.prompt_tokens - self.cached_len)

    @property
    def priority(self) -> float:
        return self.cached_len / self.compute_len


class SchedulerPolicy:
    """Waiting queue + admission order. Not thread-safe: the executor thread owns it."""

    def __init__(self, order: Order = "cache_aware", max_waiting: int = 256, starvation_s: float = 10.0,
                 max_overtakes: int = MAX_OVERTAKES):
        if order not in ("fifo", "cache_aware"):
            raise ValueError(f"order must be 'fifo' or 'cache_aware', got {order!r}")
        if max_waiting < 1 or starvation_s < 0 or max_overtakes < 0:
            raise ValueError("max_waiting must be >= 1, starvation_s >= 0 and max_overtakes >= 0")
        self.order = order
        self.max_waiting = max_waiting
        self.starvation_s = starvation_s
        self.max_overtakes = max_overtakes
        self._waiting: list[Ticket] = []  # arrival order
        # what the order did (the server exports these): admissions, those made with a choice (more
        # requests waiting than were admitted), and those that went ahead of an older waiting request
        self.admitted = 0
        self.contested = 0
        self.reordered = 0

    def __len__(self) -> int:
        return len(self._waiting)

    @property
    def waiting(self) -> list[Ticket]:
        return list(self._waiting)

    def push(self, ticket: Ticket) -> None:
        """Queue a request; raises ``QueueFullError`` when ``max_waiting`` are already waiting."""
        if len(self._waiting) >= self.max_waiting:
            raise QueueFullError(f"{len(self._waiting)} requests are waiting (limit {self.max_waiting})")
        self._waiting.append(ticket)

    def remove(self, ticket_id: int) -> Ticket | None:
        """Drop a waiting request (its client went away); returns it, or None if not waiting."""
        for j, t in enumerate(self._waiting):
            if t.id == ticket_id:
                return self._waiting.pop(j)
        return None

    def admit(self, free_slots: int, now: float, limit: int | None = None,
              estimate: Callable[[Ticket], int] | None = None) -> list[Ticket]:
        """Remove and return up to ``min(free_slots, limit)`` tickets to prefill now, in order.

        ``estimate(ticket) -> cached_len`` refreshes each waiting ticket's estimate first
        (cache-aware order only).
        """
        n = min(free_slots, len(self._waiting), limit if limit is not None else free_slots)
        if n <= 0:
            return []
        ranked, passed = self._pick(now, estimate, n)
        chosen = {t.id for t in ranked}
        oldest = {t.id for t in self._waiting[:n]}
        self.admitted += n
        if len(self._waiting) > n:
            self.contested += n
        self.reordered += len(chosen - oldest)
        self._waiting = [t for t in self._waiting if t.id not in chosen]
        for t in self._waiting:  # the overtakes the picks counted, now for real
            t.overtaken = passed.get(t.id, t.overtaken)
        return ranked

    def ranked(self, now: float, estimate: Callable[[Ticket], int] | None = None,
               n: int | None = None) -> list[Ticket]:
        """The first ``n`` (default all) waiting tickets in admission order.

        Picked one at a time: a due ticket (overtaken ``max_overtakes`` times, or waited
        ``starvation_s``) goes first, oldest first; else the highest cached/compute ratio
        (ties: oldest). Each pick counts as an overtake of every older ticket still waiting,
        so a ticket's count reaches the cap and it is due before it could exceed it.
        """
        return self._pick(now, estimate, n)[0]

    def _pick(self, now: float, estimate: Callable[[Ticket], int] | None,
              n: int | None) -> tuple[list[Ticket], dict[int, int]]:
        """``ranked``'s picks and every waiting ticket's overtake count after them (cache-aware
        order; FIFO counts none)."""
        if self.order == "fifo":
            return list(self._waiting[:n]), {}
        if estimate is not None:
            for t in self._waiting:
                t.cached_len = min(t.prompt_tokens, max(0, int(estimate(t))))
        rank = self._age_rank()  # 0 = oldest (arrival; pushes may come out of arrival order)
        left = sorted(self._waiting, key=lambda t: rank[t.id])
        passed = {t.id: t.overtaken for t in left}
        out: list[Ticket] = []
        for _ in range(len(left) if n is None else min(n, len(left))):
            due = next((t for t in left if passed[t.id] >= self.max_overtakes
                        or now - t.arrival >= self.starvation_s), None)  # oldest due ticket
            pick = due if due is not None else max(left, key=lambda t: (t.priority, -rank[t.id]))
            left.remove(pick)
            out.append(pick)
            for t in left:
                if rank[t.id] < rank[pick.id]:
                    passed[t.id] += 1
        return out, passed

    def _age_rank(self) -> dict[int, int]:
        order = sorted(range(len(self._waiting)), key=lambda j: (self._waiting[j].arrival, j))
        return {self._waiting[j].id: r for r, j in enumerate(order)}
