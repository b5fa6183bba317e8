"""The generation seam of the pipelines: one request type, two generators.

Owns: ``GenerationRequest`` (system prompt, retrieved chunks, user text, an optional start of
the assistant's answer, limits) and ``Generation`` (text, token ids, the real log probability
of every generated token, prompt/computed tokens, chunk-cache stats), the prompt layout both
generators share (``[system prefix] [chunk 1 + sep] ... [user text + template tail + answer
start]`` through the tokenizer's chat template), and:

- ``EngineGenerator``: the ``CachedEngine`` (chunk-cache reuse; ``mode="full"`` = none);
- ``TransformersGenerator``: **the plain baseline** — the same model through Hugging Face
  ``model.generate`` (greedy, full prefill, its own KV cache, nothing reused), prompt token
  ids from the tokenizer's chat template over the whole prompt text.

Both stop on EOS, on ``max_new_tokens`` or when the generated text contains a stop string
(the text is cut before it; the token ids keep the token that completed it). Pipelines take
any object with ``generate(GenerationRequest) -> Generation`` (tests inject fakes). Does not
own: prompt wording (``prompts``) or chunk-cache policy (the engine's).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol, runtime_checkable

from cachedrag.errors import ConfigError
from cachedrag.model.generation import stop_index
from cachedrag.pipelining import engine_load
# chunk segments must match other engine users' (same cache keys)
from cachedrag.prompt import chunk_part, running_ids, template_split


@dataclass(frozen=True)
class GenerationRequest:
    """One LLM call of a pipeline step."""

    user: str
    system: str | None = None
    chunks: tuple[str, ...] = ()
    assistant_prefix: str = ""  # the answer so far (FLARE continues it)
    max_new_tokens: int = 48
    stop: tuple[str, ...] = ()
    temperature: float = 0.0
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        object.__setattr__(self, "chunks", tuple(c for c in self.chunks if c and c.strip()))


@dataclass
class Generation:
    """What one LLM call produced."""

    text: str
    token_ids: list[int]
    token_logprobs: list[float]  # log p of each generated token under the model
    finish_reason: str  # "stop" (EOS or a stop string) or "length"
    prompt_tokens: int
    computed_tokens: int  # prompt tokens computed at full depth (== prompt_tokens without reuse)
    seconds: float
    ttft_s: float | None = None
    cache: dict = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


@runtime_checkable
class Generator(Protocol):
    tokenizer: object

    def generate(self, request: GenerationRequest) -> Generation: ...


def layout(before: str, chunks: Sequence[str], user: str, after: str, assistant_prefix: str = "") -> list[tuple[str, str]]:
    """Ordered (kind, text) parts of a prompt: the engine's chat layout (``PromptBuilder.chat``)."""
    parts: list[tuple[str, str]] = [("text", before)] if before else []
    parts += [("chunk", chunk_part(c)) for c in chunks]
    parts.append(("text", user + after + assistant_prefix))
    return parts


class EngineGenerator:
    """Generate with a ``CachedEngine`` (chunk KV reuse per its mode; ``mode`` overrides it).

    >>> gen = EngineGenerator(CachedEngine())                                  # doctest: +SKIP
    >>> gen.generate(GenerationRequest(user="Question: why?", chunks=("...",)))  # doctest: +SKIP
    """

    def __init__(self, engine, mode: str | None = None):
        self.engine = engine
        self.mode = mode
        self.tokenizer = engine.runner.tokenizer

    def generate(self, request: GenerationRequest) -> Generation:
        from cachedrag.model.generation import SamplingParams

        start = time.perf_counter()
        prompts = self.engine.prompts
        before, after = prompts.template_split(request.system)
        segments = prompts.text_segments(layout(before, request.chunks, request.user, after, request.assistant_prefix))
        params = SamplingParams(max_new_tokens=request.max_new_tokens, temperature=request.temperature,
                                stop=request.stop, seed=request.seed)
        with engine_load(self.engine).request():  # speculative pipelining reads the engine's load
            r = self.engine.generate_segments(segments, params, mode=self.mode, start=start)
        cache = {"mode": r.mode, "chunks_hit": r.chunks_hit, "chunks_missed": r.chunks_missed,
                 "prefix_hit_tokens": r.prefix_hit_tokens, "recomputed_tokens": r.recomputed_tokens,
                 "cached_tokens": r.cached_tokens, "checked_tokens": r.checked_tokens,
                 "computed_fraction": r.computed_fraction, "prefill_s": r.prefill_s, "load_s": r.load_s,
                 "draft_tokens": r.draft_tokens, "draft_accepted": r.draft_accepted}
        return Generation(text=r.text, token_ids=list(r.token_ids), token_logprobs=list(r.token_logprobs),
                          finish_reason=r.finish_reason, prompt_tokens=r.prompt_tokens,
                          computed_tokens=r.computed_tokens, seconds=time.perf_counter() - start, ttft_s=r.ttft_s,
                          cache=cache, notes=list(r.notes))


    def chunk_layout(self, system: str | None):
        """``(layout, tail)`` for speculative pipelining: ``layout(chunks)`` is this generator's
        segments of a request with ``system`` over ``chunks`` (up to the last chunk, the rest
        empty), ``tail`` the chat template's text after the user message."""
        prompts = self.engine.prompts
        before, after = prompts.template_split(system)
        return (lambda chunks: prompts.text_segments(layout(before, chunks, "", after))), (after or "\n")


class TransformersGenerator:
    """BASELINE: plain Hugging Face generation with the same model (no cachedrag code on the path).

    ``model.generate`` greedy (or sampled with ``temperature > 0``) over token ids from
    ``tokenizer.apply_chat_template`` of the whole prompt (``tokenization="chat_template"``,
    the default). ``tokenization="segments"`` instead tokenises the engine's segments one by
    one (the exact token ids ``CachedEngine`` sees), to separate tokenisation effects from
    reuse effects in comparisons; for a byte-level BPE the two are the same ids since the
    engine's layout cuts only where the whole text is cut too (``cachedrag.prompt.running_ids``).
    Log probabilities come from the raw logits of each step.
    """

    def __init__(self, runner=None, *, model=None, tokenizer=None,
                 tokenization: Literal["chat_template", "segments"] = "chat_template"):
        if runner is not None:
            model, tokenizer = runner.model, runner.tokenizer
        if model is None or tokenizer is None:
            raise ConfigError("TransformersGenerator needs a runner or a model and its tokenizer")
        if tokenization not in ("chat_template", "segments"):
            raise ConfigError(f"unknown tokenization {tokenization!r}; use 'chat_template' or 'segments'")
        from cachedrag.model.generation import eos_token_ids

        self.model = model
        self.tokenizer = tokenizer
        self.tokenization = tokenization
        self.eos_ids = sorted(eos_token_ids(model, tokenizer))
        self.max_context = int(getattr(model.config, "max_position_embeddings", 2048))
        self._split: dict[str | None, tuple[str, str]] = {}

    def prompt_ids(self, request: GenerationRequest) -> list[int]:
        """Token ids of the request's prompt."""
        before, after = self._template_split(request.system)
        parts = layout(before, request.chunks, request.user, after, request.assistant_prefix)
        if self.tokenization == "segments":
            return [t for _, text in parts for t in running_ids(self.tokenizer, text)]
        return [int(t) for t in self.tokenizer.encode("".join(text for _, text in parts), add_special_tokens=False)]

    def generate(self, request: GenerationRequest) -> Generation:
        import torch
        from transformers import GenerationConfig, LogitsProcessorList, StoppingCriteriaList

        from cachedrag.errors import ContextWindowError

        start = time.perf_counter()
        ids = self.prompt_ids(request)
        if len(ids) + request.max_new_tokens > self.max_context:
            raise ContextWindowError(f"prompt of {len(ids)} tokens + {request.max_new_tokens} new tokens exceeds "
                                     f"the model's context window of {self.max_context} tokens")
        sampling = request.temperature > 0
        config = GenerationConfig(max_new_tokens=request.max_new_tokens, do_sample=sampling,
                                  eos_token_id=self.eos_ids, pad_token_id=self.eos_ids[0],
                                  return_dict_in_generate=True, output_logits=True,
                                  **({"temperature": request.temperature} if sampling else {}))
        stopping = StoppingCriteriaList([_stop_on_text(self.tokenizer, request.stop, len(ids))]) if request.stop else None
        timer = _first_token_timer()
        if sampling and request.seed is not None:
            torch.manual_seed(request.seed)
        device = next(self.model.parameters()).device
        input_ids = torch.tensor([ids], device=device)  # [1, T]
        with torch.inference_mode():
            out = self.model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                                      generation_config=config, stopping_criteria=stopping,
                                      logits_processor=LogitsProcessorList([timer]))
        new = out.sequences[0, len(ids):].tolist()
        eos_hit = False
        for i, token in enumerate(new):
            if token in self.eos_ids:
                new, eos_hit = new[:i], True
                break
        logprobs = [float(torch.log_softmax(out.logits[i][0].float(), dim=-1)[t]) for i, t in enumerate(new)]
        text = self.tokenizer.decode(new, skip_special_tokens=True)
        cut = stop_index(text, request.stop)
        if cut is not None:
            text = text[:cut]
        finish = "stop" if (eos_hit or cut is not None) else "length"
        return Generation(text=text, token_ids=new, token_logprobs=logprobs, finish_reason=finish,
                          prompt_tokens=len(ids), computed_tokens=len(ids), seconds=time.perf_counter() - start,
                          ttft_s=(timer.at - start) if timer.at is not None else None, cache={"mode": "transformers"})

    def _template_split(self, system: str | None) -> tuple[str, str]:
        if system not in self._split:
            self._split[system] = template_split(self.tokenizer, system)
        return self._split[system]


def _first_token_timer():
    """A pass-through transformers ``LogitsProcessor`` that notes when the prefill's logits
    arrive (its first call): the baseline's time to first token."""
    from transformers import LogitsProcessor

    class FirstTokenTimer(LogitsProcessor):
        at: float | None = None

        def __call__(self, input_ids, scores):  # scores [B, V], returned unchanged
            if self.at is None:
                self.at = time.perf_counter()
            return scores

    return FirstTokenTimer()


def _stop_on_text(tokenizer, stop: Sequence[str], prompt_len: int):
    """A transformers ``StoppingCriteria``: the generated text contains a stop string."""
    import torch
    from transformers import StoppingCriteria

    class StopOnText(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):  # input_ids [B, T]
            text = tokenizer.decode(input_ids[0, prompt_len:].tolist(), skip_special_tokens=True)
            done = stop_index(text, stop) is not None
            return torch.full((input_ids.shape[0],), done, dtype=torch.bool, device=input_ids.device)

    return StopOnText()


def as_generator(obj, mode: str | None = None) -> Generator:
    """A ``CachedEngine`` -> ``EngineGenerator``; a generator is returned as is."""
    from cachedrag.engine import CachedEngine

    if isinstance(obj, CachedEngine):
        return EngineGenerator(obj, mode=mode)
    if callable(getattr(obj, "generate", None)) and hasattr(obj, "tokenizer"):
        return obj
    raise ConfigError(f"expected a CachedEngine or a generator with generate(GenerationRequest), got {type(obj).__name__}")
