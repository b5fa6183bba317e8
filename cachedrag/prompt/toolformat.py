"""Which tool-call syntax a chat template speaks, and tools rendered into a prompt in it.

Owns: ``ToolFormat`` (a syntax: the text or special token that opens a call, the JSON keys of
a call's name and arguments, how several calls are laid out, and whether the template itself
renders ``tools=``), the four formats

    hermes    ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (Hermes, Qwen2/2.5/3)
    llama3    ``{"name": ..., "parameters": {...}}``, after ``<|python_tag|>`` when the
              tokenizer has it, else bare (Llama 3.1/3.2/3.3 JSON tool calling)
    mistral   ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]``
    envelope  ``{"tool_calls": [{"name": ..., "arguments": {...}}, ...]}``: the generic JSON
              envelope for templates that render no tools (SmolLM2, the default model), as
              llama.cpp does for them

``detect_format(tokenizer)`` (from the template text, and a probe render: a template whose
output never shows a tool's name renders no tools and gets the envelope) and
``prepare_tool_messages``, the messages and ``tools=`` that ``template.render_messages`` hands
the template: native formats get the tools and calls as the template expects them (arguments as
dicts); the envelope gets a system section listing the tools (JSON) and asking for the envelope,
and calls / results written as text in the assistant / tool turns. Tool results keep their
content verbatim (passage detection finds retrieved passages in them).

Does not own: the message model (``template``), parsing output (``toolparse``), grammars
(``toolgrammar``). Pure Python apart from the tokenizer it is handed.
"""

from __future__ import annotations

import json
import weakref
from collections.abc import Sequence
from dataclasses import dataclass

from cachedrag.prompt.messages import Message
from cachedrag.prompt.tools import ToolCall, ToolSpec

_PROBE_TOOL = "cachedrag_probe_tool_9f2c"


@dataclass(frozen=True)
class ToolFormat:
    """A tool-call syntax. ``trigger``: the text that opens the calls (``trigger_token``: when it
    is one special token of the tokenizer); ``args_key``: the arguments' key in a call object;
    ``layout``: ``tagged`` (each call wrapped in ``trigger`` ... ``closer``), ``single`` (one
    object per call, several separated by ``separator``), ``array`` (a JSON array of call
    objects) or ``envelope`` (the array under ``"tool_calls"``); ``native``: the template renders
    ``tools=`` itself."""

    name: str
    trigger: str
    args_key: str = "arguments"
    layout: str = "tagged"
    closer: str = ""
    separator: str = "\n"
    trigger_token: bool = False
    native: bool = True


HERMES = ToolFormat("hermes", "<tool_call>", closer="</tool_call>")
LLAMA3_TAGGED = ToolFormat("llama3", "<|python_tag|>", args_key="parameters", layout="single", separator="; ",
                           trigger_token=True)
LLAMA3_BARE = ToolFormat("llama3", "", args_key="parameters", layout="single", separator="; ")
MISTRAL = ToolFormat("mistral", "[TOOL_CALLS]", layout="array")
MISTRAL_TOKEN = ToolFormat("mistral", "[TOOL_CALLS]", layout="array", trigger_token=True)
ENVELOPE = ToolFormat("envelope", '{"tool_calls":', layout="envelope", native=False)

_cache: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _special_token(tokenizer, text: str) -> bool:
    vocab = getattr(tokenizer, "get_vocab", lambda: {})()
    return text in vocab and text in set(getattr(tokenizer, "all_special_tokens", ()) or ()) | set(
        getattr(tokenizer, "added_tokens_encoder", {}) or {})


def renders_tools(tokenizer) -> bool:
    """Whether the chat template shows ``tools=`` in its output (a probe render)."""
    if not getattr(tokenizer, "chat_template", None):
        return False
    tool = ToolSpec(_PROBE_TOOL, "probe").to_openai()
    try:
        text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tools=[tool], tokenize=False,
                                             add_generation_prompt=True)
    except Exception:  # a template that rejects tools renders none
        return False
    return _PROBE_TOOL in text


def detect_format(tokenizer) -> ToolFormat:
    """The tool format of ``tokenizer``'s chat template (cached per tokenizer object)."""
    try:
        return _cache[tokenizer]
    except (KeyError, TypeError):
        pass
    fmt = _detect(tokenizer)
    try:
        _cache[tokenizer] = fmt
    except TypeError:
        pass
    return fmt


def _detect(tokenizer) -> ToolFormat:
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # several named templates: the tool_use one, else the default
        template = template.get("tool_use") or template.get("default") or ""
    template = template or ""
    if not renders_tools(tokenizer):
        return ENVELOPE
    if "<tool_call>" in template:
        return HERMES
    if "[TOOL_CALLS]" in template:
        return MISTRAL_TOKEN if _special_token(tokenizer, "[TOOL_CALLS]") else MISTRAL
    if "<|python_tag|>" in template or ('"parameters"' in template and "ipython" in template):
        return LLAMA3_TAGGED if _special_token(tokenizer, "<|python_tag|>") else LLAMA3_BARE
    return ENVELOPE  # renders tools in a syntax we do not parse: speak the envelope instead


def format_calls(fmt: ToolFormat, calls: Sequence[ToolCall]) -> str:
    """``calls`` written in ``fmt``'s syntax as the model emits them under the grammar: compact JSON,
    so an agent's call in its next prompt is the model's own text (the conversation path of the
    step that made it is then a prefix hit through the call, ``engine.continuation``)."""
    objs = [{"name": c.name, fmt.args_key: c.args} for c in calls]
    dump = lambda o: json.dumps(o, ensure_ascii=False, separators=(",", ":"))  # noqa: E731
    if fmt.layout == "tagged":
        return "\n".join(f"{fmt.trigger}\n{dump(o)}\n{fmt.closer}" for o in objs)
    if fmt.layout == "single":
        return fmt.trigger + fmt.separator.join(dump(o) for o in objs)
    if fmt.layout == "array":
        return fmt.trigger + dump(objs)
    return dump({"tool_calls": objs})


def envelope_system_section(tools: Sequence[ToolSpec], parallel: bool = True) -> str:
    """The system-prompt section that offers ``tools`` to a model whose template renders none."""
    listing = "\n".join(json.dumps(t.to_openai()["function"], ensure_ascii=False) for t in tools)
    many = "one or more calls" if parallel else "exactly one call"
    return ("You can call the following tools. Their JSON schemas:\n" + listing + "\n\n"
            "To call tools, answer with only a JSON object of this form (" + many + "), and nothing else:\n"
            '{"tool_calls": [{"name": "<tool name>", "arguments": {<arguments as JSON>}}]}\n'
            "Otherwise answer in plain text. Tool results come back in messages from the tool.")


def prepare_tool_messages(tokenizer, messages: Sequence[Message],
                          tools: Sequence[ToolSpec]) -> tuple[list[Message], list[dict] | None]:
    """The messages and ``tools=`` to render for ``tokenizer`` (roles already template roles)."""
    fmt = detect_format(tokenizer)
    if fmt.native:
        return list(messages), [t.to_openai() for t in tools] or None
    out: list[Message] = []
    for m in messages:
        if m.tool_calls:
            text = format_calls(fmt, m.tool_calls)
            out.append(Message(m.role, f"{m.content}\n{text}" if m.content else text))
        elif m.role == "tool":
            out.append(Message("tool", m.content, tool_call_id=m.tool_call_id, name=m.name))
        else:
            out.append(Message(m.role, m.content))
    if tools:
        section = envelope_system_section(tools)
        if out and out[0].role == "system":
            out[0] = out[0].with_content(f"{out[0].content}\n\n{section}" if out[0].content else section)
        else:
            out.insert(0, Message("system", section))
    return out, None
