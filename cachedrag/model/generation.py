"""Token sampling, stop strings and incremental detokenisation for decoding.

Owns: ``SamplingParams`` (validated), choosing the next token from logits (greedy, or
temperature + top-k + top-p with a seeded generator; repetition (Hugging Face's rule) and
frequency / presence (OpenAI's) penalties over the tokens generated so far; an optional
``constraint`` that masks the logits, e.g. grammar-constrained JSON from
``cachedrag.model.constraint``), and ``TextStream``, which turns generated token
ids into text deltas that never expose a partial stop string or a half-decoded character;
``SequenceDecoder``, one sequence's per-token decode state, which both ``generate`` (``decode_steps``)
and the server's batched loop decode through.
Does not own: the forward pass (``runner.py``) or prompt assembly (the engine).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator


class SamplingParams(BaseModel):
    """How to decode: greedy when ``temperature == 0``."""

    model_config = ConfigDict(frozen=True, arbitrary_types_allowed=True)

    max_new_tokens: int = Field(64, ge=1, description="upper bound on generated tokens")
    temperature: float = Field(0.0, ge=0.0, description="0 = greedy; >0 samples")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="nucleus sampling mass")
    top_k: int = Field(0, ge=0, description="sample among the k most likely tokens; 0 = no limit")
    repetition_penalty: float = Field(1.0, gt=0.0, description="> 1 discourages tokens already generated "
                                      "(CTRL/Hugging Face rule: positive logits divided, negative multiplied); "
                                      "the prompt is not penalised, so answers may still quote it")
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0, description="OpenAI's rule: subtracted from a token's "
                                     "logit once per time it was generated so far")
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0, description="OpenAI's rule: subtracted once from the "
                                    "logit of every token generated so far")
    constraint: Any = Field(None, exclude=True, description="a per-request logits constraint with "
                            "mask(logits) -> logits, advance(token) and done (see cachedrag.model.constraint)")
    stop: tuple[str, ...] = Field((), description="stop strings; generation ends before them")
    seed: int | None = Field(None, description="seed for sampling; None = nondeterministic")

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_tuple(cls, value):
        if value is None:
            return ()
        if isinstance(value, str):
            value = (value,)
        value = tuple(value)
        if any(not s for s in value):
            raise ValueError("stop strings must be non-empty")
        return value


def make_generator(params: SamplingParams, device: torch.device | str = "cpu") -> torch.Generator | None:
    if params.temperature == 0.0:
        return None
    gen = torch.Generator(device=device)
    gen.manual_seed(params.seed if params.seed is not None else torch.seed())
    return gen


def uses_history(params: SamplingParams) -> bool:
    """Whether choosing a token depends on more than the logits (penalty, constraint): such
    requests decode one token per step (no speculative drafts)."""
    return (params.repetition_penalty != 1.0 or params.frequency_penalty != 0.0 or params.presence_penalty != 0.0
            or params.constraint is not None)


def process_logits(logits: torch.Tensor, params: SamplingParams, generated: Sequence[int]) -> torch.Tensor:
    """Repetition, frequency and presence penalties over ``generated`` and the constraint's mask,
    applied to ``logits`` ``[V]`` (returns a new tensor when anything applies)."""
    if params.repetition_penalty != 1.0 and generated:
        logits = logits.float().clone()  # [V]
        seen = torch.tensor(sorted(set(generated)), device=logits.device)  # [S]
        picked = logits[seen]  # [S]
        logits[seen] = torch.where(picked > 0, picked / params.repetition_penalty, picked * params.repetition_penalty)
    if (params.frequency_penalty != 0.0 or params.presence_penalty != 0.0) and generated:
        if params.repetition_penalty == 1.0:
            logits = logits.float().clone()  # [V]
        ids, counts = torch.tensor(list(generated), device=logits.device).unique(return_counts=True)  # [S], [S]
        logits[ids] -= counts.to(logits.dtype) * params.frequency_penalty + params.presence_penalty
    if params.constraint is not None:
        logits = params.constraint.mask(logits)  # [V], disallowed tokens at -inf
    return logits


def next_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """Pick the next token from ``logits`` ``[V]`` (already through ``process_logits``)."""
    if params.temperature == 0.0:
        return int(torch.argmax(logits))
    logits = logits.float() / params.temperature  # [V]
    if 0 < params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))  # [V]
    probs = torch.softmax(logits, dim=-1)  # [V]
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)  # [V]
        keep = sorted_probs.cumsum(0) - sorted_probs < params.top_p  # [V] always keeps the top token
        sorted_probs = sorted_probs * keep
        choice = torch.multinomial(sorted_probs / sorted_probs.sum(), 1, generator=generator)
        return int(order[choice])
    return int(torch.multinomial(probs, 1, generator=generator))


@dataclass
class TextStream:
    """Accumulates token ids and yields safe text deltas, honouring stop strings."""

    tokenizer: object
    stop: tuple[str, ...] = ()
    ids: list[int] = field(default_factory=list)
    emitted: str = ""
    stopped: bool = False

    def push(self, token_id: int) -> str:
        """Add one token; return the newly safe text (may be empty)."""
        self.ids.append(token_id)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        cut = self._stop_index(text)
        if cut is not None:
            self.stopped = True
            text = text[:cut]
            delta = text[len(self.emitted):]
            self.emitted = text
            return delta
        if text.endswith("\ufffd"):  # incomplete multi-byte character: wait for the next token
            return ""
        safe = len(text) - self._partial_stop_suffix(text)
        delta = text[len(self.emitted):safe]
        if safe > len(self.emitted):
            self.emitted = text[:safe]
        return delta

    def rewound(self, keep: int) -> "TextStream":
        """A new stream over this one's first ``keep`` tokens (an answer taken back by a ``Rewind``),
        with the text they make as pushed one by one."""
        stream = TextStream(self.tokenizer, self.stop)
        for token in self.ids[:keep]:
            stream.push(token)
        return stream

    def flush(self) -> str:
        """Text held back at the end of generation (a partial stop string that never completed)."""
        if self.stopped:
            return ""
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        delta = text[len(self.emitted):]
        self.emitted = text
        return delta

    @property
    def text(self) -> str:
        return self.emitted

    def _stop_index(self, text: str) -> int | None:
        return stop_index(text, self.stop)

    def _partial_stop_suffix(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
        best = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(text)), 0, -1):
                if text.endswith(s[:n]):
                    best = max(best, n)
                    break
        return best


def stop_index(text: str, stop: Sequence[str]) -> int | None:
    """Where the earliest of the ``stop`` strings starts in ``text``, or None."""
    hits = [h for h in (text.find(s) for s in stop) if h >= 0]
    return min(hits) if hits else None


def eos_token_ids(model, tokenizer) -> set[int]:
    """Every token id that ends generation (tokenizer EOS plus the generation config's)."""
    ids: set[int] = set()
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(int(tokenizer.eos_token_id))
    gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if isinstance(gen_eos, int):
        ids.add(gen_eos)
    elif gen_eos:
        ids.update(int(x) for x in gen_eos)
    return ids


def choose_token(logits: torch.Tensor, params: SamplingParams, generated: Sequence[int],
                 generator: torch.Generator | None, eos_ids: set[int]) -> int:
    """The next token from ``logits`` ``[V]``: penalties over ``generated`` and the request's
    constraint applied (``process_logits``), then greedy or sampled; the constraint advances past
    it unless it is EOS. ``SequenceDecoder.choose`` (``generate`` and the server's loop) chooses through this."""
    token = next_token(process_logits(logits, params, generated), params, generator)
    if params.constraint is not None and token not in eos_ids:
        params.constraint.advance(token)
    return token


#: ``decode_loop``'s ``switch`` hook: called with the logits row ``[V]`` about to choose answer token
#: ``i >= 1`` and the ``i`` tokens chosen so far; returns None to go on, or ``(kv, logits)`` to go on
#: from instead: a KV buffer whose rows hold the prompt and those tokens, and the logits ``[V]`` of
#: the last of them (the engine's tie guard during decoding prefills exactly there).
Switch = Callable[[torch.Tensor, list[int]], "tuple[object, torch.Tensor] | None"]


class Rewind(Exception):
    """Raised by a ``switch`` hook (out of the decode loop) when the answer must go back to its first
    ``keep`` tokens and continue from ``kv`` (rows: the prompt and those tokens) and ``logits`` ``[V]``
    (predicting the token after them): the engine's tie guard during decoding, for a whole (not
    streamed) greedy answer whose earlier tokens the exact prefill would not have chosen.
    ``textgen.stream_tokens`` catches it; only a caller that has not shown the tokens may ask for it
    (``rewind_allowed``)."""

    def __init__(self, kv, logits: torch.Tensor, keep: int):
        super().__init__(f"rewind to {keep} tokens")
        self.kv, self.logits, self.keep = kv, logits, keep


def rewind_allowed(params: SamplingParams) -> bool:
    """Whether an answer decoded with ``params`` may be rewound (``Rewind``): greedy, and choosing a token
    depends on the logits alone (no penalty or grammar state to take back)."""
    return params.temperature == 0.0 and not uses_history(params)


class SequenceDecoder:
    """One sequence's decode state, shared by ``decode_loop`` (``generate``) and the server's batched
    loop: the sampling parameters, the tokens generated so far, the seeded generator, the EOS ids and the
    ``TextStream`` (stop strings, whole characters). The forward step is the caller's (``runner.decode_step``
    for one sequence, ``runner.decode_batch`` for B); per token the caller calls ``choose`` on the logits,
    then ``accept`` on a token that is not EOS, and stops once ``finished``."""

    def __init__(self, params: SamplingParams, eos_ids: set[int], stream: TextStream,
                 generator: torch.Generator | None = None):
        self.params, self.eos_ids, self.stream, self.generator = params, eos_ids, stream, generator
        self.tokens: list[int] = []
        self.eos = False  # EOS was chosen

    @classmethod
    def start(cls, runner, params: SamplingParams, eos_ids: set[int]) -> "SequenceDecoder":
        """A fresh decoder over ``runner``'s tokenizer, its generator on ``runner``'s device."""
        return cls(params, eos_ids, TextStream(runner.tokenizer, params.stop), make_generator(params, runner.device))

    def choose(self, logits: torch.Tensor) -> int | None:
        """The next token from ``logits`` ``[V]`` (``choose_token``), or None when it is EOS."""
        token = choose_token(logits, self.params, self.tokens, self.generator, self.eos_ids)
        if token in self.eos_ids:
            self.eos = True
            return None
        return token

    def accept(self, token: int) -> str:
        """Append ``token`` (not EOS); returns the text it makes safe to show (may be empty)."""
        self.tokens.append(token)
        return self.stream.push(token)

    @property
    def complete(self) -> bool:
        """A stop string was met or the constraint's document is complete: nothing may follow."""
        constraint = self.params.constraint
        return self.stream.stopped or (constraint is not None and constraint.done)

    @property
    def finished(self) -> bool:
        return self.eos or self.complete or len(self.tokens) >= self.params.max_new_tokens

    @property
    def finish_reason(self) -> str:
        """"length" when ``max_new_tokens`` cut the answer, else "stop" (EOS, stop string, complete grammar)."""
        return "length" if len(self.tokens) >= self.params.max_new_tokens and not self.complete else "stop"

    def rewind(self, keep: int) -> None:
        """Back to the first ``keep`` tokens (a ``Rewind``; greedy with no history, so nothing else to take back)."""
        del self.tokens[keep:]
        self.stream = self.stream.rewound(keep)
        self.eos = False


def decode_loop(runner, kv, first_logits: torch.Tensor, start_position: int, params: SamplingParams,
                eos_ids: set[int], stream: TextStream | None = None,
                logprobs: list[float] | None = None, lookup=None, switch: Switch | None = None) -> Iterator[int]:
    """Yield generated token ids until EOS, a stop string, or ``max_new_tokens`` (``decode_steps`` over
    a fresh ``SequenceDecoder``; ``stream``, when given, is the one it pushes each token to)."""
    decoder = SequenceDecoder.start(runner, params, eos_ids)
    if stream is not None:
        decoder.stream = stream
    for token, _ in decode_steps(runner, kv, first_logits, start_position, decoder, logprobs, lookup, switch):
        yield token


def decode_steps(runner, kv, first_logits: torch.Tensor, start_position: int, decoder: SequenceDecoder,
                 logprobs: list[float] | None = None, lookup=None,
                 switch: Switch | None = None) -> Iterator[tuple[int, str]]:
    """Yield ``(token, text delta)`` for each token ``decoder`` accepts until it is ``finished``.

    ``first_logits`` are the prefill's last-position logits; the token chosen from them sits
    at ``start_position``. EOS tokens are not yielded. With ``logprobs``, the model's log
    probability of each yielded token (under the unscaled distribution) is appended to it.
    ``decoder`` may already hold tokens (after a ``Rewind``): ``start_position`` is then where the
    next one goes.

    ``lookup`` (a ``PromptLookup`` over the prompt's token ids) turns on speculative greedy
    decoding when ``temperature == 0``: see :func:`speculative_decode_loop`. ``switch`` (see
    ``Switch``) may move decoding onto another KV buffer before any token after the first.
    """
    params = decoder.params
    if lookup is not None and params.temperature == 0.0 and not uses_history(params):
        yield from speculative_decode_loop(runner, kv, first_logits, start_position, decoder, lookup, logprobs,
                                           switch)
        return
    logits = first_logits
    position = start_position
    step = 0
    while not decoder.finished:
        if switch is not None and step:
            moved = switch(logits, decoder.tokens)
            if moved is not None:
                kv, logits = moved
        token = decoder.choose(logits)
        if token is None:
            return
        if logprobs is not None:  # the model's own distribution (before penalty / constraint / temperature)
            logprobs.append(float(torch.log_softmax(logits.float(), dim=-1)[token]))
        yield token, decoder.accept(token)
        if decoder.finished:
            return
        logits = runner.decode_step(token, position, kv)
        position += 1
        step += 1


def speculative_decode_loop(runner, kv, first_logits: torch.Tensor, start_position: int, decoder: SequenceDecoder,
                            lookup, logprobs: list[float] | None = None,
                            switch: Switch | None = None) -> Iterator[tuple[int, str]]:
    """Greedy decoding that verifies prompt-lookup drafts (the same tokens as greedy ``decode_steps``
    up to float rounding of multi-row passes); yields ``(token, text delta)`` like it.

    After each chosen token, ``lookup`` proposes what follows it (``model/lookup.py``); one
    forward pass computes the token and the draft at their positions, and every draft token
    that equals the argmax of the logits before it is accepted. The first mismatch is replaced
    by that argmax, so each pass yields at least one token, like a plain decode step. Rows of
    rejected draft tokens stay in the buffer past the accepted length: the next pass overwrites
    them, and no query attends past its own position. ``switch`` is asked before each token after
    the first; when it moves decoding, the pass's later choices are dropped and the token comes
    from the logits it returned.
    """
    max_new_tokens = decoder.params.max_new_tokens
    choices = [(int(torch.argmax(first_logits)), first_logits)]  # (token, the logits row that chose it)
    fed = 0  # tokens yielded by this loop
    while True:
        j = 0
        while j < len(choices):
            token, row = choices[j]
            if switch is not None and fed:
                moved = switch(row, decoder.tokens)
                if moved is not None:
                    kv, row = moved
                    choices = [(int(torch.argmax(row)), row)]
                    token, j = choices[0][0], 0
            j += 1
            if token in decoder.eos_ids:
                decoder.eos = True
                return
            if logprobs is not None:
                logprobs.append(float(torch.log_softmax(row.float(), dim=-1)[token]))
            yield token, decoder.accept(token)
            fed += 1
            if decoder.finished:
                return
            lookup.extend((token,))
        position = start_position + fed - 1  # where the last yielded token sits
        draft = lookup.draft(max_new_tokens - len(decoder.tokens) - 1)
        if not draft:
            logits = runner.decode_step(token, position, kv)  # [V]
            choices = [(int(torch.argmax(logits)), logits)]
            continue
        feed = torch.tensor([token, *draft])  # [1 + m]
        rows = runner.prefill(feed, positions=torch.arange(position, position + feed.shape[0]), kv=kv,
                              all_logits=True)  # [1 + m, V]
        preds = rows.argmax(-1).tolist()  # [1 + m] greedy choice after each fed token
        agreed = next((j for j, d in enumerate(draft) if preds[j] != d), len(draft))
        lookup.record(len(draft), agreed)
        # the agreed draft tokens (preds[j] == draft[j]) and then the model's own next token
        choices = [(preds[j], rows[j]) for j in range(agreed + 1)]
