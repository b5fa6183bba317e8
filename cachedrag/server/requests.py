"""What the engine loop takes in and hands out: ``ServeRequest`` (prompt segments, sampling
parameters, an ``emit`` callback), the events it emits (``Delta``, ``Finished``, ``Failed``, with
``TokenLogprob``), and the loop's per-choice decode state (``_Running``). Plain data; the loop
(``cachedrag.server.loop``) owns what happens to them."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from cachedrag.engine import DecodeTieGuard
from cachedrag.model.generation import SamplingParams, SequenceDecoder, TextStream
from cachedrag.prompt import Segment


@dataclass
class TokenLogprob:
    """A generated token's log probability under the model's own distribution (before penalties,
    constraint and temperature, as ``CachedEngine.generate`` reports it) and its ``top`` most
    likely alternatives ``[(token id, log p)]``."""

    token: int
    logprob: float
    top: list[tuple[int, float]]


@dataclass
class Delta:
    text: str
    logprobs: list[TokenLogprob] | None = None  # the tokens up to this text (when the request asked for them)
    index: int = 0  # the choice it belongs to (``ServeRequest.n``)


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
    conversation: bool = False  # a chat's or an agent's step (``PlannedPrompt.conversation``): its prompt and its
    #                             first choice's answer are stored as one tree path (``continuation.remember``)
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


@dataclass
class _Running:
    request: ServeRequest
    kv: object  # KVBuffer
    decoder: SequenceDecoder  # tokens, sampling state, stop strings (shared with ``generate``)
    stats: dict
    position: int  # where the last chosen token goes when fed back
    params: SamplingParams  # this choice's (``ServeRequest.choice_params``)
    index: int = 0  # the choice (``ServeRequest.n``)
    ttft_s: float = 0.0
    last: int | None = None  # the token to feed next
    logprobs: list[TokenLogprob] = field(default_factory=list)  # chosen, not yet sent with a text delta
    guard: DecodeTieGuard | None = None  # CacheConfig.exact.tie_guard_decode (None: off, or the prefill was exact)
    near_tie: torch.Tensor | None = None  # [V] the near-tied logits while the request waits for its exact prefill
    held: bool = False  # its text is sent whole when it finishes (the guard may rewind it; nobody sees a delta)
    prefilled: object = None  # Prefilled: kept while its prompt and answer are to be stored (a conversation's
    #                           first choice; dropped when the tie guard moves it onto another buffer)

    @property
    def tokens(self) -> list[int]:
        return self.decoder.tokens

    @property
    def stream(self) -> TextStream:
        return self.decoder.stream

    def take_logprobs(self) -> list[TokenLogprob] | None:
        if self.request.logprobs is None:
            return None
        out, self.logprobs = self.logprobs, []
        return out


def token_logprob(logits: torch.Tensor, token: int, alternatives: int) -> TokenLogprob:
    """``token``'s log p under ``logits`` ``[V]`` and the ``alternatives`` most likely tokens."""
    lp = torch.log_softmax(logits.float(), dim=-1)  # [V]
    top: list[tuple[int, float]] = []
    if alternatives:
        values, ids = lp.topk(alternatives)  # [k], [k]
        top = list(zip(ids.tolist(), values.tolist()))
    return TokenLogprob(token, float(lp[token]), top)
