"""The engine loop: one thread that runs every request's prefill and batched decode steps.

Owns: ``EngineLoop`` (submit / cancel / start / stop), ``ServeRequest`` (what the HTTP side
hands in: prompt segments, sampling parameters, an ``emit`` callback) and the events it emits
(``Delta``, ``Finished``, ``Failed``). Each step, on the loop thread:

1. requests whose client went away leave (their KV buffer is freed); waiting ones leave the queue;
2. the policy (``cachedrag.server.policy``) picks up to ``prefills_per_step`` waiting requests
   for the free batch slots; each is planned, loaded and prefilled through the engine's seam
   (``CachedEngine.prefill``: the shared chunk cache serves it) and its first token is chosen;
   its store hand-off follows, with the cache told which chunks the waiting requests will read
   (evicted last: ``ChunkCacheManager.hold``, ``SchedulerConfig.hold_waiting``);
3. ONE batched decode forward (``cachedrag.server.batch``) gives every running request its next
   token; finished requests (EOS, stop string, ``max_tokens``) leave.

So requests join and leave between steps (continuous batching). A request with ``n`` choices
(``ServeRequest.more``) is prefilled once: its choices start from the same prompt KV and first
logits, each with its own sampling state, and each decodes in its own rows (a
copy of the prefill's buffer), so they take ``n`` batch slots once admitted (admission counts the
request as one: the batch may run ``n - 1`` over ``max_batch`` until they finish; the app refuses
``n`` above ``max_batch``). Events carry their choice's ``index``. The tie guard during decoding
(``CacheConfig.exact.tie_guard_decode``): a request decoding on an approximate prefill's KV whose next
token would come from near-tied logits leaves the batch for one step; at the start of the next, its
prompt and answer so far are prefilled exactly (``DecodeTieGuard.switch``, chunked like an
admitted prefill, so the others keep decoding) and it goes on from that KV, holding its batch slot
meanwhile. Idle time (nothing waiting or
running) computes the exact knowledge-tree paths of recurring chunk sequences that prefills
handed over (``Prefilled.promote``, ``CacheConfig.exact.repeats``), one per idle turn; a request
that arrives meanwhile makes it yield after the current layer (abandoned, nothing stored; it
starts over at the next idle turn). After ``trim_heap_idle_s`` with nothing at all to do, the loop
returns the C heap's freed memory to the OS (``cachedrag.heap``: glibc otherwise keeps a burst's
KV buffers mapped, and RSS stays at the burst's peak). Chunked prefill: while a
prefill runs, the engine calls back between its layers, and after every
``prefill_chunk_tokens`` tokens' worth of prefill compute the running requests get a decode
step there, so a long prefill delays their next token by one piece, not by the whole prefill
(Sarathi-Serve / vLLM cut prefills along tokens to share a GPU forward with decode rows; on the
CPU the pieces run one after the other, and cutting between layers needs no change to the
engine's selective-recompute pass, which decides per layer which tokens go on). Sampling is per
request (its own seeded generator; frequency / presence penalties and a structured-output grammar
through ``choose_token``, as in ``generate``), and text deltas go through ``TextStream`` (stop
strings, whole characters), the same as ``CachedEngine.generate``; decoding here is plain one-token-per-step (no prompt-lookup
drafts), and greedy output equals ``generate`` with ``lookup.max_draft=0`` token for token.

Threads: all torch work runs on this one long-lived thread. ``start`` frees the calling
thread's idle OpenMP team first (``release_openmp_threads``: model loading ran torch ops on
it); an idle team on another live thread would halve decode speed (``cachedrag/executor.py``).
The HTTP side must not run torch ops (tokenising is fine).

Does not own: HTTP, prompt building (``cachedrag.prompt.planning``), the order of admission.
"""

from __future__ import annotations

import itertools
import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from cachedrag.engine import DecodeTieGuard
from cachedrag.executor import release_openmp_threads
from cachedrag.heap import trim_heap
from cachedrag.kvcache.planner import Mode
from cachedrag.model.generation import SamplingParams, TextStream, choose_token, make_generator, rewind_allowed
from cachedrag.model.runner import KVBuffer
from cachedrag.prompt import Segment
from cachedrag.server.batch import batched_decode_step, prepare
from cachedrag.server.config import SchedulerConfig
from cachedrag.server.policy import Forecast, PrefillModel, QueueFullError, SchedulerPolicy, Ticket

log = logging.getLogger("cachedrag.server")

__all__ = ["Delta", "EngineLoop", "Failed", "Finished", "QueueFullError", "ServeRequest"]


@dataclass
class Delta:
    text: str
    logprobs: list[TokenLogprob] | None = None  # the tokens up to this text (when the request asked for them)
    index: int = 0  # the choice it belongs to (``ServeRequest.n``)


@dataclass
class TokenLogprob:
    """A generated token's log probability under the model's own distribution (before penalties,
    constraint and temperature, as ``CachedEngine.generate`` reports it) and its ``top`` most
    likely alternatives ``[(token id, log p)]``."""

    token: int
    logprob: float
    top: list[tuple[int, float]]


@dataclass
class Finished:
    finish_reason: str  # "stop" (EOS or stop string) or "length"
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int  # prompt tokens served from cache (not computed at full depth)
    ttft_s: float
    total_s: float
    text: str
    token_ids: list[int]
    stats: dict = field(default_factory=dict)  # the prefill's engine stats
    index: int = 0  # the choice that finished (``ServeRequest.n``; each choice finishes once)


@dataclass
class Failed:
    error: BaseException


@dataclass
class ServeRequest:
    segments: list[Segment]
    params: SamplingParams
    emit: Callable[[object], None]  # called on the loop thread with Delta / Finished / Failed; must not block
    mode: str | None = None
    logprobs: int | None = None  # report each token's log p and this many alternatives (None: off)
    whole_answer: bool = False  # the client reads the answer only once it is whole (not streamed): the tie guard
    #                             during decoding may rewind it (``DecodeTieGuard.rewind``)
    more: list[SamplingParams] = field(default_factory=list)  # choices 1..n-1 (each its own seed and
    #                                                            constraint); they fork the prompt's prefill
    arrival: float = field(default_factory=time.perf_counter)
    id: int = 0  # set by submit
    cancelled: bool = False

    @property
    def prompt_tokens(self) -> int:
        return sum(len(s) for s in self.segments)

    @property
    def n(self) -> int:
        """Choices: ``params`` and each of ``more``, decoded from one prefill of the prompt."""
        return 1 + len(self.more)

    def choice_params(self, index: int) -> SamplingParams:
        return self.params if index == 0 else self.more[index - 1]


class _Busy(Exception):
    """Raised between an idle-time promotion's layers when a request is waiting."""


@dataclass
class _Running:
    request: ServeRequest
    kv: object  # KVBuffer
    stream: TextStream
    generator: torch.Generator | None
    stats: dict
    position: int  # where the last chosen token goes when fed back
    params: SamplingParams  # this choice's (``ServeRequest.choice_params``)
    index: int = 0  # the choice (``ServeRequest.n``)
    tokens: list[int] = field(default_factory=list)
    ttft_s: float = 0.0
    last: int | None = None  # the token to feed next
    logprobs: list[TokenLogprob] = field(default_factory=list)  # chosen, not yet sent with a text delta
    guard: DecodeTieGuard | None = None  # CacheConfig.exact.tie_guard_decode (None: off, or the prefill was exact)
    near_tie: torch.Tensor | None = None  # [V] the near-tied logits while the request waits for its exact prefill
    held: bool = False  # its text is sent whole when it finishes (the guard may rewind it; nobody sees a delta)

    def take_logprobs(self) -> list[TokenLogprob] | None:
        if self.request.logprobs is None:
            return None
        out, self.logprobs = self.logprobs, []
        return out


class EngineLoop:
    """Continuous-batching executor over one ``CachedEngine`` (and so one shared chunk cache)."""

    def __init__(self, engine, config: SchedulerConfig | None = None, observer=None):
        """``observer``: optional object with ``on_step(batch_size, waiting)``,
        ``on_first_token(seconds)``, ``on_token(seconds)`` and ``on_finished(Finished)``
        (the server's Prometheus metrics)."""
        self.engine = engine
        self.config = config or SchedulerConfig()
        self.policy = SchedulerPolicy(self.config.order, self.config.max_waiting, self.config.starvation_s,
                                      self.config.max_overtakes, self.config.max_delay_s, self.config.preempt_ratio)
        self.observer = observer
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._running: list[_Running] = []
        self._switching: list[_Running] = []  # tie guard during decoding: waiting for their exact prefill
        self._cancel: set[int] = set()
        self._stop = False
        self._thread: threading.Thread | None = None
        self._prefill_work = 0.0  # prompt tokens' worth of prefill compute since the last decode step
        # the admission forecast's cost model, measured as the loop runs (first guesses: CPU-sized)
        self._step_s = 0.05  # one batched decode step (moving average)
        self._prefill_model = PrefillModel()  # prefill seconds vs computed prompt tokens
        self._decode_s = 0.0  # seconds spent in decode forwards so far
        # preemption (``SchedulerConfig.preempt_ratio``): the prefill running now that may still be
        # preempted (None once it was: once per prefill), and the seconds spent in preempting
        # prefills so far (left out of the preempted one's cost sample)
        self._current: Ticket | None = None
        self._preempt_s = 0.0
        self.steps = 0  # batched decode steps run
        self.interleaved_steps = 0  # of which inside a prefill (chunked prefill)
        # exact repeats: promotions prefills handed over, run when idle (loop thread only; oldest dropped first)
        self._promotions: deque = deque()
        self.promotions = 0  # exact paths computed in idle time
        self.promotions_yielded = 0  # promotions abandoned mid-prefill for an arriving request
        self.heap_trims = 0  # idle-time returns of freed heap memory to the OS (``trim_heap_idle_s``)
        self.exact_admissions = 0  # faithful requests prefilled exactly (exact_when_waiting, exact_whole_answers)
        self.heap_released_bytes = 0  # resident bytes they released

    # ------------------------------------------------------------------ public API
    def submit(self, request: ServeRequest) -> int:
        """Queue ``request``; returns its id. Raises ``QueueFullError`` when the queue is full."""
        with self._lock:
            if self._stop:
                raise RuntimeError("the engine loop is stopped")
            request.id = next(self._ids)
            self.policy.push(Ticket(request.id, request.arrival, request.prompt_tokens,
                                    max_new_tokens=request.params.max_new_tokens, payload=request))
            self._wake.notify()
        return request.id

    def cancel(self, request_id: int) -> None:
        """The client went away: free the request's slot at the next step (no more events)."""
        with self._lock:
            self._cancel.add(request_id)
            self._wake.notify()

    def start(self) -> None:
        release_openmp_threads()  # this thread ran torch ops (model loading); from now on only the loop does
        self._thread = threading.Thread(target=self._serve, name="cachedrag-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float | None = 30.0) -> None:
        with self._lock:
            self._stop = True
            self._wake.notify()
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def waiting(self) -> int:
        with self._lock:
            return len(self.policy)

    @property
    def running(self) -> int:
        with self._lock:
            return len(self._running) + len(self._switching)

    # ------------------------------------------------------------------ the loop
    def _serve(self) -> None:
        prepare(self.engine.runner, self.config.max_batch)  # the batched step's packed weights, on this thread
        trim_at = None  # when freed heap memory goes back to the OS if nothing comes in first (monotonic clock)
        while True:
            with self._lock:
                while (not self._stop and not len(self.policy) and not self._running and not self._switching
                       and not self._promotions):
                    wait = None if trim_at is None else trim_at - time.monotonic()
                    if wait is not None and wait <= 0:
                        break
                    self._wake.wait(wait)
                if self._stop:
                    break
                idle = not len(self.policy) and not self._running and not self._switching
                nothing = idle and not self._promotions  # woken by the trim's time alone
            if nothing:
                trim_at = None
                self._trim_heap()
                continue
            if idle:  # nothing to serve: one recurring sequence's exact path (exact repeats)
                self._promote()
            else:
                try:
                    self.step()
                except Exception as exc:  # a bug in a step must not kill the server: fail the running requests
                    log.exception("engine step failed")
                    for r in self._running + self._switching:
                        r.request.emit(Failed(exc))
                    self._running, self._switching = [], []
            if self.config.trim_heap_idle_s is not None:  # idle from now on: trim then
                trim_at = time.monotonic() + self.config.trim_heap_idle_s
        for r in self._running + self._switching:
            r.request.emit(Failed(RuntimeError("server shutting down")))
        self._running, self._switching = [], []
        with self._lock:
            waiting = self.policy.waiting
            for t in waiting:
                self.policy.remove(t.id)
        for t in waiting:
            t.payload.emit(Failed(RuntimeError("server shutting down")))
        release_openmp_threads()

    def step(self) -> None:
        """One scheduling step: drop cancelled, admit prefills, one batched decode."""
        now = time.perf_counter()
        with self._lock:
            cancel, self._cancel = self._cancel, set()
            self._cancel_waiting(cancel)
            staying = [r for r in self._running + self._switching if r.request.id not in cancel
                       and (r.last is not None or r.near_tie is not None)]
            free = self.config.max_batch - len(staying)
            admitted = self.policy.admit(free, now, limit=self.config.prefills_per_step, estimate=self._estimate,
                                         forecast=self._forecast(staying))
        if cancel:
            self._running = [r for r in self._running if r.request.id not in cancel]
            self._switching = [r for r in self._switching if r.request.id not in cancel]
        while self._switching:  # requests that met a near tie last step: onto exact KV first
            self._switch(self._switching.pop(0))
        for ticket in admitted:
            self._current = ticket
            try:
                self._timed_prefill(ticket)
            finally:
                self._current = None
        self._decode()
        self._running = [r for r in self._running if r.last is not None]

    def _decode(self) -> None:
        """ONE batched decode forward for every running request that has a token to feed."""
        live = [r for r in self._running if r.last is not None]
        if not live:
            return
        self.steps += 1
        if self.observer is not None:
            self.observer.on_step(len(live), len(self.policy))
        t0 = time.perf_counter()
        logits = batched_decode_step(self.engine.runner, [r.last for r in live], [r.position for r in live],
                                     [r.kv for r in live])  # [B, V]
        dt = time.perf_counter() - t0
        self._step_s = 0.8 * self._step_s + 0.2 * dt
        self._decode_s += dt
        for b, r in enumerate(live):
            r.position += 1
            if self.observer is not None:
                self.observer.on_token(dt)
            self._advance(r, logits[b])

    def _timed_prefill(self, ticket: Ticket) -> None:
        """Prefill ``ticket``'s request and feed its cost to the forecast's prefill model: the
        prefill's own time (what it stalls the running requests for), less the decode steps and
        preempting prefills run between its layers."""
        t0, decoding, preempting = time.perf_counter(), self._decode_s, self._preempt_s
        self._prefill(ticket.payload)
        own = time.perf_counter() - t0 - (self._decode_s - decoding) - (self._preempt_s - preempting)
        self._prefill_model.observe(ticket.compute_len, own)

    def _between_layers(self, layer: int, tokens: int) -> None:
        """Called by the engine after each layer of a prefill. Chunked prefill: once
        ``prefill_chunk_tokens`` tokens' worth of prefill compute has run since the running
        requests' last decode step, they get one now, so a long prefill delays their next token
        by one piece, not by the whole prefill. Preemption: a waiting request the policy ranks
        first and forecasts to be short enough is prefilled here, before this one goes on."""
        self._prefill_work += tokens / self.engine.runner.n_layers
        if (0 < self.config.prefill_chunk_tokens <= self._prefill_work
                and any(r.last is not None for r in self._running)):
            self._decode_between_layers()
        self._preempt(layer)

    def _preempt(self, layer: int) -> None:
        """Preemption of the running (outermost) prefill after ``layer``, at most once per prefill:
        the policy's next pick goes first when its forecast prefill is at most ``preempt_ratio`` of
        the running prefill's remaining forecast time (``SchedulerPolicy.preempt``)."""
        current = self._current
        if current is None or self.policy.preempt_ratio <= 0:
            return
        n_layers = self.engine.runner.n_layers
        now = time.perf_counter()
        with self._lock:
            if not len(self.policy):
                return
            self._cancel -= self._cancel_waiting(self._cancel)  # waiting requests whose client left go first
            # the running prefill holds a slot of its own (it joins the running requests when it ends)
            staying = [r for r in self._running + self._switching if r.request.id not in self._cancel
                       and (r.last is not None or r.near_tie is not None)]
            free = self.config.max_batch - len(staying) - 1
            forecast = self._forecast(staying)
            remaining = forecast.prefill_s(current) * (n_layers - 1 - layer) / n_layers
            ticket = self.policy.preempt(remaining, free, now, estimate=self._estimate, forecast=forecast)
        if ticket is None:
            return
        self._current = None  # preempted once: no more, and none inside the preempting prefill
        t0 = time.perf_counter()
        try:
            self._timed_prefill(ticket)
        finally:
            self._preempt_s += time.perf_counter() - t0

    def _cancel_waiting(self, ids: set[int]) -> set[int]:
        """Lock held: drop the waiting requests among ``ids`` (their client left); returns those dropped."""
        dropped = set()
        for rid in ids:
            ticket = self.policy.remove(rid)
            if ticket is not None:
                ticket.payload.cancelled = True
                dropped.add(rid)
        return dropped

    def _decode_between_layers(self) -> None:
        """One decode step for the running requests inside a prefill (chunked prefill)."""
        self._prefill_work = 0.0
        with self._lock:
            gone = {r.request.id for r in self._running} & self._cancel
            self._cancel -= gone
        if gone:
            self._running = [r for r in self._running if r.request.id not in gone]
        try:
            self._decode()
        except Exception as exc:  # fail the running requests, not the prefill that hosts this step
            log.exception("decode step between prefill layers failed")
            for r in self._running:
                if r.last is not None:
                    r.request.emit(Failed(exc))
                    r.last = None
        self._running = [r for r in self._running if r.last is not None]
        self.interleaved_steps += 1

    # ------------------------------------------------------------------ helpers
    def _prefill(self, request: ServeRequest) -> None:
        engine = self.engine
        chunked = self.config.prefill_chunk_tokens > 0 and any(r.last is not None for r in self._running)
        preemptible = self._current is not None and self._current.payload is request and self.policy.preempt_ratio > 0
        outer_work, self._prefill_work = self._prefill_work, 0.0
        try:
            pre = engine.prefill(request.segments, request.params.max_new_tokens, mode=request.mode,
                                 between_layers=self._between_layers if chunked or preemptible else None,
                                 defer_store=True, exact=self._admits_exactly(request))
        except Exception as exc:  # bad request content the HTTP side could not see (handed back, not raised)
            request.emit(Failed(exc))
            return
        finally:
            self._prefill_work = outer_work  # a preempting prefill leaves the preempted one's count as it was
        runs = [self._start(request, pre, i) for i in range(request.n)]
        for run in runs:
            self._running.append(run)
            self._advance(run, pre.logits, first=True)
        if pre.hand_off is not None:  # the store hand-off waits for the first token, as in generate()
            self._hold_waiting()
            try:
                pre.hand_off()
            except Exception:  # the answer stands; only its caching failed (the next request misses)
                log.exception("store hand-off after the first token failed")
        for run in runs:  # after the hand-off (it reads the prefill's buffer): each further choice in its own rows
            if run.index > 0 and run.kv is pre.kv and run.last is not None:
                run.kv = KVBuffer(k=pre.kv.k.clone(), v=pre.kv.v.clone(), length=pre.kv.length)  # [L, H_kv, C, D] each
        if pre.promote is not None:  # computed when the loop is idle
            self._promotions.append(pre.promote)
            while len(self._promotions) > engine.config.cache.exact.repeat_memory:
                self._promotions.popleft()

    def _start(self, request: ServeRequest, pre, index: int) -> _Running:
        """Choice ``index`` of ``request`` after its prefill ``pre``: every choice starts from the same
        prompt KV and first logits (choices after the first fork the KV before they decode: ``_prefill``)."""
        engine, info, params = self.engine, pre.info, request.choice_params(index)
        rewind = request.whole_answer and request.logprobs is None and rewind_allowed(params)
        guard = DecodeTieGuard.for_request(engine, pre.segments, info, request.mode or engine.config.mode,
                                           params.max_new_tokens, rewind=rewind)
        return _Running(request=request, kv=pre.kv, stream=TextStream(engine.runner.tokenizer, params.stop),
                        generator=make_generator(params, engine.runner.device), stats=info,
                        position=info["prompt_tokens"], params=params, index=index, guard=guard,
                        held=guard is not None and guard.rewind)

    def _admits_exactly(self, request: ServeRequest) -> bool:
        """Whether ``request`` gets an exact prefill (prefix caching's plan; what it computes is still stored
        as its ``cachedrag`` mode stores it, reusable elsewhere): with the tie guard during decoding at
        every token (``tie_guard_decode=inf``), its answer would move onto an exact prefill before its
        second token anyway, so the approximate prefill buys only an earlier first token. That is not worth
        it when at least ``exact_when_waiting`` requests wait (computing the approximate one first delays
        every one of them by a second prefill) or when the answer is sent whole (``exact_whole_answers``:
        nobody sees the first token early). Counted in ``exact_admissions``."""
        mode = request.mode or self.engine.config.mode
        if mode != Mode.CACHEDRAG.value or not math.isinf(self.engine.config.cache.exact.tie_guard_decode):
            return False
        n = self.config.exact_when_waiting
        if (n > 0 and len(self.policy) >= n) or (self.config.exact_whole_answers and request.whole_answer):
            self.exact_admissions += 1
            return True
        return False

    def _switch(self, run: _Running) -> None:
        """The tie guard during decoding: prefill ``run``'s prompt and answer so far exactly and go on
        from that KV (its token comes from the exact logits). Other requests decode between the
        prefill's layers as during an admitted prefill. If the exact prefill fails, the answer goes
        on from the near-tied approximate logits (logged and noted in its stats)."""
        near_tie, run.near_tie = run.near_tie, None
        guard, run.guard = run.guard, None  # once per answer
        chunked = self.config.prefill_chunk_tokens > 0 and any(r.last is not None for r in self._running)
        outer_work, self._prefill_work = self._prefill_work, 0.0
        try:
            exact = guard.switch(run.tokens, between_layers=self._between_layers if chunked else None)
        except Exception as exc:
            guard.fail(exc)
            run.stats = {**run.stats, "notes": [*run.stats.get("notes", []), guard.failure]}
            self._running.append(run)
            self._advance(run, near_tie)
            return
        finally:
            self._prefill_work = outer_work
        run.kv = exact.kv
        run.stats = {**run.stats, **guard.stats()}
        keep = exact.info["answer_kept"]
        if keep < len(run.tokens):  # a rewind (``run.held``: nothing was sent): back to the agreed tokens
            del run.tokens[keep:]
            run.stream = run.stream.rewound(keep)
            run.position = run.stats["prompt_tokens"] + keep
        self._running.append(run)
        self._advance(run, exact.logits)
        if exact.hand_off is not None:  # the exact path is stored once the token is out
            self._hold_waiting()
            try:
                exact.hand_off()
            except Exception:
                log.exception("store hand-off of the tie guard's exact prefill failed")

    def _trim_heap(self) -> None:
        """Idle for ``trim_heap_idle_s``: give the finished requests' freed buffers back to the OS."""
        released = trim_heap()
        if released is not None:
            self.heap_trims += 1
            self.heap_released_bytes += released
            log.debug("idle: returned %.1f MB of freed heap memory to the OS", released / 2**20)

    def _hold_waiting(self) -> None:
        """Tell the chunk cache what the waiting requests will read, before a store hand-off or
        a promotion may evict (``ChunkCacheManager.hold``; ``SchedulerConfig.hold_waiting``)."""
        if not self.config.hold_waiting:
            return
        with self._lock:
            waiting = self.policy.waiting
        self.engine.manager.hold({s.key for t in waiting for s in t.payload.segments[:-1]})

    def _promote(self) -> None:
        self._hold_waiting()
        promote = self._promotions.popleft()
        try:
            promote(between_layers=self._yield_if_busy)
            self.promotions += 1
        except _Busy:  # a request arrived: it goes first; the promotion starts over when idle again
            self._promotions.appendleft(promote)
            self.promotions_yielded += 1
        except Exception:  # only caching failed: the sequence stays served from reuse
            log.exception("exact-repeat promotion failed")

    def _yield_if_busy(self, layer: int, tokens: int) -> None:
        """Between the layers of an idle-time promotion: give way to waiting requests (or a stop)."""
        with self._lock:
            busy = len(self.policy) > 0 or self._stop
        if busy:
            raise _Busy

    def _advance(self, run: _Running, logits: torch.Tensor, first: bool = False) -> None:
        """Choose the next token from ``logits`` ``[V]`` (penalties and the request's constraint
        applied); emit its text; finish or keep running. A choice that fails (a grammar that allows
        no token) fails this request alone."""
        params = run.params
        constraint = params.constraint
        if not first and run.guard is not None and run.guard.due(logits, len(run.tokens)):
            run.near_tie, run.last = logits, None  # leaves the batch; ``step`` runs its exact prefill next
            self._switching.append(run)
            return
        try:
            token = choose_token(logits, params, run.tokens, run.generator, self.engine.eos_ids)
        except Exception as exc:
            log.exception("choosing the next token of request %d failed", run.request.id)
            run.last = None
            run.request.emit(Failed(exc))
            return
        if first:
            run.ttft_s = time.perf_counter() - run.request.arrival
            if self.observer is not None:
                self.observer.on_first_token(run.ttft_s)
        if token in self.engine.eos_ids:
            return self._finish(run)
        run.tokens.append(token)
        if run.request.logprobs is not None:
            run.logprobs.append(_token_logprob(logits, token, run.request.logprobs))
        delta = run.stream.push(token)
        if delta and not run.held:
            run.request.emit(Delta(delta, run.take_logprobs(), run.index))
        grammar_done = constraint is not None and constraint.done  # a complete document: nothing may follow
        if run.stream.stopped or len(run.tokens) >= params.max_new_tokens or grammar_done:
            return self._finish(run)
        run.last = token

    def _finish(self, run: _Running) -> None:
        run.last = None
        tail = run.stream.flush()
        if run.held:  # nothing was sent: the whole text now
            tail = run.stream.text
        pending = run.take_logprobs()
        if tail or pending:
            run.request.emit(Delta(tail, pending, run.index))
        params = run.params
        complete = run.stream.stopped or (params.constraint is not None and params.constraint.done)
        reason = "length" if len(run.tokens) >= params.max_new_tokens and not complete else "stop"
        info = run.stats
        prompt = info["prompt_tokens"]
        cached = info.get("cached_tokens", prompt - info["computed_tokens"])
        done = Finished(finish_reason=reason, prompt_tokens=prompt, completion_tokens=len(run.tokens),
                        cached_tokens=int(cached), ttft_s=run.ttft_s,
                        total_s=time.perf_counter() - run.request.arrival, text=run.stream.text,
                        token_ids=list(run.tokens), stats=info, index=run.index)
        run.kv = None  # free the buffer now, not when the list is rebuilt
        if self.observer is not None:
            self.observer.on_finished(done)
        run.request.emit(done)

    def _forecast(self, running: list[_Running]) -> Forecast:
        """The admission forecast's view of now: when each running request's slot frees (its
        remaining tokens at the measured step time; an early EOS frees it sooner) and the
        measured prefill cost."""
        step = self._step_s
        left = [max(0, r.params.max_new_tokens - len(r.tokens)) * step for r in running]
        model = self._prefill_model
        return Forecast(left, step, model.base_s, model.per_token_s)

    def _estimate(self, ticket: Ticket) -> int:
        """Prompt tokens of ``ticket`` the cache spares its prefill now: the knowledge tree's exact
        prefix, then every later segment with a stored variant (reusable at any position) less
        the share of it that is recomputed (``CacheConfig.recompute_ratio``): a request whose
        chunks are all variants still computes that share of them, so it is not ranked (or
        forecast, for preemption) as if only its question were computed."""
        request: ServeRequest = ticket.payload
        mode = Mode(request.mode or self.engine.config.mode)
        if mode is Mode.FULL:
            return 0
        manager = self.engine.manager
        keys = [s.key for s in request.segments[:-1]]  # the last segment (the question) is always computed
        nodes = manager.tree.match_prefix(keys)
        cached = sum(len(s) for s in request.segments[:len(nodes)])
        if mode is not Mode.PREFIX:
            kept = 1.0 - (self.engine.config.cache.recompute_ratio or 0.0)
            cached += int(kept * sum(len(s) for s in request.segments[len(nodes):-1] if s.key in manager.index))
        return cached


def _token_logprob(logits: torch.Tensor, token: int, alternatives: int) -> TokenLogprob:
    """``token``'s log p under ``logits`` ``[V]`` and the ``alternatives`` most likely tokens."""
    lp = torch.log_softmax(logits.float(), dim=-1)  # [V]
    top: list[tuple[int, float]] = []
    if alternatives:
        values, ids = lp.topk(alternatives)  # [k], [k]
        top = list(zip(ids.tolist(), values.tolist()))
    return TokenLogprob(token, float(lp[token]), top)
