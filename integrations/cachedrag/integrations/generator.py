"""Chunk-aware generation shared by the LlamaIndex and LangChain classes.

Owns: ``ChunkAwareGenerator``: a formatted prompt (rendered chat messages or a completion
prompt) -> registered chunks found in it -> engine segments -> ``engine.generate_segments``,
blocking or streaming, with an optional wall-clock timeout; and ``Answer``, the text plus the
engine's per-request stats and token usage in the shape both frameworks report. TTFT in the
stats counts from the start of prompt preparation (template, split, tokenisation included).

``ToolRequest``: the tools and ``tool_choice`` of one call, the grammar constraint and the
incremental parser (``cachedrag.prompt.toolparse``) for its answer, in the template's format.

Does not own: framework types (``llama_index``/``langchain`` modules), template rendering
and splitting (``cachedrag.prompt``: ``template``, ``splitter``), the engine.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from cachedrag.integrations.speculation import remember_shape
from cachedrag.model.generation import SamplingParams
from cachedrag.pipelining import engine_load
from cachedrag.prompt.registry import ChunkRegistry, chunk_registry
from cachedrag.prompt.splitter import TOKENIZATION, SplitPrompt, split_prompt
from cachedrag.prompt.template import (
    Message,
    RenderedPrompt,
    has_chat_template,
    render_completion,
    render_messages,
)
from cachedrag.prompt.tools import ToolChoice, ToolSpec, as_tool_specs


@dataclass
class Answer:
    """Generated text with what it cost and what the cache served."""

    text: str
    result: object  # cachedrag.engine.EngineResult
    split: SplitPrompt
    notes: list[str] = field(default_factory=list)
    layout: list[tuple[str, int]] = field(default_factory=list)  # (kind, n_tokens) of each engine segment
    tokenizer: object = None  # to show generated tokens (logprobs)

    @property
    def finish_reason(self) -> str:
        return self.result.finish_reason

    def decode_token(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id]) if self.tokenizer is not None else str(token_id)

    @property
    def input_tokens(self) -> int:
        return int(self.result.prompt_tokens)

    @property
    def output_tokens(self) -> int:
        return len(self.result.token_ids)

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens served from the cache: not recomputed at full depth for this request
        (tokens the deviation check probed at the lower layers only count here too)."""
        return int(self.result.cached_tokens)

    @property
    def checked_tokens(self) -> int:
        """Cached prompt tokens that were computed at the lower layers only (the deviation check)."""
        return int(self.result.checked_tokens)

    def chunk_outcomes(self) -> list[str]:
        """``"tree"``, ``"reuse"`` or ``"fresh"`` for each registered chunk, in prompt order.

        The engine's ``chunks_hit``/``chunks_missed`` count every segment from the first chunk
        to the last (template text between chunks included); this narrows them to the
        registered chunks. Tree hits are the leading segments covering ``prefix_hit_tokens``
        (the knowledge tree serves exact prefixes); after them a middle segment was reused iff
        it has a CFO (``chunk_cfo``).
        """
        r = self.result
        first = next((i for i, (kind, _) in enumerate(self.layout) if kind == "chunk"), None)
        if first is None:
            return []
        last = max(i for i, (kind, _) in enumerate(self.layout) if kind == "chunk")
        covered, tree = 0, 0
        for _, n in self.layout[:last + 1]:
            if covered + n > r.prefix_hit_tokens:
                break
            covered += n
            tree += 1
        out = []
        for j, i in enumerate(range(first, last + 1)):
            if self.layout[i][0] != "chunk":
                continue
            cfo = r.chunk_cfo[j] if j < len(r.chunk_cfo) else None
            out.append("tree" if i < tree else ("reuse" if cfo is not None else "fresh"))
        return out

    def stats(self) -> dict:
        """Engine stats (``EngineResult.stats``) plus the split: ``registered_chunks``, ``chunk_chars``,
        ``registered_chunks_cached`` (from the tree or reused variants) and ``registered_chunks_computed``."""
        out = self.result.stats()
        outcomes = self.chunk_outcomes()
        out["registered_chunks"] = self.split.n_chunks
        out["registered_chunks_cached"] = sum(o != "fresh" for o in outcomes)
        out["registered_chunks_computed"] = sum(o == "fresh" for o in outcomes)
        out["chunk_chars"] = self.split.chunk_chars
        out["notes"] = list(out.get("notes", [])) + self.notes
        return out


class AnswerStream:
    """Iterator of text deltas; ``answer`` is set once it is exhausted."""

    def __init__(self, generation, split: SplitPrompt, notes: list[str], deadline: float | None, timeout: float | None,
                 layout: list[tuple[str, int]]):
        self._generation = generation
        self._layout = layout
        self._deltas = iter(generation)
        self._split = split
        self._notes = notes
        self._deadline = deadline
        self._timeout = timeout
        self.answer: Answer | None = None
        self.tokenizer = None

    def __iter__(self) -> Iterator[str]:
        for delta in self._deltas:
            if self._deadline is not None and time.perf_counter() > self._deadline:
                self.close()
                raise TimeoutError(f"generation exceeded its timeout of {self._timeout} s")
            yield delta
        result = self._generation.result
        self.answer = Answer(result.text, result, self._split, self._notes, self._layout, self.tokenizer)

    def close(self) -> None:
        close = getattr(self._deltas, "close", None)
        if close is not None:
            close()


class ChunkAwareGenerator:
    """Generate from framework prompts with chunk reuse.

    >>> gen = ChunkAwareGenerator(shared_engine())                             # doctest: +SKIP
    >>> gen.generate(gen.render_messages([Message("user", prompt)]), SamplingParams())  # doctest: +SKIP
    """

    def __init__(self, engine, registry: ChunkRegistry | None = None):
        self.engine = engine
        self.registry = chunk_registry() if registry is None else registry

    @property
    def tokenizer(self):
        return self.engine.runner.tokenizer

    @property
    def is_chat_model(self) -> bool:
        return has_chat_template(self.tokenizer)

    # ------------------------------------------------------------------ prompts
    def render_messages(self, messages: Sequence[Message], tools: Sequence[ToolSpec] | None = None) -> RenderedPrompt:
        return render_messages(self.tokenizer, messages, tools=tools)

    def render_completion(self, prompt: str, system_prompt: str | None = None,
                          formatted: bool = False) -> RenderedPrompt:
        """``formatted=True``: ``prompt`` already carries the model's template and is used as is."""
        if formatted:
            return RenderedPrompt(prompt)
        return render_completion(self.tokenizer, prompt, system_prompt)

    # ------------------------------------------------------------------ generation
    def generate(self, prompt: RenderedPrompt, params: SamplingParams, *, mode: str | None = None,
                 timeout: float | None = None) -> Answer:
        stream = self.stream(prompt, params, mode=mode, timeout=timeout)
        for _ in stream:
            pass
        return stream.answer

    def stream(self, prompt: RenderedPrompt, params: SamplingParams, *, mode: str | None = None,
               timeout: float | None = None) -> AnswerStream:
        start = time.perf_counter()
        split = split_prompt(prompt, self.registry)
        remember_shape(self.registry, split, self.engine, mode)  # retrievers' speculative pipelining
        segments = self.engine.prompts.text_segments(split.parts, tokenization=TOKENIZATION)
        generation = _Counted(self.engine.generate_segments(segments, params, mode=mode, stream=True, start=start,
                                                            conversation=prompt.conversation),
                              engine_load(self.engine))
        deadline = start + timeout if timeout else None
        layout = [(seg.kind, len(seg)) for seg in segments]
        stream = AnswerStream(generation, split, list(prompt.notes), deadline, timeout, layout)
        stream.tokenizer = self.tokenizer
        return stream


class _Counted:
    """A ``GenerationStream`` counted in its engine's load while it runs (speculation reads the load)."""

    def __init__(self, generation, load):
        self._generation = generation
        self._load = load

    def __iter__(self):
        with self._load.request():
            yield from self._generation

    @property
    def result(self):
        return self._generation.result


@dataclass(frozen=True)
class ToolRequest:
    """The tools offered in one call and the ``tool_choice`` (``ToolChoice``) for its answer."""

    tools: tuple[ToolSpec, ...]
    choice: ToolChoice

    @classmethod
    def of(cls, tools, tool_choice=None, parallel_tool_calls: bool | None = None) -> "ToolRequest | None":
        """From OpenAI-format dicts (or ``ToolSpec``s) and any framework's ``tool_choice``; None without
        tools. Of several tools with one name the first is kept."""
        specs = as_tool_specs(tools, unique=False)
        if not specs:
            if tool_choice not in (None, "none", "auto"):
                raise ValueError("tool_choice needs tools")
            return None
        return cls(tuple(specs), ToolChoice.parse(tool_choice, parallel_tool_calls, [t.name for t in specs]))

    def format(self, engine):
        from cachedrag.prompt.toolformat import detect_format

        return detect_format(engine.runner.tokenizer)

    def constraint(self, engine):
        """The grammar constraint of the answer (None under ``tool_choice="none"``)."""
        from cachedrag.model.constraint import tool_constraint
        from cachedrag.model.generation import eos_token_ids

        runner = engine.runner
        return tool_constraint(runner.tokenizer, eos_token_ids(runner.model, runner.tokenizer), self.tools,
                               self.choice, self.format(engine))

    def parser(self, engine):
        """A fresh incremental parser of the answer (None under ``none``: the answer is text)."""
        from cachedrag.prompt.toolparse import parser_for

        return None if self.choice.mode == "none" else parser_for(self.format(engine))


def sampling_params(max_new_tokens: int, temperature: float = 0.0, top_p: float = 1.0,
                    stop: Sequence[str] | str | None = None, seed: int | None = None, top_k: int = 0,
                    repetition_penalty: float = 1.0, constraint=None) -> SamplingParams:
    return SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                          stop=tuple(stop) if isinstance(stop, (list, tuple)) else stop, seed=seed, top_k=top_k,
                          repetition_penalty=repetition_penalty, constraint=constraint)


def json_constraint(response_format: dict, engine):
    """A ``JsonConstraint`` for an OpenAI-style ``response_format`` (``{"type": "json_schema",
    "schema": {...}}`` or ``{"type": "json_mode"|"json_object"}``) on ``engine``'s tokenizer."""
    from cachedrag.errors import ConfigError
    from cachedrag.model.constraint import JsonConstraint
    from cachedrag.model.generation import eos_token_ids

    kind = response_format.get("type")
    if kind not in ("json_schema", "json_mode", "json_object"):
        raise ConfigError(f"response_format type {kind!r} is not supported; use json_schema or json_object")
    schema = response_format.get("schema") if kind == "json_schema" else None
    if isinstance(schema, dict) and "schema" in schema and "name" in schema:  # OpenAI's {"name", "schema"} wrapper
        schema = schema["schema"]
    runner = engine.runner
    return JsonConstraint(schema, runner.tokenizer, eos_token_ids(runner.model, runner.tokenizer))
