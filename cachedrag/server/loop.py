"""The engine loop: one thread that runs every request's prefill and batched decode steps.

Owns: ``EngineLoop`` (submit / cancel / start / stop), ``ServeRequest`` (what the HTTP side
hands in: prompt segments, sampling parameters, an ``emit`` callback) and the events it emits
(``Delta``, ``Finished``, ``Failed``). Each step, on the loop thread:

1. requests whose client went away leave (their KV buffer is freed); waiting ones leave the queue;
2. the policy (``cachedrag.server.policy``) picks up to ``prefills_per_step`` waiting requests
   for the free batch slots; each is planned, loaded and prefilled through the engine's seam
   (``CachedEngine.prefill_task``: the shared chunk cache serves it) and its first token is chosen;
   its store hand-off follows, with the cache told which chunks the waiting requests will read
   (evicted last: ``ChunkCacheManager.hold``, ``SchedulerConfig.hold_waiting``);
3. ONE batched decode forward (``cachedrag.server.batch``) gives every running request its next
   token; finished requests (EOS, stop string, ``max_tokens``) leave;
4. a conversation step that finished (``ServeRequest.conversation``: a chat request with tools or
   earlier assistant / tool turns) has its prompt and answer stored as one tree path
   (``continuation.remember``, as in process), after every event of the step was emitted: the
   conversation's next request, admitted at a later step, computes only its new messages.

So requests join and leave between steps (continuous batching). A request with ``n`` choices
(``ServeRequest.more``) is prefilled once: its choices start from the same prompt KV and first
logits, each with its own sampling state, and each decodes in its own rows (a copy of the
prefill's buffer), so they take ``n`` batch slots once admitted (admission counts the request as
one: the batch may run ``n - 1`` over ``max_batch`` until they finish; the app refuses ``n`` above
``max_batch``). Events carry their choice's ``index``. The tie guard during decoding
(``CacheConfig.exact.tie_guard_decode``): a request decoding on an approximate prefill's KV whose next
token would come from near-tied logits leaves the batch for one step; at the start of the next, its
prompt and answer so far are prefilled exactly (``DecodeTieGuard.switch_task``, advanced like an
admitted prefill, so the others keep decoding) and it goes on from that KV, holding its batch slot
meanwhile. Idle time (nothing waiting or running) computes the exact knowledge-tree paths of
recurring chunk sequences that prefills handed over (``Prefilled.promote``,
``CacheConfig.exact.repeats``), one per idle turn; a request that arrives meanwhile makes it stop
after the current layer (abandoned, nothing stored; it starts over at the next idle turn). After
``trim_heap_idle_s`` with nothing at all to do, the loop returns the C heap's freed memory to the OS
(``cachedrag.heap``: glibc otherwise keeps a burst's KV buffers mapped).

Every prefill is a task the loop advances one layer at a time (``cachedrag.server.prefills``):
between layers, after every ``prefill_chunk_tokens`` tokens' worth of prefill compute, the running
requests get a decode step (chunked prefill: a long prefill delays their next token by one piece,
not by the whole prefill), and a short waiting request may preempt (its prefill runs to its end
first). Sampling is per request (its own seeded generator; frequency / presence penalties and a
structured-output grammar), text deltas (``TextStream``: stop strings, whole characters) and the finish
reason come from each choice's ``SequenceDecoder``, the per-token tail ``CachedEngine.generate`` decodes
through too; decoding here is plain one-token-per-step (no prompt-lookup drafts), and greedy output
equals ``generate`` with ``lookup.max_draft=0`` token for token.

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

import torch

from cachedrag.engine import DecodeTieGuard
from cachedrag.engine.continuation import remember
from cachedrag.executor import release_openmp_threads
from cachedrag.heap import trim_heap
from cachedrag.kvcache.planner import Mode
from cachedrag.model.generation import SequenceDecoder, rewind_allowed
from cachedrag.server.batch import batched_decode_step, prepare
from cachedrag.server.config import SchedulerConfig
from cachedrag.server.policy import Forecast, PrefillModel, QueueFullError, SchedulerPolicy, Ticket
from cachedrag.server.prefills import PrefillJobs
from cachedrag.server.requests import (Delta, Failed, Finished, ServeRequest, TokenLogprob, _Running,
                                       token_logprob)

log = logging.getLogger("cachedrag.server")

__all__ = ["Delta", "EngineLoop", "Failed", "Finished", "QueueFullError", "ServeRequest", "TokenLogprob"]


class EngineLoop(PrefillJobs):
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
        # conversations: (prefill, answer ids, mode) of finished steps, stored at the end of the step
        self._answers: list[tuple[object, list[int], Mode]] = []
        self.remembered_tokens = 0  # prompt and answer tokens stored as conversation paths
        self.remember_s = 0.0  # seconds spent storing them (on this thread, between decode steps)
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
        self._remember_answers()

    def _remember_answers(self) -> None:
        """Store the conversation steps that finished during this step: each one's prompt as served
        and its answer as one tree path (``continuation.remember``, as ``generate_segments(conversation=
        True)`` does in process), so the next step of the same conversation computes only its new
        messages. Run here, after the step's decode forward and every emit, outside any prefill (the
        tree changes between prefills only): a step's finished answers delay the next step by the
        rows they copy (prompt and answer tokens not on the tree yet), never a token already chosen.
        The next request of that conversation is admitted at a later step, after this."""
        answers, self._answers = self._answers, []
        for pre, tokens, mode in answers:
            t0 = time.perf_counter()
            try:
                self.remembered_tokens += remember(self.engine, pre.segments, pre.kv, tokens,
                                                   exact_segments=pre.exact_segments, mode=mode, conversation=True)
            except Exception:  # the answer stands; only its caching failed (the next step computes it again)
                log.exception("storing a conversation's answer failed")
            self.remember_s += time.perf_counter() - t0

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

    def _cancel_waiting(self, ids: set[int]) -> set[int]:
        """Lock held: drop the waiting requests among ``ids`` (their client left); returns those dropped."""
        dropped = set()
        for rid in ids:
            ticket = self.policy.remove(rid)
            if ticket is not None:
                ticket.payload.cancelled = True
                dropped.add(rid)
        return dropped

    def _start(self, request: ServeRequest, pre, index: int) -> _Running:
        """Choice ``index`` of ``request`` after its prefill ``pre``: every choice starts from the same
        prompt KV and first logits (choices after the first fork the KV before they decode: ``_prefill``)."""
        engine, info, params = self.engine, pre.info, request.choice_params(index)
        rewind = request.whole_answer and request.logprobs is None and rewind_allowed(params)
        guard = DecodeTieGuard.for_request(engine, pre.segments, info, request.mode or engine.config.mode,
                                           params.max_new_tokens, rewind=rewind)
        decoder = SequenceDecoder.start(engine.runner, params, engine.eos_ids)
        return _Running(request=request, kv=pre.kv, decoder=decoder, stats=info,
                        position=info["prompt_tokens"], params=params, index=index, guard=guard,
                        held=guard is not None and guard.rewind,
                        prefilled=pre if request.conversation and index == 0 else None)

    def _admits_exactly(self, request: ServeRequest) -> bool:
        """Whether ``request`` gets an exact prefill (prefix caching's plan; what it computes is still stored
        as its ``cachedrag`` mode stores it, reusable elsewhere): with the tie guard during decoding at
        every token (``exact.tie_guard_decode=inf``), its answer would move onto an exact prefill before its
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

    def _advance(self, run: _Running, logits: torch.Tensor, first: bool = False) -> None:
        """Choose the next token from ``logits`` ``[V]`` (penalties and the request's constraint
        applied); emit its text; finish or keep running. A choice that fails (a grammar that allows
        no token) fails this request alone."""
        if not first and run.guard is not None and run.guard.due(logits, len(run.tokens)):
            run.near_tie, run.last = logits, None  # leaves the batch; ``step`` runs its exact prefill next
            self._switching.append(run)
            return
        try:
            token = run.decoder.choose(logits)
        except Exception as exc:
            log.exception("choosing the next token of request %d failed", run.request.id)
            run.last = None
            run.request.emit(Failed(exc))
            return
        if first:
            run.ttft_s = time.perf_counter() - run.request.arrival
            if self.observer is not None:
                self.observer.on_first_token(run.ttft_s)
        if token is None:  # EOS
            return self._finish(run)
        if run.request.logprobs is not None:
            run.logprobs.append(token_logprob(logits, token, run.request.logprobs))
        delta = run.decoder.accept(token)
        if delta and not run.held:
            run.request.emit(Delta(delta, run.take_logprobs(), run.index))
        if run.decoder.finished:
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
        info = run.stats
        prompt = info["prompt_tokens"]
        cached = info.get("cached_tokens", prompt - info["computed_tokens"])
        done = Finished(finish_reason=run.decoder.finish_reason, prompt_tokens=prompt,
                        completion_tokens=len(run.tokens), cached_tokens=int(cached), ttft_s=run.ttft_s,
                        total_s=time.perf_counter() - run.request.arrival, text=run.stream.text,
                        token_ids=list(run.tokens), stats=info, index=run.index)
        run.kv = None  # free the buffer now, not when the list is rebuilt (a conversation's: once stored)
        if run.prefilled is not None:  # stored at the end of this step (``_remember_answers``)
            self._answers.append((run.prefilled, list(run.tokens), Mode(run.request.mode or self.engine.config.mode)))
            run.prefilled = None
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
