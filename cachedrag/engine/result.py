"""What a request returns: ``EngineResult`` (the answer and its per-request stats), ``Prefilled``
(a prefill ready to decode, as the server and the decode guard use it) and ``GenerationStream``
(text deltas, then the result), and a prefill's stats (``prefill_info``: what was computed, what
was served from cache, and what made the prefill differ from full prefill).

Owns the result types and the accounting; the stages fill them."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from cachedrag.kvcache.planner import Action, Mode
from cachedrag.model.runner import KVBuffer
from cachedrag.prompt import Segment


@dataclass
class EngineResult:
    """Answer and per-request stats of one ``generate`` call."""

    text: str
    token_ids: list[int]
    mode: str
    ttft_s: float
    total_s: float
    prompt_tokens: int
    computed_tokens: int  # tokens computed at full depth (every layer): fresh + recomputed + question
    computed_fraction: float  # token-layers computed / (layers x prompt tokens), early termination included
    fresh_tokens: int
    recomputed_tokens: int  # tokens of reused chunks recomputed at full depth
    question_tokens: int
    prefix_hit_tokens: int
    chunks_hit: int
    chunks_missed: int
    chunk_cfo: list[float | None]
    chunk_recompute: list[list[int]]  # per chunk: token indices within the chunk chosen for recompute (those of
    #                                   chunks dropped at the focus layer stop there and count as checked)
    focus_layer: int | None
    load_s: float
    prefill_s: float
    finish_reason: str
    notes: list[str] = field(default_factory=list)
    token_logprobs: list[float] = field(default_factory=list)  # log p of each generated token
    draft_passes: int = 0  # speculative decoding: verification passes that carried a prompt-lookup draft
    draft_tokens: int = 0  # draft tokens verified
    draft_accepted: int = 0  # draft tokens accepted (each saved one decode step)
    cached_tokens: int = 0  # prompt tokens served from cache = not recomputed at full depth (prompt - computed)
    checked_tokens: int = 0  # cached tokens computed at the lower layers only (deviation check probes and recompute
    #                          tokens of chunks dropped at the focus layer); they stay counted as cached
    token_choice: str | None = None  # how recompute tokens were chosen (None: nothing reused)
    approximations: list[str] = field(default_factory=list)  # what made this answer differ from full prefill
    chunk_order: list[int] | None = None  # order-aware reuse: retrieved indices in the order served (None: as given)
    exact_repeat: str | None = None  # CacheConfig.exact.repeats: "inline" (this recurring sequence was prefilled
    #                                  exactly), "promoted" (served from reuse, then its exact tree path computed),
    #                                  "promote" (that computation handed to the caller: ``Prefilled.promote``)
    promotion_s: float = 0.0  # seconds spent computing the exact path after the response (not in ttft/total)
    first_token_gap: float | None = None  # an approximate prefill's first-token top-2 logit gap (nats): how near its
    #                                      first token was to a rival (None: the prefill was exact)
    tie_guard: float | None = None  # CacheConfig.exact.tie_guard: the approximate prefill's first-token top-2 logit gap
    #                                 when it was near-tied and the request was prefilled again exactly (else None)
    segment_actions: list[str] = field(default_factory=list)  # per segment before the question (system, then the
    #                                                          chunks and any text between them), in the order served:
    #                                                          "tree" (exact prefix hit), "reuse" (a chunk variant),
    #                                                          "fresh" (computed); the prefill that made the answer
    tie_guard_actions: list[str] | None = None  # the approximate prefill's segment_actions when the tie guard
    #                                             prefilled the request again (else None)
    tie_guard_switch: int | None = None  # CacheConfig.exact.tie_guard_decode: the answer token (0-based) before which a near
    #                                      tie moved decoding onto an exact prefill of the prompt and the answer so far
    #                                      (else None); that token and the rest came from exact KV
    tie_guard_switch_gap: float | None = None  # the approximate top-2 logit gap there
    tie_guard_switch_s: float | None = None  # seconds the answer paused for that exact prefill (in total_s)
    tie_guard_agreed: int | None = None  # how many leading tokens before the switch are the exact prefill's greedy
    #                                      choices too (== tie_guard_switch: the whole greedy answer is full prefill's)
    tie_guard_rewound: int | None = None  # a whole answer (not streamed) went back this many tokens, to where the
    #                                       exact prefill agreed, and on from there (None: no rewind)
    decoded_first_token: int | None = None  # the first token as first decoded: what a stream of this answer would
    #                                         have shown first. Differs from token_ids[0] only where a rewind took
    #                                         the answer back past it (a first-token flip the first-token guard missed)
    teacher_logits: torch.Tensor | None = None  # [A, V] with ``teacher=``: logits at each given answer position

    def stats(self) -> dict:
        """Everything but the text (and tensors), JSON-ready."""
        out = dict(self.__dict__)
        out.pop("text")
        out.pop("token_ids")
        out.pop("token_logprobs")
        out.pop("teacher_logits")
        return out


@dataclass
class Prefilled:
    """What ``CachedEngine.prefill`` hands a scheduler: the request's KV, first logits and stats."""

    kv: KVBuffer  # rows 0..prompt_tokens-1 valid; capacity prompt + max_new_tokens
    logits: torch.Tensor  # [V] float32, logits of the last prompt position
    info: dict  # prompt_tokens, computed_tokens, chunks_hit, ... (EngineResult's prefill fields)
    hand_off: Callable[[], None] | None = None  # with ``prefill(defer_store=True)``: run once the first token is out
    promote: Callable[..., float] | None = None  # ``CacheConfig.exact.repeats``: computes and stores this recurring
    #                                              sequence's exact tree path (returns its seconds); run it after the
    #                                              response, e.g. when idle; ``between_layers=`` may abandon it by
    #                                              raising (nothing stored). None: nothing to promote
    segments: list[Segment] | None = None  # the prompt as served (order-aware reuse may reorder the chunks)
    exact_segments: int = 0  # leading segments whose KV equals full prefill (``continuation.remember``)


class GenerationStream:
    """Iterator of text deltas; ``.result`` holds the ``EngineResult`` once exhausted."""

    def __init__(self, deltas: Iterator[str], holder: "_Holder"):
        self._deltas = deltas
        self._holder = holder

    def __iter__(self) -> Iterator[str]:
        return self._deltas

    @property
    def result(self) -> EngineResult | None:
        return self._holder.result


class _Holder:
    result: EngineResult | None = None
    last_result = None  # set by textgen.stream_tokens


def prefill_info(n_layers: int, plan, rows, compute: list[int], state, mode: Mode, choice: str, chunk_seg: list[int],
                 precision, load_s: float, prefill_s: float, notes: list[str]) -> dict:
    """A prefill's stats (``EngineResult``'s prefill fields). Truthful reuse: only tokens that reached the
    last layer (``state.positions``) were computed; the rest of the prompt was served from cache (some of
    it probed at the lower layers: "checked"). ``approximations`` is empty when the prefill equals full
    prefill of the order served."""
    total, actions = rows.total, rows.actions
    full_depth = set(state.positions.tolist())
    n_recomputed = len(full_depth - set(rows.fresh_pos) - set(rows.question_pos))
    chunk_actions = [actions[i] for i in chunk_seg]
    reused = [i for i, a in enumerate(actions) if a is Action.REUSE]
    used_choice = (None if not reused else "none" if mode is Mode.NAIVE
                   else "random" if mode is Mode.RANDOM else choice)
    approximations = []
    if reused:
        approximations.append("chunk_reuse")
        if any(p not in full_depth for i in reused for p in range(plan.segments[i].start, plan.segments[i].end)):
            approximations.append(f"partial_recompute:{used_choice}")
        if state.focus_layer is not None:
            approximations.append("early_termination")
        reused_rows = len(compute) > len(rows.fresh_pos) + len(rows.question_pos)  # reused rows computed
        if precision.used and precision.recompute_low and reused_rows:
            approximations.append("recompute_bfloat16")
        if precision.used and precision.fresh_low:
            approximations.append("fresh_bfloat16")
    return {
        "prompt_tokens": total,
        "computed_tokens": len(full_depth),
        "cached_tokens": total - len(full_depth),
        "checked_tokens": len(compute) - len(full_depth),
        "computed_fraction": state.token_layers / (n_layers * total),
        "fresh_tokens": len(rows.fresh_pos),
        "recomputed_tokens": n_recomputed,
        "question_tokens": len(rows.question_pos),
        "prefix_hit_tokens": sum(sp.n_tokens for sp, a in zip(plan.segments, actions) if a is Action.TREE),
        "chunks_hit": sum(a is not Action.FRESH for a in chunk_actions),
        "chunks_missed": sum(a is Action.FRESH for a in chunk_actions),
        "chunk_cfo": [plan.segments[i].cfo if actions[i] is Action.REUSE else None for i in chunk_seg],
        "chunk_recompute": [[p - plan.segments[i].start for p in rows.recompute_pos.get(i, ())] for i in chunk_seg],
        "focus_layer": state.focus_layer,
        "load_s": load_s,
        "prefill_s": prefill_s,
        "segment_actions": [a.value for a in actions],
        "notes": notes,
        "token_choice": used_choice,
        "approximations": approximations,
    }
