"""Which waiting requests get prefill next: the serving scheduler's policy, apart from execution.

Owns: ``SchedulerPolicy``, a waiting queue of ``Ticket`` s with a queue limit (a full queue
rejects: the server answers 503), and ``admit``, which picks the requests to prefill this
step given the free batch slots. Two orders:

- ``fifo``: arrival order.
- ``cache_aware`` (RAGCache, Jin et al. 2024, section 5.3): highest ``cached_len /
  compute_len`` first (requests whose context is mostly cached cost little prefill and free
  their slot sooner, and requests sharing what another request just cached get served while it
  is still cached), with a starvation bound: a request that has waited ``starvation_s`` or longer
  goes before any younger one, oldest first. So a request is passed by younger ones only while
  it has waited less than the window: no request waits longer than ``starvation_s`` behind
  reordered ones (beyond it, only behind older requests and the work already admitted, which
  is never preempted).

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


class QueueFullError(Exception):
    """The waiting queue is at its limit (the server answers 503)."""


@dataclass
class Ticket:
    """A waiting request as the policy sees it."""

    id: int
    arrival: float  # seconds, the caller's clock
    prompt_tokens: int
    cached_len: int = 0  # estimated prompt tokens served from cache
    payload: object = field(default=None, repr=False, compare=False)  # the executor's request object

    @property
    def compute_len(self) -> int:
        return max(1, self.prompt_tokens - self.cached_len)

    @property
    def priority(self) -> float:
        return self.cached_len / self.compute_len


class SchedulerPolicy:
    """Waiting queue + admission order. Not thread-safe: the executor thread owns it."""

    def __init__(self, order: Order = "cache_aware", max_waiting: int = 256, starvation_s: float = 10.0):
        if order not in ("fifo", "cache_aware"):
            raise ValueError(f"order must be 'fifo' or 'cache_aware', got {order!r}")
        if max_waiting < 1 or starvation_s < 0:
            raise ValueError("max_waiting must be >= 1 and starvation_s >= 0")
        self.order = order
        self.max_waiting = max_waiting
        self.starvation_s = starvation_s
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
        ranked = self.ranked(now, estimate)[:n]
        chosen = {t.id for t in ranked}
        oldest = {t.id for t in self._waiting[:n]}
        self.admitted += n
        if len(self._waiting) > n:
            self.contested += n
        self.reordered += len(chosen - oldest)
        self._waiting = [t for t in self._waiting if t.id not in chosen]
        return ranked

    def ranked(self, now: float, estimate: Callable[[Ticket], int] | None = None) -> list[Ticket]:
        """All waiting tickets in admission order (starved first, oldest first; then by priority)."""
        if self.order == "fifo":
            return list(self._waiting)
        if estimate is not None:
            for t in self._waiting:
                t.cached_len = min(t.prompt_tokens, max(0, int(estimate(t))))
        starved = sorted((t for t in self._waiting if now - t.arrival >= self.starvation_s),
                         key=lambda t: t.arrival)  # oldest first, also when pushes came out of arrival order
        rest = [t for t in self._waiting if now - t.arrival < self.starvation_s]
        rest.sort(key=lambda t: (-t.priority, t.arrival))  # stable: ties keep arrival order
        return starved + rest
