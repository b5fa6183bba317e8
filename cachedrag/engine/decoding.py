"""The decode tail of ``CachedEngine.generate``: after the prefill, decode (the decode tie guard
watching, prompt-lookup drafts), run the store hand-off once the first token is out, build the
``EngineResult``, then the exact-repeat promotion and, with a teacher answer, its teacher-forced
logits. Sampling and the decode loop itself are ``cachedrag.model``'s (``textgen.stream_tokens``)."""

from __future__ import annotations

from collections.abc import Sequence

from cachedrag.kvcache.planner import Mode
from cachedrag.model.generation import SamplingParams, rewind_allowed
from cachedrag.model.lookup import prompt_lookup
from cachedrag.model.textgen import stream_tokens
from cachedrag.prompt import Segment
from cachedrag.engine.continuation import remember
from cachedrag.engine.exact import DecodeTieGuard, guard_teacher
from cachedrag.engine.result import EngineResult, _Holder
from cachedrag.engine.state import _Prefill


def run_request(engine, pre: _Prefill, segments: list[Segment], params: SamplingParams, mode: Mode, start: float,
                holder: _Holder, teacher: Sequence[int] | None = None, rewind: bool = False,
                conversation: bool = False):
    """Decode after ``pre`` (yielding text deltas) and set ``holder.result``. ``rewind``: nobody sees
    the deltas (not streamed), so the tie guard during decoding may rewind. ``conversation``: the
    prompt and answer are stored as one tree path (``continuation.remember``) unless the guard
    moved decoding onto another buffer."""
    prompt_tokens = pre.info["prompt_tokens"]
    lookup = prompt_lookup(engine.config.lookup, [t for s in segments for t in s.ids], params.temperature == 0.0)
    guard = DecodeTieGuard.for_request(engine, pre.segments, pre.info, mode.value, params.max_new_tokens,
                                       rewind=rewind and rewind_allowed(params))
    try:
        yield from stream_tokens(engine.runner, pre.kv, pre.logits, prompt_tokens, params, engine.eos_ids, start,
                                 holder, lookup, after_first=pre.hand_off,  # the hand-off waits for the 1st token
                                 switch=guard)
    finally:
        if guard is not None:
            guard.close()
    if conversation and (guard is None or guard.token is None):  # the buffer holds this answer's rows
        remember(engine, pre.segments, pre.kv, holder.last_result.token_ids, exact_segments=pre.exact_segments,
                 mode=mode, conversation=True)
    holder.result = _result(holder.last_result, pre, mode, lookup, guard)
    if teacher is not None:
        holder.result.teacher_logits = engine._teacher_forced(pre, prompt_tokens, list(teacher))
        if guard is not None:
            guard_teacher(engine, holder.result.teacher_logits, pre.segments, list(teacher), guard)
    _promote(pre, holder.result, guard)


def _result(g, pre: _Prefill, mode: Mode, lookup, guard: DecodeTieGuard | None) -> EngineResult:
    """The ``EngineResult`` of decoded ``g`` after ``pre`` (the guard's stats merged in)."""
    info = dict(pre.info, decoded_first_token=g.token_ids[0] if g.token_ids else None)
    if guard is not None:
        info.update(guard.stats())
        if guard.replaced_first is not None:
            info["decoded_first_token"] = guard.replaced_first
        if guard.failure is not None:
            info["notes"] = [*info["notes"], guard.failure]
    return EngineResult(
        text=g.text, token_ids=g.token_ids, mode=mode.value, ttft_s=g.ttft_s, total_s=g.total_s,
        prompt_tokens=pre.info["prompt_tokens"], finish_reason=g.finish_reason, token_logprobs=g.token_logprobs,
        draft_passes=lookup.passes if lookup else 0, draft_tokens=lookup.proposed if lookup else 0,
        draft_accepted=lookup.accepted if lookup else 0,
        **{k: v for k, v in info.items() if k != "prompt_tokens"},
    )


def _promote(pre: _Prefill, result: EngineResult, guard: DecodeTieGuard | None) -> None:
    """The answer is out: compute the recurring sequence's exact path (``exact.Promotion``), unless the
    decode guard's switch stored it already. A failure is reported, not raised: the answer stands."""
    if guard is not None and guard.token is not None and pre.promote is not None:
        pre.promote = None  # the switch stored this sequence's exact path already: nothing to promote
        result.exact_repeat = None
    if pre.promote is not None:
        try:
            result.promotion_s = pre.promote()
            result.exact_repeat = "promoted"
        except Exception as exc:
            result.notes.append(f"exact-repeat promotion failed: {exc!r}")
