"""Prefills on the engine loop, advanced as tasks: an admitted request's prefill, the tie guard's
exact prefill during decoding (a switch) and an idle-time promotion are each a ``PrefillTask``
(``CachedEngine.prefill_task``, ``DecodeTieGuard.switch_task``, ``Promotion.task``) that the loop
advances one layer at a time. Between two layers of a prefill the loop may run one batched decode
step for the running requests (chunked prefill, after ``prefill_chunk_tokens`` tokens' worth of
prefill compute) and may start a preempting request's prefill (``preempt_ratio``): that one is
pushed on a stack of jobs and advanced to its end before the preempted one resumes. So the engine
never calls into the server, and no prefill runs inside another's call.

Owns: ``PrefillJobs`` (the loop's mixin: ``_run_jobs``, ``_prefill``, ``_switch``, ``_promote`` and
what happens between layers). Torch work only through the engine and ``EngineLoop._decode``."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from cachedrag.engine.prefill import PrefillTask
from cachedrag.model.runner import KVBuffer
from cachedrag.server.policy import Ticket
from cachedrag.server.requests import Failed, ServeRequest, _Running

log = logging.getLogger("cachedrag.server")


@dataclass
class _Job:
    """One prefill the loop advances: ``done(result)`` once it finished, ``failed(exc)`` if it raised.
    ``interleaves``: other work may run between its layers (decode steps; preemption where
    ``preemptible``). ``work``: prompt tokens' worth of its prefill compute since the last decode step."""

    task: PrefillTask
    done: Callable[[object], None]
    failed: Callable[[Exception], None]
    interleaves: bool = False
    preemptible: bool = False
    work: float = 0.0
    ticket: Ticket | None = None  # its cost feeds the forecast's prefill model
    preempting: bool = False  # its whole time counts as preemption of the job below it
    t0: float = field(default_factory=time.perf_counter)
    decode_s: float = 0.0  # the loop's decode and preemption seconds when it began
    preempt_s: float = 0.0


class PrefillJobs:
    """``EngineLoop``'s prefills as jobs (module docstring)."""

    def _run_jobs(self, job: _Job) -> None:
        """Advance ``job`` to its end, and any preempting job pushed between its layers to theirs first."""
        stack = [job]
        try:
            self._advance_jobs(stack)
        finally:  # a step that failed outside a job's prefill (its first token, its hand-off): the rest are dropped
            for left in stack:
                left.task.close()

    def _advance_jobs(self, stack: list[_Job]) -> None:
        while stack:
            top = stack[-1]
            try:
                more = top.task.advance()
            except Exception as exc:  # bad request content the HTTP side could not see (handed back, not raised)
                stack.pop()
                self._ended(top)
                top.failed(exc)
                continue
            if not more:
                stack.pop()
                self._ended(top)
                top.done(top.task.result)
                continue
            if not top.interleaves:
                continue
            try:
                pushed = self._between_layers(top)
            except Exception as exc:
                top.task.close()
                stack.pop()
                self._ended(top)
                top.failed(exc)
                continue
            if pushed is not None:
                stack.append(pushed)

    def _ended(self, job: _Job) -> None:
        """Feed a finished job's own time to the forecast's prefill model: what it stalled the running
        requests for, less the decode steps and preempting prefills run between its layers."""
        now = time.perf_counter()
        if job.ticket is not None:
            own = now - job.t0 - (self._decode_s - job.decode_s) - (self._preempt_s - job.preempt_s)
            self._prefill_model.observe(job.ticket.compute_len, own)
        if job.preempting:
            self._preempt_s += now - job.t0

    def _job(self, task: PrefillTask, done, failed, *, chunked: bool, preemptible: bool = False,
             ticket: Ticket | None = None, preempting: bool = False) -> _Job:
        return _Job(task, done, failed, interleaves=chunked or preemptible, preemptible=preemptible, ticket=ticket,
                    preempting=preempting, decode_s=self._decode_s, preempt_s=self._preempt_s)

    def _chunked(self) -> bool:
        return self.config.prefill_chunk_tokens > 0 and any(r.last is not None for r in self._running)

    def _between_layers(self, job: _Job) -> _Job | None:
        """After a layer of ``job``. Chunked prefill: once ``prefill_chunk_tokens`` tokens' worth of
        prefill compute has run since the running requests' last decode step, they get one now, so a
        long prefill delays their next token by one piece, not by the whole prefill. Preemption: a
        waiting request the policy ranks first and forecasts to be short enough is returned as a job to
        run before this one goes on."""
        job.work += job.task.tokens / self.engine.runner.n_layers
        if (0 < self.config.prefill_chunk_tokens <= job.work
                and any(r.last is not None for r in self._running)):
            job.work = 0.0
            self._decode_between_layers()
        return self._preempt(job.task.layer) if job.preemptible else None

    def _preempt(self, layer: int) -> _Job | None:
        """Preemption of the running (outermost) prefill after ``layer``, at most once per prefill:
        the policy's next pick goes first when its forecast prefill is at most ``preempt_ratio`` of
        the running prefill's remaining forecast time (``SchedulerPolicy.preempt``)."""
        current = self._current
        if current is None or self.policy.preempt_ratio <= 0:
            return None
        n_layers = self.engine.runner.n_layers
        now = time.perf_counter()
        with self._lock:
            if not len(self.policy):
                return None
            self._cancel -= self._cancel_waiting(self._cancel)  # waiting requests whose client left go first
            # the running prefill holds a slot of its own (it joins the running requests when it ends)
            staying = [r for r in self._running + self._switching if r.request.id not in self._cancel
                       and (r.last is not None or r.near_tie is not None)]
            free = self.config.max_batch - len(staying) - 1
            forecast = self._forecast(staying)
            remaining = forecast.prefill_s(current) * (n_layers - 1 - layer) / n_layers
            ticket = self.policy.preempt(remaining, free, now, estimate=self._estimate, forecast=forecast)
        if ticket is None:
            return None
        self._current = None  # preempted once: no more, and none inside the preempting prefill
        return self._request_job(ticket.payload, ticket=ticket, preempting=True)

    def _decode_between_layers(self) -> None:
        """One decode step for the running requests inside a prefill (chunked prefill)."""
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

    # ------------------------------------------------------------------ admitted prefills
    def _timed_prefill(self, ticket: Ticket) -> None:
        """Prefill ``ticket``'s request, its cost fed to the forecast's prefill model."""
        self._run_jobs(self._request_job(ticket.payload, ticket=ticket))

    def _prefill(self, request: ServeRequest) -> None:
        """Prefill ``request`` (its choices then join the running requests)."""
        self._run_jobs(self._request_job(request))

    def _request_job(self, request: ServeRequest, ticket: Ticket | None = None, preempting: bool = False) -> _Job:
        chunked = self._chunked()
        preemptible = self._current is not None and self._current.payload is request and self.policy.preempt_ratio > 0
        failed = lambda exc: request.emit(Failed(exc))  # noqa: E731
        try:
            task = self.engine.prefill_task(request.segments, request.params.max_new_tokens, mode=request.mode,
                                            defer_store=True, exact=self._admits_exactly(request),
                                            conversation=request.conversation)
        except Exception as exc:
            task = PrefillTask(_raise(exc))
        return self._job(task, lambda pre: self._admitted(request, pre), failed, chunked=chunked,
                         preemptible=preemptible, ticket=ticket, preempting=preempting)

    def _admitted(self, request: ServeRequest, pre) -> None:
        """``request``'s prefill ``pre`` is done: its choices choose their first tokens and join the
        running requests; the store hand-off follows the first token, as in ``generate``."""
        runs = [self._start(request, pre, i) for i in range(request.n)]
        for run in runs:
            self._running.append(run)
            self._advance(run, pre.logits, first=True)
        if pre.hand_off is not None:
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
            while len(self._promotions) > self.engine.config.cache.exact.repeat_memory:
                self._promotions.popleft()

    # ------------------------------------------------------------------ the decode tie guard's switch
    def _switch(self, run: _Running) -> None:
        """The tie guard during decoding: prefill ``run``'s prompt and answer so far exactly and go on
        from that KV (its token comes from the exact logits). Other requests decode between the
        prefill's layers as during an admitted prefill. If the exact prefill fails, the answer goes
        on from the near-tied approximate logits (logged and noted in its stats)."""
        near_tie, run.near_tie = run.near_tie, None
        guard, run.guard = run.guard, None  # once per answer
        run.prefilled = None  # its answer goes on in another buffer: not stored as a path (as in ``generate``)
        t0 = time.perf_counter()

        def failed(exc: Exception) -> None:
            guard.fail(exc)
            run.stats = {**run.stats, "notes": [*run.stats.get("notes", []), guard.failure]}
            self._running.append(run)
            self._advance(run, near_tie)

        try:
            task = guard.switch_task(run.tokens)
        except Exception as exc:
            task = PrefillTask(_raise(exc))
        self._run_jobs(self._job(task, lambda exact: self._switched(run, guard, exact, t0), failed,
                                 chunked=self._chunked()))

    def _switched(self, run: _Running, guard, exact, t0: float) -> None:
        exact = guard.switched(run.tokens, exact, t0)
        run.kv = exact.kv
        run.stats = {**run.stats, **guard.stats()}
        keep = exact.info["answer_kept"]
        if keep < len(run.tokens):  # a rewind (``run.held``: nothing was sent): back to the agreed tokens
            run.decoder.rewind(keep)
            run.position = run.stats["prompt_tokens"] + keep
        self._running.append(run)
        self._advance(run, exact.logits)
        if exact.hand_off is not None:  # the exact path is stored once the token is out
            self._hold_waiting()
            try:
                exact.hand_off()
            except Exception:
                log.exception("store hand-off of the tie guard's exact prefill failed")

    # ------------------------------------------------------------------ idle time
    def _promote(self) -> None:
        """One recurring sequence's exact path (exact repeats); it gives way after a layer when a request
        waits (or the loop stops): abandoned, nothing stored, queued again for the next idle turn."""
        self._hold_waiting()
        promote = self._promotions.popleft()
        try:
            task = promote.task()
            while task.advance():
                with self._lock:
                    busy = len(self.policy) > 0 or self._stop
                if busy:  # a request arrived: it goes first; the promotion starts over when idle again
                    task.close()
                    self._promotions.appendleft(promote)
                    self.promotions_yielded += 1
                    return
            self.promotions += 1
        except Exception:  # only caching failed: the sequence stays served from reuse
            log.exception("exact-repeat promotion failed")


def _raise(exc: Exception):
    """A task body that fails at its first advance (a request the engine refused outright)."""
    raise exc
    yield  # pragma: no cover  (makes this a generator)
