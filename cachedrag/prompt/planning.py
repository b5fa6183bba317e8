"""The server's prompt planning: request text -> engine segments, with chunk boundaries found two ways.

Owns: ``PassageConfig`` (automatic detection, separators, tokenisation), ``PromptPlanner``,
which renders chat messages through the tokenizer's chat template (``template``), cuts the
rendered prompt into text and chunk parts (``splitter``: a cacheable leading prefix, chunks
reusable at any position, the question last) and tokenises them into the engine's segments
(``segments``; by default the rendered prompt as one text, cut at the parts: the ids any server
computes for these messages, the same for both chunk modes; ``PassageConfig.tokenization``),
and the two part rewrites it applies (``question_apart``, ``attach_separators``).

1. explicit: the request's ``"cachedrag": {"chunks": [...]}`` texts, each of which must occur
   verbatim in the prompt (else ``ChunkNotFoundError``, a 400).
2. automatic (no field): every passage of the messages (``passages.context_passages``: each
   paragraph at least ``min_chars`` long, the question excepted) is remembered in a bounded LRU
   ``ChunkRegistry``, and every passage seen before, found verbatim anywhere in a prompt, becomes
   a chunk. So an unmodified OpenAI client that puts retrieved texts in its prompt gets them
   served from the chunk cache at whatever position they come next. In an agent's steps the
   retrieved passages come in tool messages, plain or as a JSON-dumped tool result
   (``passages.tool_passages``): found there too. Explicit chunks are remembered as passages too.

Separators (``PassageConfig.attach_separators``, off by default): left as text segments of their
own, the 1-2-token separators between chunks are computed, never reused (the engine's
``CacheConfig.min_reuse_tokens``), so an all-miss request is a plain prefill that stores its exact
path. Joined to the chunk before them, they are cached and approximated with it (lower fidelity
measured: docs/notes/scheduling.md, "Separators between chunks").

Does not own: HTTP and request bodies (``cachedrag.server``), tokenisation details and keys
(``segments``, ``cachedrag.kvcache``), or the engine.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from cachedrag.errors import CachedRAGError
from cachedrag.prompt.passages import TOOL_ROLES, context_passages, last_paragraph
from cachedrag.prompt.registry import ChunkRegistry, ChunkRegistryConfig, Match, leftmost_longest, normalize
from cachedrag.prompt.segments import Segment
from cachedrag.prompt.splitter import split_prompt
from cachedrag.prompt.template import Message, RenderedPrompt, render_messages
from cachedrag.prompt.tools import ToolSpec


class PassageConfig(BaseModel):
    """How request text becomes engine segments: automatic chunk detection for clients that send
    no ``cachedrag.chunks`` field, separators, and tokenisation."""

    model_config = ConfigDict(frozen=True)

    enabled: bool = Field(True, description="split prompts into passages and find passages seen before")
    min_chars: int = Field(200, ge=36, description="shortest paragraph treated as a cacheable passage")
    capacity: int = Field(20_000, ge=1, description="distinct passages remembered (least recently seen leave first)")
    attach_separators: bool = Field(
        False, description="the whitespace after each chunk joins the chunk's segment instead of being a segment of "
                           "its own between chunks (faster cold and repeated prefills; lower fidelity measured: "
                           "docs/notes/scheduling.md)")
    tokenization: Literal["whole", "parts"] = Field(
        "whole", description="'whole': the rendered prompt is tokenised as one text (the ids any server computes "
                             "for these messages) and cut at chunk boundaries; 'parts': every chunk and text part "
                             "on its own (ids differ from the whole text's at the boundaries, and between explicit "
                             "and automatic chunks)")


class ChunkNotFoundError(CachedRAGError):
    """An explicit ``cachedrag.chunks`` text does not occur verbatim in the prompt."""


@dataclass
class PlannedPrompt:
    segments: list[Segment]
    n_chunks: int  # chunk segments (explicit or detected)
    chunk_source: str  # "explicit", "auto" or "none"
    conversation: bool = False  # ``RenderedPrompt.conversation``: a next step will extend this prompt and its answer

    @property
    def prompt_tokens(self) -> int:
        return sum(len(s) for s in self.segments)


class _ExplicitChunks:
    """The ``find`` of ``ChunkRegistry`` over one request's explicit chunk texts."""

    def __init__(self, texts: Sequence[str]):
        self.texts = [t for t in dict.fromkeys(normalize(x) for x in texts) if t]

    def find(self, prompt: str) -> list[Match]:
        found = []
        for i, text in enumerate(self.texts):
            start = prompt.find(text)
            if start < 0:
                raise ChunkNotFoundError(f"cachedrag.chunks[{i}] does not occur verbatim in the prompt: {text[:60]!r}")
            while start >= 0:
                found.append((start, text))
                start = prompt.find(text, start + len(text))
        return leftmost_longest(found)


class PromptPlanner:
    """Builds engine segments for chat and completion requests (thread-safe)."""

    def __init__(self, engine, config: PassageConfig | None = None):
        self.engine = engine
        self.config = config or PassageConfig()
        self.seen = ChunkRegistry(ChunkRegistryConfig(capacity=self.config.capacity, anchor_chars=32, stride=4))

    @property
    def tokenizer(self):
        return self.engine.runner.tokenizer

    def chat(self, messages: Sequence[Message], chunks: Sequence[str] | None = None,
             tools: Sequence[ToolSpec] | None = None) -> PlannedPrompt:
        """``messages`` (tool calls and results included) rendered with ``tools`` offered, planned."""
        rendered = render_messages(self.tokenizer, messages, tools=tools)
        contents = [m.content for m in messages]
        return self._plan(rendered, contents, chunks, [m.role for m in messages])

    def completion(self, prompt: str, chunks: Sequence[str] | None = None) -> PlannedPrompt:
        """A raw completion prompt (no chat template), as OpenAI's ``/v1/completions`` takes it."""
        return self._plan(RenderedPrompt(prompt), [prompt], chunks)

    def _plan(self, rendered: RenderedPrompt, contents: list[str], chunks: Sequence[str] | None,
              roles: Sequence[str] | None = None) -> PlannedPrompt:
        if chunks:
            finder = _ExplicitChunks(chunks)
            split = split_prompt(rendered, finder)
            self.seen.register(t for t in finder.texts if len(t) >= self.config.min_chars)
            source = "explicit"
        elif self.config.enabled:
            self.seen.register(context_passages(contents, self.config.min_chars, roles))
            split = split_prompt(rendered, self.seen)
            source = "auto"
        else:
            split = split_prompt(rendered, _ExplicitChunks(()))
            source = "none"
        parts = split.parts
        asks = not (roles and roles[-1] in TOOL_ROLES)  # a tool result last: no question to keep apart
        if source == "auto" and split.n_chunks and asks:
            parts = question_apart(parts, rendered.text, last_paragraph(contents[-1]))
        parts = attach_separators(parts) if self.config.attach_separators else parts
        segments = self.engine.prompts.text_segments(parts, tokenization=self.config.tokenization)
        return PlannedPrompt(segments, split.n_chunks, source if split.n_chunks else "none", rendered.conversation)


def question_apart(parts: Sequence[tuple[str, str]], text: str, question: str | None) -> list[tuple[str, str]]:
    """Cut the text part after the last chunk where ``question`` (the last paragraph of the last
    message) begins in ``text``, the prompt the parts concatenate to. What precedes the question
    there is the retrieved context the detected passages did not cover (the rest of the last
    chunk, template text): as its own text segment before the question, the engine keeps it with
    the chunks (stored, and part of their tree path, so a recurring context is an exact prefix
    hit up to the question) instead of computing it with the question every time."""
    parts = list(parts)
    if not question or len(parts) < 2 or parts[-1][0] != "text":
        return parts
    tail = parts[-1][1]
    start, at = len(text) - len(tail), text.rfind(question)
    if at <= start:  # the question starts the tail (or was not found): nothing before it to keep
        return parts
    return parts[:-1] + [("text", tail[:at - start]), ("text", tail[at - start:])]


def attach_separators(parts: Sequence[tuple[str, str]]) -> list[tuple[str, str]]:
    """Move the whitespace run that starts the text part after each chunk into that chunk (the
    concatenation is unchanged; a text part left empty disappears)."""
    out: list[tuple[str, str]] = []
    for kind, text in parts:
        if kind == "text" and out and out[-1][0] == "chunk":
            rest = text.lstrip()
            if len(rest) < len(text):
                out[-1] = ("chunk", out[-1][1] + text[:len(text) - len(rest)])
                text = rest
            if not text:
                continue
        out.append((kind, text))
    return out
