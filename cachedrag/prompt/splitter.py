"""Chunk-aware prompt splitting: one formatted string -> ordered text/chunk parts.

Owns: ``split_prompt``. Frameworks hand the LLM one string, whatever their prompt template
wrapped around the retrieved texts. The registered chunk texts are found verbatim inside it
(``ChunkRegistry.find``) and become ``"chunk"`` parts, cacheable by identity at any position;
everything else (template markup, separators, the question, unregistered text) becomes
``"text"`` parts, which the engine computes (the leading text is its cacheable prefix). No
separator strings are inserted or expected.

Layout rules, so the result is always a valid engine request:
- the last part must be text (the question); a prompt that ends with a chunk has that chunk
  demoted to text;
- when no chunk precedes the start of the last message's content (``RenderedPrompt.prefix_end``),
  the leading text is cut there, so the system prompt and earlier turns form an exact,
  reusable prefix even when the last message's own preamble varies.

The parts are tokenised as one text cut at their boundaries (``TOKENIZATION``, passed to
``PromptBuilder.text_segments`` by the generator and by speculative pipelining alike), so a
prompt has the ids a plain LLM class computes for the same string, and full prefill of it answers
as that LLM does.

Does not own: rendering messages (``template``), finding the chunks (``registry``),
tokenisation (``segments``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from cachedrag.prompt.registry import ChunkRegistry
from cachedrag.prompt.template import RenderedPrompt

Kind = Literal["text", "chunk"]
TOKENIZATION = "whole"  # PromptBuilder.text_segments(parts, tokenization=...) of every split prompt


@dataclass(frozen=True)
class SplitPrompt:
    parts: list[tuple[Kind, str]]
    n_chunks: int  # registered chunks used as cache segments
    chunk_chars: int  # characters of the prompt inside them

    @property
    def text(self) -> str:
        return "".join(t for _, t in self.parts)


def split_prompt(prompt: RenderedPrompt | str, registry: ChunkRegistry) -> SplitPrompt:
    """Cut ``prompt`` around the registered chunks it contains (see the module docstring).

    The concatenation of the parts is always exactly the prompt text.
    """
    rendered = prompt if isinstance(prompt, RenderedPrompt) else RenderedPrompt(prompt)
    text = rendered.text
    parts: list[tuple[Kind, str]] = []
    pos = 0
    for m in registry.find(text):
        if m.start > pos:
            parts.append(("text", text[pos:m.start]))
        parts.append(("chunk", m.text))
        pos = m.end
    if pos < len(text):
        parts.append(("text", text[pos:]))
    parts = _end_with_text(parts)
    parts = _cut_prefix(parts, rendered.prefix_end)
    chunks = [t for kind, t in parts if kind == "chunk"]
    assert "".join(t for _, t in parts) == text, "split must preserve the prompt"
    return SplitPrompt(parts, len(chunks), sum(len(c) for c in chunks))


def _end_with_text(parts: list[tuple[Kind, str]]) -> list[tuple[Kind, str]]:
    if not parts or parts[-1][0] == "text":
        return parts
    demoted = parts.pop()[1]
    if parts and parts[-1][0] == "text":
        demoted = parts.pop()[1] + demoted
    parts.append(("text", demoted))
    return parts


def _cut_prefix(parts: list[tuple[Kind, str]], prefix_end: int | None) -> list[tuple[Kind, str]]:
    """Split the text part holding ``prefix_end`` in two, unless a chunk comes before it."""
    if prefix_end is None:
        return parts
    start = 0
    for i, (kind, t) in enumerate(parts):
        end = start + len(t)
        if kind == "chunk":
            if start < prefix_end:
                return parts  # chunks in earlier turns: they already anchor the cache
        elif start < prefix_end < end:
            cut = prefix_end - start
            return parts[:i] + [("text", t[:cut]), ("text", t[cut:])] + parts[i + 1:]
        if end >= prefix_end:
            return parts
        start = end
    return parts
