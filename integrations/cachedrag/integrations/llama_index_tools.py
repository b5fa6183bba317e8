"""LlamaIndex's tool-calling types to and from cachedrag's (``CachedRAGLLM`` as a ``FunctionCallingLLM``).

Owns: LlamaIndex ``ChatMessage``s to ``cachedrag.prompt`` messages (text blocks; an assistant's
``ToolCallBlock``s, or OpenAI-style ``additional_kwargs["tool_calls"]``, as its calls; a tool
message's ``tool_call_id`` from its ``additional_kwargs``), ``prepare_chat_with_tools`` (the
``chat`` keyword arguments of ``chat_with_tools``: messages, OpenAI-format tools, ``tool_choice``
from ``tool_required`` / an explicit choice, ``parallel_tool_calls``), ``ToolCallTracker`` (the
assistant message of an answer as it streams: text plus one ``ToolCallBlock`` per call, whose
arguments are the JSON text so far) and ``tool_selections`` (``get_tool_calls_from_response``:
partial JSON arguments are closed, not refused).

Does not own: the LLM class (``llama_index``), the grammar and parsers (``cachedrag.prompt``).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from llama_index.core.base.llms.types import ChatMessage, ChatResponse, MessageRole, TextBlock, ToolCallBlock
from llama_index.core.llms.llm import ToolSelection

from cachedrag.prompt.template import Message
from cachedrag.prompt.toolparse import ArgumentsDelta, CallEnded, CallStarted, TextDelta, close_partial_json
from cachedrag.prompt.tools import ToolCall


def to_messages(messages: Sequence[ChatMessage]) -> list[Message]:
    """cachedrag messages of a LlamaIndex history (text only, besides tool calls)."""
    out = []
    for m in messages:
        other = sorted({type(b).__name__ for b in m.blocks if not isinstance(b, (TextBlock, ToolCallBlock))})
        if other:
            raise ValueError(f"CachedRAGLLM handles text only; the message has {', '.join(other)}")
        text = "".join(b.text for b in m.blocks if isinstance(b, TextBlock))
        calls = tuple(_call(b.tool_name, b.tool_kwargs, b.tool_call_id) for b in m.blocks
                      if isinstance(b, ToolCallBlock))
        if not calls and m.additional_kwargs.get("tool_calls"):
            calls = tuple(_openai_call(c) for c in m.additional_kwargs["tool_calls"])
        role = m.role.value
        if role == "tool":
            out.append(Message("tool", text, tool_call_id=m.additional_kwargs.get("tool_call_id"),
                               name=m.additional_kwargs.get("name")))
        else:
            out.append(Message(role, text, tool_calls=calls))
    return out


def _call(name: str, kwargs: Any, call_id: str | None) -> ToolCall:
    return ToolCall.of(name, kwargs if isinstance(kwargs, (dict, str)) else {}, call_id)


def _openai_call(call: Any) -> ToolCall:
    if not isinstance(call, dict):  # an SDK object (openai's ChatCompletionMessageToolCall)
        call = call.model_dump() if hasattr(call, "model_dump") else dict(call)
    return ToolCall.from_openai(call)


def prepare_chat_with_tools(tools: Sequence[Any], user_msg: str | ChatMessage | None = None,
                            chat_history: Sequence[ChatMessage] | None = None,
                            allow_parallel_tool_calls: bool = False, tool_required: bool = False,
                            tool_choice: Any = None, **kwargs: Any) -> dict[str, Any]:
    """The ``chat`` keyword arguments for ``chat_with_tools`` and its variants."""
    messages = list(chat_history or [])
    if user_msg is not None:
        messages.append(ChatMessage(role=MessageRole.USER, content=user_msg) if isinstance(user_msg, str)
                        else user_msg)
    specs = [t.metadata.to_openai_tool() for t in tools]
    if tool_choice is None:
        tool_choice = "required" if tool_required else "auto"
    kwargs.pop("verbose", None)
    return {"messages": messages, "tools": specs or None, "tool_choice": tool_choice if specs else None,
            "parallel_tool_calls": allow_parallel_tool_calls, **kwargs}


class ToolCallTracker:
    """The assistant message of a tool-calling answer as parser events come in."""

    def __init__(self) -> None:
        self.text = ""
        self._calls: list[dict[str, Any]] = []  # per call: id, name, args text so far, done

    def add(self, events) -> str:
        """Take ``events``; returns the text delta among them."""
        delta = ""
        for e in events:
            if isinstance(e, TextDelta):
                delta += e.text
            elif isinstance(e, CallStarted):
                self._calls.append({"id": e.id, "name": e.name, "args": "", "done": None})
            elif isinstance(e, ArgumentsDelta):
                self._calls[e.index]["args"] += e.text
            elif isinstance(e, CallEnded):
                self._calls[e.index]["done"] = e.call.arguments
        self.text += delta
        return delta

    def message(self) -> ChatMessage:
        blocks: list[Any] = [TextBlock(text=self.text)] if self.text else []
        for c in self._calls:
            args = c["done"] if c["done"] is not None else c["args"]
            blocks.append(ToolCallBlock(tool_call_id=c["id"], tool_name=c["name"], tool_kwargs=_kwargs(args)))
        return ChatMessage(role=MessageRole.ASSISTANT, blocks=blocks)


def _kwargs(args: str) -> dict[str, Any] | str:
    try:
        value = json.loads(args) if args else {}
    except json.JSONDecodeError:
        return args  # partial JSON while streaming: kept as text, closed when read
    return value if isinstance(value, dict) else {}


def tool_selections(response: ChatResponse, error_on_no_tool_call: bool = True) -> list[ToolSelection]:
    """The calls in ``response``'s message (``ToolCallBlock``s; partial JSON arguments closed)."""
    out = []
    for block in response.message.blocks:
        if not isinstance(block, ToolCallBlock):
            continue
        kwargs = block.tool_kwargs
        if isinstance(kwargs, str):
            kwargs = json.loads(close_partial_json(kwargs)) if kwargs.strip() else {}
        out.append(ToolSelection(tool_id=block.tool_call_id or "", tool_name=block.tool_name,
                                 tool_kwargs=kwargs if isinstance(kwargs, dict) else {}))
    if not out and error_on_no_tool_call:
        raise ValueError(f"expected at least one tool call, got none: {response.message.content!r}")
    return out
