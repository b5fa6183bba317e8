"""Prompt text: from chat messages or a formatted prompt to the engine's segments.

One place for everything between request text and token ids:

    messages   ``Message``: one chat message (role, text, tool calls or a tool result's call id)
    template   chat messages -> one prompt string (the tokenizer's chat template), where the last
               message's content starts, and the template around an empty user message
    segments   ``Segment`` and ``PromptBuilder``: tokenisation into keyed text/chunk segments, the
               engine's own chat layout (system / chunks / question)
    registry   the passage registry: a bounded LRU of chunk texts found verbatim in any prompt,
               and the process-wide one the framework classes share (``register_chunks``)
    tools      tool calling's nouns: ``ToolSpec``, ``ToolCall``, ``ToolChoice``
    toolformat the template's tool-call syntax (Hermes, Llama-3, Mistral, the generic envelope)
               and tools / calls / results rendered in it
    toolparse  incremental parsers of a model's tool calls (name first, then argument deltas)
    toolgrammar the llguidance grammar of a tool-calling answer per tool_choice
    passages   content-defined passages (paragraphs) of request text, the question excepted
    splitter   prompt string -> ordered text/chunk parts around the registered chunks
    planning   the server's request -> segments plan: explicit ``cachedrag.chunks`` or
               automatically detected passages (``PromptPlanner``, ``PassageConfig``)

Used by the engine, the server, the cluster router and the framework integrations alike; it
depends on none of them. Does not own: which chunks to reuse or cache keys
(``cachedrag.kvcache``), HTTP and request bodies (``cachedrag.server``), framework message types
(``cachedrag.integrations``), or tensors. Pure Python apart from the tokenizer it is handed.
Names import lazily, like the other subpackages.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "Message": "messages",
    "RenderedPrompt": "template",
    "render_messages": "template",
    "render_completion": "template",
    "template_split": "template",
    "ToolSpec": "tools",
    "ToolCall": "tools",
    "ToolChoice": "tools",
    "ToolFormat": "toolformat",
    "detect_format": "toolformat",
    "parser_for": "toolparse",
    "parse_tool_calls": "toolparse",
    "tool_grammar": "toolgrammar",
    "Segment": "segments",
    "PromptBuilder": "segments",
    "chunk_part": "segments",
    "running_ids": "segments",
    "CHUNK_SEPARATOR": "segments",
    "QUESTION_PREFIX": "segments",
    "ChunkRegistry": "registry",
    "ChunkRegistryConfig": "registry",
    "Match": "registry",
    "chunk_registry": "registry",
    "register_chunks": "registry",
    "paragraphs": "passages",
    "context_passages": "passages",
    "SplitPrompt": "splitter",
    "split_prompt": "splitter",
    "PassageConfig": "planning",
    "PromptPlanner": "planning",
    "PlannedPrompt": "planning",
    "ChunkNotFoundError": "planning",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'cachedrag.prompt' has no attribute {name!r}")
    return getattr(importlib.import_module(f"cachedrag.prompt.{_EXPORTS[name]}"), name)
