"""Which waiting requests get prefill next: the serving scheduler's policy, apart from execution.

Owns: ``SchedulerPolicy``, a waiting queue of ``Ticket`` s with a queue limit (a full queue
rejects: the server answers 503), and ``admit``, which picks the requests to prefill this
step given the free batch slots. Two orders:

- ``fifo``: arrival order.
- ``cache_aware`` (RAGCache, Jin et al. 2024, section 5.3): highest ``cached_len /
  compute_len`` first (requests whose context is mostly cached cost little prefill and free
  their slot sooner, and requests sharing what another request just cached get served while it
  is still cached), within bounds on how far a request can be pushed back:

  * ``max_delay_s`` (the default bound, 0 s): a younger request goes ahead only while every
    waiting request is still forecast to be admitted no later than ``max_delay_s`` after the
    time arrival order (FIFO) was forecast to admit it. Each request's FIFO admission time is
    forecast once, when the policy first sees it, from a ``Forecast`` the executor passes in
    (when each running request's slot frees, decode step time, prefill time per computed
    token) and the estimated prefill and decode work of the requests ahead of it; it becomes
    the request's deadline (plus ``max_delay_s``). Each admission takes the best-ranked request
    whose admission keeps every other request's forecast admission within its deadline (or no
    later than earliest-deadline-first order would have it), else the earliest deadline. So
    reordering happens only where it costs nobody more than ``max_delay_s`` against FIFO:
    between requests FIFO would admit at nearly the same time (slots that free together), or
    where hits made work shorter than forecast. It never moves a request past a slot that frees
    a whole answer later, which is what made the overtake cap's tail (docs/serving.md, the
    queue level). Without a forecast (``admit(..., forecast=None)``) this bound is off.
  * ``max_overtakes`` (off by default): a request is *due* once that many younger requests
    were admitted ahead of it;
  * ``starvation_s``: a request is due once it has waited that long.

  Due requests go before any younger one, oldest first.

- Preemption of a running prefill (``cache_aware`` only; ``preempt_ratio``, default 0.5, 0 = off): between
  the layers of a prefill, ``preempt`` offers the policy's next pick (the same order and bounds
  as ``admit``), when no older request waits, to go first when its whole prefill is forecast
  to take at most ``preempt_ratio`` of what the running prefill has left. A request that is
  mostly cached (an exact tree hit, a few recompute rows) then gets its first token without
  waiting behind a cold prefill that happened to start first (head-of-line blocking, which
  arrival order cannot avoid even with free batch slots); the preempted prefill is set back by
  at most that fraction of its remaining time, once (the executor allows one preemption per
  prefill), and no waiting request is passed. Shortest remaining work first, with RAGCache's
  cached/compute priority, at layer granularity.

Counters ``admitted`` / ``contested`` (admitted while more requests waited than there were
slots, i.e. the order had a choice) / ``reordered`` (admitted ahead of an older waiting
request) tell how much the order can matter under a given load: with few requests in flight
and free batch slots, most admissions have no choice to make.

``cached_len`` / ``compute_len`` are estimates the executor refreshes before each decision
(``estimate`` callback): the cache changes while a request waits. Pure Python, no torch;
time is passed in, so tests drive it with a fake clock. The forecast is a small serial-engine
model written here (a heap of slot-free times and one busy engine), not a queueing library:
it has to mirror this server's one-prefill-at-a-time engine and its continuous batching.

Does not own: running prefills or decode steps (``cachedrag.server.loop``), cache lookups.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

Order = Literal["fifo", "cache_aware"]
MAX_DELAY_S = 0.0  # the default bound (chosen on `cachedrag bench serve`'s queue level: docs/serving.md)
# on by default: TTFT p50 -24..-30% at concurrency 4 and 8 against FIFO, p95 within the noise of two identical
# servers (`cachedrag bench serve --interleave --rounds 8`, two seeds, docs/serving.md)
PREEMPT_RATIO = 0.5
CANDIDATES = 8  # best-ranked requests tried per admission before falling back to the earliest deadline


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
    max_new_tokens: int = 0  # decode steps it will hold a batch slot for (at most): the forecast's service time
    deadline: float | None = None  # FIFO's forecast admission time + max_delay_s (set on the first forecast)
    payload: object = field(default=None, repr=False, compare=False)  # the executor's request object

    @property
    def compute_len(self) -> int:
        return max(1, self.prompt_tokens - self.cached_len)

    @property
    def priority(self) -> float:
        return self.cached_len / self.compute_len


@dataclass(frozen=True)
class Forecast:
    """What the executor knows about the near future, for admission-time forecasts."""

    slot_free_in: Sequence[float]  # seconds of decoding until each running request's slot frees (remaining x step)
    step_s: float  # one batched decode step
    prefill_s_base: float = 0.0  # a prefill's seconds: base + per token x computed prompt tokens (``PrefillModel``)
    prefill_s_per_token: float = 0.0

    def prefill_s(self, ticket: Ticket) -> float:
        return self.prefill_s_base + self.prefill_s_per_token * ticket.compute_len

    def admission_times(self, order: Sequence[Ticket], free_slots: int) -> list[float]:
        """Seconds from now at which each ticket of ``order`` would start its prefill, admitted in
        that order. The engine is serial: a ticket takes the earliest free slot once the previous
        prefill is done, and a prefill stalls every decoding request for its duration (their
        slots free that much later); a ticket holds its slot for ``max_new_tokens`` decode steps."""
        slots = [0.0] * max(0, free_slots) + sorted(max(0.0, x) for x in self.slot_free_in)  # a heap (sorted)
        busy, out = 0.0, []
        for t in order:
            start = max(heapq.heappop(slots), busy) if slots else busy
            took = self.prefill_s(t)
            busy = start + took
            # the running requests wait for this prefill (shifting every time above ``start`` by the
            # same amount keeps the heap order)
            slots = [x + took if x > start else x for x in slots]
            heapq.heappush(slots, busy + t.max_new_tokens * self.step_s)
            out.append(start)
        return out


class PrefillModel:
    """Prefill seconds as ``base + per_token x computed tokens``, fitted online (least squares with
    exponential forgetting) from the prefills the executor ran: hot requests cost mostly the
    base (planning, loading, the question), cold ones mostly the tokens."""

    def __init__(self, base_s: float = 0.05, per_token_s: float = 0.0005, decay: float = 0.9):
        self.base_s, self.per_token_s, self.decay = base_s, per_token_s, decay
        self._n = self._x = self._y = self._xx = self._xy = 0.0

    def observe(self, tokens: int, seconds: float) -> None:
        d = self.decay
        self._n, self._x, self._y = d * self._n + 1, d * self._x + tokens, d * self._y + seconds
        self._xx, self._xy = d * self._xx + tokens * tokens, d * self._xy + tokens * seconds
        var = self._n * self._xx - self._x ** 2
        if var > 1e-9 * max(1.0, self._n * self._xx):  # two different sizes seen: fit both terms
            slope = (self._n * self._xy - self._x * self._y) / var
            self.per_token_s = max(0.0, slope)
            self.base_s = max(0.0, (self._y - self.per_token_s * self._x) / self._n)
        else:  # one size so far: keep the slope, fit the base
            self.base_s = max(0.0, (self._y - self.per_token_s * self._x) / self._n)


class SchedulerPolicy:
    """Waiting queue + admission order. Not thread-safe: the executor thread owns it."""

    def __init__(self, order: Order = "cache_aware", max_waiting: int = 256, starvation_s: float = 10.0,
                 max_overtakes: int | None = None, max_delay_s: float | None = MAX_DELAY_S,
                 preempt_ratio: float = PREEMPT_RATIO):
        if order not in ("fifo", "cache_aware"):
            raise ValueError(f"order must be 'fifo' or 'cache_aware', got {order!r}")
        if (max_waiting < 1 or starvation_s < 0 or (max_overtakes is not None and max_overtakes < 0)
                or (max_delay_s is not None and max_delay_s < 0) or not 0 <= preempt_ratio <= 1):
            raise ValueError("max_waiting must be >= 1, starvation_s >= 0, max_overtakes >= 0, max_delay_s >= 0 "
                             "and preempt_ratio in [0, 1]")
        self.order = order
        self.max_waiting = max_waiting
        self.starvation_s = starvation_s
        self.max_overtakes = max_overtakes  # None: no cap
        self.max_delay_s = max_delay_s  # None: no forecast bound
        self.preempt_ratio = preempt_ratio  # 0: a running prefill is never preempted
        self._waiting: list[Ticket] = []  # push order
        # tickets arrival order (FIFO) would still admit before this one, for tickets without a deadline yet
        self._fifo_ahead: dict[int, int] = {}
        # what the order did (the server exports these): admissions, those made with a choice (more
        # requests waiting than were admitted), and those that went ahead of an older waiting request
        self.admitted = 0
        self.contested = 0
        self.reordered = 0
        self.preempted = 0  # admissions that went ahead of a running prefill (``preempt``)

    def __len__(self) -> int:
        return len(self._waiting)

    @property
    def waiting(self) -> list[Ticket]:
        return list(self._waiting)

    def push(self, ticket: Ticket) -> None:
        """Queue a request; raises ``QueueFullError`` when ``max_waiting`` are already waiting."""
        if len(self._waiting) >= self.max_waiting:
            raise QueueFullError(f"{len(self._waiting)} requests are waiting (limit {self.max_waiting})")
        self._fifo_ahead[ticket.id] = len(self._waiting)
        self._waiting.append(ticket)

    def remove(self, ticket_id: int) -> Ticket | None:
        """Drop a waiting request (its client went away); returns it, or None if not waiting."""
        for j, t in enumerate(self._waiting):
            if t.id == ticket_id:
                self._fifo_ahead.pop(ticket_id, None)
                for later in self._waiting[j + 1:]:  # FIFO moves the ones behind it up by one
                    if later.id in self._fifo_ahead:
                        self._fifo_ahead[later.id] = max(0, self._fifo_ahead[later.id] - 1)
                return self._waiting.pop(j)
        return None

    def admit(self, free_slots: int, now: float, limit: int | None = None,
              estimate: Callable[[Ticket], int] | None = None, forecast: Forecast | None = None) -> list[Ticket]:
        """Remove and return up to ``min(free_slots, limit)`` tickets to prefill now, in order.

        ``estimate(ticket) -> cached_len`` refreshes each waiting ticket's estimate first
        (cache-aware order only). ``forecast``: the executor's view of the running requests;
        without it the ``max_delay_s`` bound is off.
        """
        n = min(free_slots, len(self._waiting), limit if limit is not None else free_slots)
        if n <= 0:
            return []
        ranked, passed = self._pick(now, estimate, n, forecast, free_slots)
        self._take(ranked, passed)
        return ranked

    def preempt(self, remaining_s: float, free_slots: int, now: float,
                estimate: Callable[[Ticket], int] | None = None, forecast: Forecast | None = None) -> Ticket | None:
        """Between the layers of a running prefill with ``remaining_s`` seconds of compute left:
        the waiting ticket to prefill first, or None. It is ``admit``'s next pick (same order and
        bounds), taken only when it is also the oldest waiting ticket (a preemption passes the
        running prefill alone: passing waiting requests as well would delay each of them by the
        preempting prefill, which measured as a wash on bursts) and its forecast prefill
        (``forecast.prefill_s``) is at most ``preempt_ratio x remaining_s``; it leaves the queue
        as an admission (counted as ``preempted`` too). Needs the forecast (its prefill-cost
        model) and a free slot."""
        if (self.order != "cache_aware" or self.preempt_ratio <= 0 or forecast is None or free_slots < 1
                or not self._waiting or remaining_s <= 0):
            return None
        ranked, passed = self._pick(now, estimate, 1, forecast, free_slots)
        pick = ranked[0]
        if self._age_rank()[pick.id] != 0:  # it would pass a waiting request too: every one behind the
            return None  # running prefill waits for the preempting one as well, not only the running one
        if forecast.prefill_s(pick) > self.preempt_ratio * remaining_s + 1e-9:
            return None
        self._take(ranked, passed)
        self.preempted += 1
        return pick

    def _take(self, ranked: list[Ticket], passed: dict[int, int]) -> None:
        """Admit ``ranked`` (picked in this order): out of the queue, counters and overtakes updated."""
        n = len(ranked)
        chosen = {t.id for t in ranked}
        oldest = {t.id for t in self._waiting[:n]}
        self.admitted += n
        if len(self._waiting) > n:
            self.contested += n
        self.reordered += len(chosen - oldest)
        self._waiting = [t for t in self._waiting if t.id not in chosen]
        for t in self._waiting:  # the overtakes the picks counted, now for real
            t.overtaken = passed.get(t.id, t.overtaken)
            if t.id in self._fifo_ahead:  # FIFO would have admitted n tickets, the ones ahead first
                self._fifo_ahead[t.id] = max(0, self._fifo_ahead[t.id] - n)
        for t in ranked:
            self._fifo_ahead.pop(t.id, None)

    def ranked(self, now: float, estimate: Callable[[Ticket], int] | None = None,
               n: int | None = None, forecast: Forecast | None = None, free_slots: int = 0) -> list[Ticket]:
        """The first ``n`` (default all) waiting tickets in admission order.

        Picked one at a time: a due ticket (overtaken ``max_overtakes`` times, or waited
        ``starvation_s``) goes first, oldest first; else the highest cached/compute ratio
        (ties: oldest) among the tickets whose admission keeps every other one within its
        deadline (with a forecast), else the earliest deadline. Each pick counts as an overtake
        of every older ticket still waiting, so a ticket's count reaches the cap and it is due
        before it could exceed it.
        """
        return self._pick(now, estimate, n, forecast, free_slots)[0]

    def _pick(self, now: float, estimate: Callable[[Ticket], int] | None, n: int | None,
              forecast: Forecast | None = None, free_slots: int = 0) -> tuple[list[Ticket], dict[int, int]]:
        """``ranked``'s picks and every waiting ticket's overtake count after them (cache-aware
        order; FIFO counts none)."""
        if self.order == "fifo":
            return list(self._waiting[:n]), {}
        if estimate is not None:
            for t in self._waiting:
                t.cached_len = min(t.prompt_tokens, max(0, int(estimate(t))))
        rank = self._age_rank()  # 0 = oldest (arrival; pushes may come out of arrival order)
        left = sorted(self._waiting, key=lambda t: rank[t.id])
        bounded = forecast is not None and self.max_delay_s is not None
        if bounded:
            self._set_deadlines(left, now, forecast, free_slots)
        passed = {t.id: t.overtaken for t in left}
        cap = self.max_overtakes
        out: list[Ticket] = []
        for _ in range(len(left) if n is None else min(n, len(left))):
            due = next((t for t in left if (cap is not None and passed[t.id] >= cap)
                        or now - t.arrival >= self.starvation_s), None)  # oldest due ticket
            if due is not None:
                pick = due
            elif bounded:
                pick = self._within_deadlines(out, left, now, forecast, free_slots, rank)
            else:
                pick = max(left, key=lambda t: (t.priority, -rank[t.id]))
            left.remove(pick)
            out.append(pick)
            for t in left:
                if rank[t.id] < rank[pick.id]:
                    passed[t.id] += 1
        return out, passed

    def _set_deadlines(self, by_age: list[Ticket], now: float, forecast: Forecast, free_slots: int) -> None:
        """Deadline of each ticket seen for the first time: when FIFO would admit it (forecast over
        the tickets ahead of it in arrival order: those FIFO would still admit first) + ``max_delay_s``."""
        new = [t for t in by_age if t.deadline is None]
        if not new:
            return
        times = forecast.admission_times(by_age, free_slots)  # arrival order
        for t in new:
            k = min(self._fifo_ahead.get(t.id, by_age.index(t)), len(by_age) - 1)
            t.deadline = now + times[k] + self.max_delay_s

    def _within_deadlines(self, picked: list[Ticket], left: list[Ticket], now: float, forecast: Forecast,
                          free_slots: int, rank: dict[int, int]) -> Ticket:
        """The best-ranked of the top ``CANDIDATES`` tickets whose admission next keeps every
        other ticket's forecast admission within its deadline, or no later than
        earliest-deadline-first order would have it; else the earliest deadline."""
        edf = sorted(left, key=lambda t: (t.deadline, rank[t.id]))
        base = forecast.admission_times(picked + edf, free_slots)[len(picked):]
        allowed = {t.id: max(t.deadline, now + x) for t, x in zip(edf, base)}
        for cand in sorted(left, key=lambda t: (-t.priority, rank[t.id]))[:CANDIDATES]:
            if cand is edf[0]:
                return cand
            plan = [cand] + [t for t in edf if t is not cand]
            times = forecast.admission_times(picked + plan, free_slots)[len(picked) + 1:]
            # only the tickets ahead of cand in EDF order move (one slot later); the rest keep their times
            if all(now + x <= allowed[t.id] + 1e-9 for t, x in zip(plan[1:], times)):
                return cand
        return edf[0]

    def _age_rank(self) -> dict[int, int]:
        order = sorted(range(len(self._waiting)), key=lambda j: (self._waiting[j].arrival, j))
        return {self._waiting[j].id: r for r, j in enumerate(order)}
