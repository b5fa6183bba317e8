"""Every exact fallback: where the engine runs the exact prefix plan (prefix caching's: tree prefix,
the rest fresh, so the KV equals full prefill's) instead of, or after, an approximate one.

    exact_repeat         a chunk sequence served from reuse often enough is planned exactly now
                         (``CacheConfig.exact.repeats`` timing "inline") or promoted later (``Promotion``)
    first_token_guard    an approximate prefill whose first token is a near tie is prefilled again
                         exactly (``CacheConfig.exact.tie_guard``)
    DecodeTieGuard       a near tie while decoding moves the answer onto an exact prefill of the
                         prompt and the answer so far (``CacheConfig.exact.tie_guard_decode``), maybe rewinding
    exact_continuation   that exact prefill (also teacher-forced scoring's, ``guard_teacher``)
    near_tie, top2       the top-2 logit gap both guards read (the rule itself: ``kvcache.tie``)

The server's admission rule (``exact_when_waiting``, ``exact_whole_answers``) asks for the same plan
through ``CachedEngine.prefill(exact=True)``."""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable, Sequence

import torch

from cachedrag.kvcache.planner import Action, Mode
from cachedrag.kvcache.tie import near_tie as _near_tie
from cachedrag.model.generation import Rewind
from cachedrag.prompt import Segment
from cachedrag.engine.prefill import PrefillTask, Steps, drive
from cachedrag.engine.result import Prefilled
from cachedrag.engine.state import _Prefill

log = logging.getLogger(__name__)


class DecodeTieGuard:
    """The tie guard during decoding (``CacheConfig.exact.tie_guard_decode``) for one answer.

    While the answer decodes on an approximate prefill's KV, ``due`` says whether the logits about
    to choose the next token are a near tie (top-2 gap below the threshold); ``switch`` then
    prefills the prompt and the answer so far exactly (``CachedEngine.prefill_exact_continuation``),
    once per answer, and decoding goes on from its KV. ``generate`` hands the guard to the decode
    loop as its ``switch`` hook (``__call__``); the server's engine loop calls ``due`` after a
    batched step and ``switch`` in its next scheduling step. ``stats`` are the
    ``EngineResult.tie_guard_switch*`` / ``tie_guard_agreed`` / ``tie_guard_rewound`` fields.

    ``rewind`` (a whole greedy answer nobody has seen yet: ``generate`` without ``stream``, a server's
    non-streaming request): when the exact prefill would not have chosen every token so far, the answer
    goes back to the ones it agrees with and continues from there (``Rewind``), so it is full
    prefill's answer even where the approximate first token was not (one the first-token guard missed).
    """

    def __init__(self, engine: "CachedEngine", segments: list[Segment], threshold: float, max_new_tokens: int,
                 rewind: bool = False):
        self.engine, self.segments, self.threshold, self.max_new_tokens = engine, segments, threshold, max_new_tokens
        self.rewind = rewind
        self.rewound: int | None = None  # answer tokens dropped by a rewind (None: none)
        self.replaced_first: int | None = None  # the first answer token, when a rewind went back past it
        self.token: int | None = None  # the answer token chosen from the exact prefill's logits
        self.gap: float | None = None
        self.seconds: float | None = None
        self.agreed: int | None = None
        self.failure: str | None = None  # why the exact prefill failed (the answer went on approximately)
        self._pending: Callable[[], None] | None = None  # the exact prefill's store hand-off, after the next token

    @classmethod
    def for_request(cls, engine: "CachedEngine", segments: list[Segment] | None, info: dict, mode: str,
                    max_new_tokens: int, rewind: bool = False) -> "DecodeTieGuard | None":
        """The guard for an answer after a prefill with stats ``info``, or None: the setting is off,
        the mode is not ``cachedrag``, or the prefill was exact (a reordered exact prefix is exact KV).
        ``rewind``: the caller shows no token before the answer is whole and decodes greedily with no
        history (``generation.rewind_allowed``)."""
        threshold = engine.config.cache.exact.tie_guard_decode
        approximate = [a for a in info.get("approximations", ()) if a != "reordered"]
        if threshold <= 0 or mode != Mode.CACHEDRAG.value or not approximate or segments is None or max_new_tokens < 2:
            return None
        return cls(engine, list(segments), threshold, max_new_tokens, rewind)

    def due(self, logits: torch.Tensor, n_tokens: int) -> bool:
        """Whether the answer, ``n_tokens`` (>= 1) tokens long, should move onto exact KV before its
        next token (chosen from ``logits`` ``[V]``); records the gap when it should."""
        if self.token is not None or self.failure is not None or not 0 < n_tokens < self.max_new_tokens:
            return False
        tied, gap = self.engine.near_tie(logits, self.threshold)
        if not tied:
            return False
        self.gap = gap
        return True

    def switch(self, answer: Sequence[int], between_layers: Callable[[int, int], None] | None = None) -> "Prefilled":
        """The exact prefill of the prompt and ``answer``; the caller decodes on from its KV and runs
        its ``hand_off`` once the next token is out."""
        t0 = time.perf_counter()
        exact = self.engine.prefill_exact_continuation(self.segments, answer, self.max_new_tokens, between_layers,
                                                       stop_at_disagreement=self.rewind)
        return self.switched(answer, exact, t0)

    def switch_task(self, answer: Sequence[int]) -> PrefillTask:
        """``switch`` as a task the caller advances; pass its result to ``switched``."""
        return self.engine.exact_continuation_task(self.segments, answer, self.max_new_tokens,
                                                   stop_at_disagreement=self.rewind)

    def switched(self, answer: Sequence[int], exact: "Prefilled", t0: float) -> "Prefilled":
        """Record the switch to ``exact`` (the exact prefill of the prompt and ``answer``, begun at ``t0``)."""
        self.token, self.agreed = len(answer), exact.info["answer_agreed"]
        if exact.info["answer_kept"] < len(answer):
            self.rewound = len(answer) - exact.info["answer_kept"]
            if exact.info["answer_kept"] == 0:
                self.replaced_first = answer[0]
        self.seconds = time.perf_counter() - t0
        return exact

    def __call__(self, logits: torch.Tensor, answer: list[int]):
        """``decode_loop``'s ``switch`` hook. If the exact prefill fails, the answer goes on from the
        approximate logits (logged; ``failure`` says why)."""
        self.close()  # the previous switch's token is out: store its exact path now
        if not self.due(logits, len(answer)):
            return None
        try:
            exact = self.switch(answer)
        except Exception as exc:
            self.fail(exc)
            return None
        self._pending = exact.hand_off
        if self.rewound is not None:
            raise Rewind(exact.kv, exact.logits, exact.info["answer_kept"])
        return exact.kv, exact.logits

    def fail(self, exc: BaseException) -> None:
        """The exact prefill failed: log it and record why; the answer goes on approximately and the
        guard watches no more."""
        log.exception("the tie guard's exact prefill during decoding failed")
        self.failure = f"tie guard during decoding: exact prefill failed: {exc!r}"

    def close(self) -> None:
        """Run a pending store hand-off (a failure costs only the caching)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            try:
                pending()
            except Exception:
                log.exception("store hand-off of the tie guard's exact prefill during decoding failed")

    def stats(self) -> dict:
        return {"tie_guard_switch": self.token, "tie_guard_switch_gap": self.gap,
                "tie_guard_switch_s": self.seconds, "tie_guard_agreed": self.agreed, "tie_guard_rewound": self.rewound}


def near_tie(engine, logits: torch.Tensor, threshold: float) -> tuple[bool, float]:
    """Whether the top-2 logits of ``logits`` ``[V]`` are a near tie at ``threshold`` nats, allowing
    for one rounding unit of the runner's dtype at the top logit (``kvcache.tie.near_tie``: in
    bfloat16 a gap read as 0.25 nats may be two 1/8-nat steps), and the gap as read."""
    top, gap = top2(logits)
    bits = round(-math.log2(torch.finfo(engine.runner.dtype).eps))  # explicit mantissa bits
    return _near_tie(gap, top, threshold, bits), gap


def exact_repeat(manager, cache, plan, request, exact_plan: bool):
    """``CacheConfig.exact.repeats``: when the plan reuses chunk variants and this chunk sequence has now
    been served from reuse that many times, either it is planned again as prefix caching would (timing
    "inline", or "after_response_else_inline" when an earlier promotion has not landed) or its exact path
    is promoted after the response. Returns the plan to run and ``"inline"``, ``"promote"`` or None."""
    if not cache.exact.repeats or exact_plan or plan.repeat < cache.exact.repeats:
        return plan, None
    overdue = plan.repeat > cache.exact.repeats  # an earlier sighting's promotion has not landed
    when = cache.exact.repeats_when
    if when == "inline" or (when == "after_response_else_inline" and overdue):
        manager.release(plan, used=False)  # this sighting is computed exactly and stores its path
        return manager.plan(request, Mode.PREFIX), "inline"
    return plan, "promote"


def first_token_guard(engine, mode: Mode, exact_plan: bool, request, plan, pre: _Prefill, hand_offs: list,
                      t_first: float, execute: Callable[[object], Steps]) -> Steps:
    """``CacheConfig.exact.tie_guard``: reads the approximate prefill's first-token top-2 gap (reported as
    ``first_token_gap``) and, in mode ``cachedrag`` when it is a near tie, prefills exactly
    (``execute(prefix plan)``); the approximate prefill's time counts in ``prefill_s``. Fresh chunks
    the first prefill computed before its first reused one are stored first, so the exact prefill
    finds them on the tree. Returns ``(plan, pre, hand_offs, fields)``; ``fields``: the result's
    ``tie_guard``, ``first_token_gap``, ``tie_guard_actions`` (the exact prefill ran when
    ``tie_guard`` is not None)."""
    threshold = engine.config.cache.exact.tie_guard
    fields = {"tie_guard": None, "first_token_gap": None, "tie_guard_actions": None}
    if mode is Mode.FULL or exact_plan or not pre.info["approximations"]:
        return plan, pre, hand_offs, fields
    logits = pre.logits[-1] if pre.logits.dim() == 2 else pre.logits  # [V]
    tied, fields["first_token_gap"] = engine.near_tie(logits, threshold)
    if not (threshold and mode is Mode.CACHEDRAG and tied):
        return plan, pre, hand_offs, fields
    if hand_offs and any(sp.action is Action.FRESH for sp in plan.segments[:pre.exact_segments]):
        try:
            for call in hand_offs:
                call()
        except Exception:  # only the caching failed: the exact prefill computes them itself
            log.exception("store hand-off before the tie guard's exact prefill failed")
        hand_offs = []
    fields["tie_guard"], fields["tie_guard_actions"] = fields["first_token_gap"], pre.info["segment_actions"]
    seconds = time.perf_counter() - t_first
    plan = engine.manager.plan(request, Mode.PREFIX)
    pre, exact_hand_offs = yield from execute(plan)
    pre.info["prefill_s"] += seconds
    return plan, pre, hand_offs + exact_hand_offs, fields  # the first prefill's fresh chunks are stored too


class Promotion:
    """The exact knowledge-tree path of a recurring chunk sequence (exact repeats), computed after the
    response: a prefill of the part not on the tree, as prefix caching does on a miss (the question
    rows ride along, nothing is decoded). Call it (``between_layers`` may abandon it by raising:
    nothing stored) for its seconds, or advance ``task()``."""

    def __init__(self, engine, segments: list[Segment], mode: Mode):
        self.engine, self.segments, self.mode = engine, list(segments), mode

    def task(self) -> PrefillTask:
        return PrefillTask(self.engine._prefill_steps(self.segments, self.mode, 0, exact_plan=True))

    def __call__(self, between_layers: Callable[[int, int], None] | None = None) -> float:
        t0 = time.perf_counter()
        self.task().run(between_layers)
        return time.perf_counter() - t0


def exact_continuation(engine, segments: list[Segment], answer: list[int], max_new_tokens: int,
                       answer_rows: str = "prefill", stop_at_disagreement: bool = False) -> Steps:
    """Exact prefill of ``segments`` followed by the ``answer`` tokens; ``pre.logits`` holds the rows
    ``[len(answer) + 1, V]`` predicting each answer token and the next one; the store hand-off is left
    in ``pre.hand_off``.

    ``answer_rows``: how the answer tokens' rows are computed. ``"decode"`` (a switch, which goes on
    decoding): one ``decode_step`` each after the prompt's prefill, as a full prefill's answer wrote
    them, so the continuation has that answer's KV bit for bit where the prompt's is (in bfloat16 a
    prefill's rows round apart from decode steps' and near ties flip). ``"prefill"`` (teacher-forced
    scoring): appended to the question in the one prefill, as ``_teacher_forced`` scores full
    prefill's answer. ``stop_at_disagreement`` (with ``"decode"``): no rows past the first answer token
    the exact rows would not have chosen (greedy).

    Planned as prefix caching (``exact_plan``) but run as ``cachedrag``, so what it computes fresh
    is stored with its attention metadata: an exact entry that replaces the approximate prefill's
    variant of a chunk (same path) stays that chunk's variant, reusable elsewhere."""
    if answer_rows == "prefill":
        question = segments[-1]
        extended = dataclasses.replace(question, ids=tuple(question.ids) + tuple(answer))
        return (yield from engine._prefill_steps(segments[:-1] + [extended], Mode.CACHEDRAG,
                                                 max_new_tokens - len(answer), defer_store=True, exact_plan=True,
                                                 tail_logits=len(answer) + 1))
    pre = yield from engine._prefill_steps(segments, Mode.CACHEDRAG, max_new_tokens, defer_store=True,
                                           exact_plan=True)
    start = pre.kv.length
    rows = [pre.logits.reshape(1, -1).float()]  # [1, V]
    for j, token in enumerate(answer):
        if stop_at_disagreement and int(rows[-1].argmax()) != token:
            break
        rows.append(engine.runner.decode_step(token, start + j, pre.kv)[None].float())  # [1, V]
    pre.logits = torch.cat(rows)  # [kept + 1, V]: kept = len(answer) unless it stopped at a disagreement
    return pre


def continuation_prefilled(pre: _Prefill, answer: list[int]) -> Prefilled:
    """``prefill_exact_continuation``'s result from its exact prefill: ``logits`` predict the token after
    the kept answer; ``info`` adds ``answer_agreed`` and ``answer_kept``."""
    rows = pre.logits  # [kept + 1, V]: row j predicts answer token j
    chosen = rows[:-1].argmax(-1).tolist()
    kept = rows.shape[0] - 1
    pre.info["answer_agreed"] = next((j for j, (c, a) in enumerate(zip(chosen, answer)) if c != a), kept)
    pre.info["answer_kept"] = kept
    return Prefilled(kv=pre.kv, logits=rows[-1].float(), info=pre.info, hand_off=pre.hand_off, segments=pre.segments)


@torch.inference_mode()
def guard_teacher(engine, rows: torch.Tensor, segments: list[Segment], teacher: list[int],
                  guard: "DecodeTieGuard") -> None:
    """Teacher-forced logits ``rows`` ``[A, V]`` as the tie guard during decoding would give them: from
    the first position >= 1 whose approximate logits are a near tie on, the exact prefill's rows
    (the prompt and ``teacher[:-1]`` prefilled exactly; nothing stored: a measurement must not
    change the cache)."""
    at = next((j for j in range(1, len(teacher)) if engine.near_tie(rows[j], guard.threshold)[0]), None)
    if at is None:
        return
    exact = drive(exact_continuation(engine, segments, teacher[:-1], guard.max_new_tokens))  # [A, V]
    rows[at:] = exact.logits[at:].float()


def top2(logits: torch.Tensor) -> tuple[float, float]:
    """The top logit of ``logits`` ``[V]`` and how far it leads the second (nats of log-probability)."""
    first, second = logits.float().topk(2).values.tolist()  # one read of the device
    return first, first - second


def top2_gap(logits: torch.Tensor) -> float:
    """How far the top logit of ``logits`` ``[V]`` leads the second (nats of log-probability)."""
    return top2(logits)[1]
