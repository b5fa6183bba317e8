"""Plain text generation over the runner: full prefill, then decode (no cache reuse).

Owns: turning a prompt (text, chat messages or token ids) into token ids with the tokenizer's
chat template, context-window checks, and the prefill -> decode -> text loop with time to
first token. This is the ``full`` baseline and what the demo uses before chunk reuse; the
chunk-cache engine replaces only the prefill step.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch

from cachedrag.errors import ContextWindowError, EmptyInputError
from cachedrag.model.generation import Rewind, SamplingParams, SequenceDecoder, Switch, decode_steps, eos_token_ids
from cachedrag.model.lookup import LookupConfig, PromptLookup, prompt_lookup
from cachedrag.model.runner import ModelRunner


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    prompt_tokens: int
    ttft_s: float
    total_s: float
    finish_reason: str  # "stop" (EOS or stop string) or "length"
    token_logprobs: list[float] | None = None  # log p of each generated token


def chat_messages(question: str, system_prompt: str | None = None) -> list[dict[str, str]]:
    messages = []
    if system_prompt:
        messages.append({"role": "system", "content": system_prompt})
    messages.append({"role": "user", "content": question})
    return messages


def chat_ids(tokenizer, messages: Sequence[dict[str, str]]) -> list[int]:
    """Token ids of ``messages`` through the tokenizer's chat template, ready for the answer."""
    if not messages or not any(m.get("content", "").strip() for m in messages):
        raise EmptyInputError("the prompt is empty")
    if getattr(tokenizer, "chat_template", None):
        out = tokenizer.apply_chat_template(list(messages), tokenize=True, add_generation_prompt=True)
        if hasattr(out, "keys") and "input_ids" in out:  # some tokenizers return an encoding
            out = out["input_ids"]
        return [int(x) for x in out]
    text = "\n".join(f"{m['role']}: {m['content']}" for m in messages) + "\nassistant:"
    return tokenizer.encode(text)


def check_context(runner: ModelRunner, prompt_tokens: int, max_new_tokens: int) -> None:
    if prompt_tokens == 0:
        raise EmptyInputError("the prompt has no tokens")
    if prompt_tokens + max_new_tokens > runner.max_context:
        raise ContextWindowError(
            f"prompt of {prompt_tokens} tokens + {max_new_tokens} new tokens exceeds the model's "
            f"context window of {runner.max_context} tokens"
        )


class TextGenerator:
    """Generate text with full prefill: ``TextGenerator(runner).generate(ids, params)``."""

    def __init__(self, runner: ModelRunner, lookup: LookupConfig | None = None):
        """``lookup``: prompt-lookup speculative greedy decoding (``model/lookup.py``); None decodes
        one token per forward pass."""
        self.runner = runner
        self.tokenizer = runner.tokenizer
        self.eos_ids = eos_token_ids(runner.model, runner.tokenizer)
        self.lookup = lookup

    def stream(self, prompt_ids: list[int], params: SamplingParams) -> Iterator[str]:
        """Yield text deltas as tokens come; the last item's ``.result`` is set on the generator object."""
        yield from self._run(prompt_ids, params)

    def generate(self, prompt_ids: list[int], params: SamplingParams) -> GenerationResult:
        gen = self._run(prompt_ids, params)
        for _ in gen:
            pass
        return self.last_result

    def _run(self, prompt_ids: list[int], params: SamplingParams) -> Iterator[str]:
        check_context(self.runner, len(prompt_ids), params.max_new_tokens)
        start = time.perf_counter()
        kv = self.runner.new_kv(len(prompt_ids) + params.max_new_tokens)
        logits = self.runner.prefill(torch.tensor(prompt_ids), kv=kv)  # [V]
        lookup = prompt_lookup(self.lookup, prompt_ids, params.temperature == 0.0)
        yield from stream_tokens(self.runner, kv, logits, len(prompt_ids), params, self.eos_ids, start, self, lookup)


def stream_tokens(runner, kv, logits, prompt_tokens: int, params: SamplingParams, eos_ids: set[int],
                  start: float, owner, lookup: PromptLookup | None = None,
                  after_first: Callable[[], None] | None = None, switch: Switch | None = None) -> Iterator[str]:
    """Shared decode tail: yields text deltas and sets ``owner.last_result`` at the end.

    TTFT is taken when the first token is chosen (prefill done + one argmax/sample). ``lookup``
    (over the prompt ids) turns on speculative greedy decoding. ``after_first`` runs once, after
    the first token's text went out and before the first decode step (or when the stream ends
    or is closed first): work the first token need not wait for (the engine's store hand-off).
    ``switch``: ``decode_steps``'s hook (the engine's tie guard during decoding). When it raises ``Rewind``
    (a caller that shows no text before the end asked for it), the answer goes back to its first ``keep``
    tokens and decoding continues from the hook's KV; deltas yielded before are void (the result's text
    is the answer's), and TTFT is when the answer's first token was chosen, after the rewind if it was
    dropped. At most one rewind per answer (the hook switches once).
    """
    decoder = SequenceDecoder.start(runner, params, eos_ids)
    ttft = None
    logprobs: list[float] = []
    pending = [after_first] if after_first is not None else []
    position = prompt_tokens
    try:
        with torch.inference_mode():
            while True:
                try:
                    for _, delta in decode_steps(runner, kv, logits, position, decoder, logprobs, lookup, switch):
                        if ttft is None:
                            ttft = time.perf_counter() - start
                        if delta:
                            yield delta
                        while pending:
                            pending.pop()()
                    break
                except Rewind as back:  # keep the answer's first back.keep tokens and decode on from the hook's KV
                    decoder.rewind(back.keep)
                    del logprobs[back.keep:]
                    ttft = ttft if decoder.tokens else None
                    kv, logits, position = back.kv, back.logits, prompt_tokens + back.keep
                    if lookup is not None:  # its context: the prompt and the tokens kept
                        lookup.truncate(position)
    finally:
        while pending:  # no token (EOS first), or the consumer closed the stream early
            with torch.inference_mode():
                pending.pop()()
    tail = decoder.stream.flush()
    if tail:
        yield tail
    if ttft is None:
        ttft = time.perf_counter() - start
    owner.last_result = GenerationResult(
        text=decoder.stream.text, token_ids=decoder.tokens, prompt_tokens=prompt_tokens, ttft_s=ttft,
        total_s=time.perf_counter() - start, finish_reason=decoder.finish_reason, token_logprobs=logprobs,
    )
