"""Structured output over the OpenAI API: ``response_format`` JSON and tool calls as grammar constraints.

Owns: ``StructuredOutput`` (a JSON answer: the schema its decoding is constrained to), ``ToolAnswer``
(the tools a request offers and its ``tool_choice``, in the model's own tool-call format: the
grammar of its answer and a parser per choice) and ``structured_output(body)``, which reads them
from a request's ``response_format`` (``json_object``, ``json_schema``) and ``tools`` +
``tool_choice`` + ``parallel_tool_calls``, answering in the OpenAI error shape (400) what the
server cannot honour: a named function missing from ``tools``, duplicate tool names, tool calls
beside a JSON ``response_format``, ``tool_choice`` without ``tools``, the deprecated ``functions``
/ ``function_call``. ``request_tools(body)`` gives the tools the prompt renders (also under
``tool_choice: "none"``: the model sees them, as with OpenAI, and answers in text).

Tool calls (``cachedrag.prompt.tools`` is the core): ``tool_choice`` absent or ``"auto"`` is a
lazy grammar (free text until the format's trigger, e.g. ``<tool_call>`` or the generic
envelope's ``{"tool_calls":``, then only well-formed calls of the offered tools), ``"required"``
and a named function are eager (the answer is calls); ``parallel_tool_calls: false`` allows one
call. The model's text is parsed incrementally (``cachedrag.prompt.toolparse``), so a streamed
call's name goes out before its arguments. Decoding is constrained by llguidance over the model's
own vocabulary, so calls are valid for their schemas whatever the model's size; the model still
picks the values.

Does not own: the grammars and parsers (``cachedrag.prompt.toolgrammar`` / ``toolparse``,
``model.constraint``), sampling (``model.generation``), the wire models (``protocol``), the
per-choice assembly of text and calls (``stream``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from cachedrag.prompt.tools import ToolChoice, ToolSpec
from cachedrag.server import protocol as P
from cachedrag.server.stream import ToolEvent


@dataclass(frozen=True)
class StructuredOutput:
    """A JSON answer valid for ``schema`` (None: any JSON object)."""

    schema: dict[str, Any] | None
    param: str = "response_format"  # the request field a schema error is reported against

    def constraint(self, tokenizer, eos_ids):
        """A fresh ``JsonConstraint`` for one generation (raises ``ConfigError`` for a schema the
        grammar engine cannot compile)."""
        from cachedrag.model.constraint import JsonConstraint

        return JsonConstraint(self.schema, tokenizer, eos_ids)

    def parser(self, tokenizer) -> None:
        return None


@dataclass(frozen=True)
class ToolAnswer:
    """An answer that may (``auto``) or must (``required``, named) call ``tools``."""

    tools: tuple[ToolSpec, ...]
    choice: ToolChoice
    param: str = "tools"

    def constraint(self, tokenizer, eos_ids):
        """A fresh ``GrammarConstraint`` for one generation, in the template's tool format."""
        from cachedrag.model.constraint import tool_constraint

        return tool_constraint(tokenizer, eos_ids, self.tools, self.choice)

    def parser(self, tokenizer) -> "FormatParser":
        """A fresh ``stream.CallParser`` of one choice's answer."""
        from cachedrag.prompt.toolformat import detect_format
        from cachedrag.prompt.toolparse import parser_for

        return FormatParser(parser_for(detect_format(tokenizer), P.call_id), {t.name for t in self.tools})


class FormatParser:
    """``stream.CallParser`` over the core's incremental parser of one tool format. At the end of an
    answer cut short, the parser closes the call it was in (``toolparse``); a call whose name was
    cut (not one of ``names``, the offered tools; None: any) is dropped with its arguments. A call
    that repeats an earlier one is never reported (the core parser holds it until it is known not to
    be a repeat: ``toolparse``)."""

    def __init__(self, parser, names: set[str] | None = None):
        self.parser, self.names = parser, names

    def feed(self, text: str) -> list[ToolEvent]:
        return self._events(self.parser.feed(text))

    def close(self, complete: bool) -> list[ToolEvent]:
        return self._events(self.parser.finish(), final=True)

    def _events(self, events, final: bool = False) -> list[ToolEvent]:
        from cachedrag.prompt.toolparse import ArgumentsDelta, CallStarted, TextDelta

        if final and self.names is not None:  # only the call closed at the end can have a cut name
            cut = {e.index for e in events if isinstance(e, CallStarted) and e.name not in self.names}
            events = [e for e in events if getattr(e, "index", None) not in cut]
        out = []
        for e in events:
            if isinstance(e, TextDelta):
                out.append(ToolEvent("content", e.text))
            elif isinstance(e, CallStarted):
                out.append(ToolEvent("call", index=e.index, id=e.id, name=e.name))
            elif isinstance(e, ArgumentsDelta):
                out.append(ToolEvent("arguments", e.text, index=e.index))
        return out


def request_tools(body) -> list[ToolSpec]:
    """The tools ``body`` offers (rendered into its prompt whatever its ``tool_choice``)."""
    return [ToolSpec.from_openai(t.model_dump(exclude_none=True)) for t in getattr(body, "tools", None) or []]


def structured_output(body) -> StructuredOutput | ToolAnswer | None:
    """What ``body`` (a chat or completion request) asks its answer to be; None: free text."""
    extra = body.model_extra or {}
    for legacy in ("functions", "function_call"):
        if extra.get(legacy) is not None:
            raise P.APIError(400, f"'{legacy}' is deprecated and not served: use 'tools' and 'tool_choice'",
                             param=legacy)
    fmt = body.response_format
    tools = getattr(body, "tools", None) or []
    choice = getattr(body, "tool_choice", None)
    if choice not in (None, "none", "auto") and not tools:
        raise P.APIError(400, "'tool_choice' needs 'tools'", param="tool_choice")
    if tools and choice != "none":
        return _tool_answer(body, tools, choice, fmt)
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return StructuredOutput(None)
    return StructuredOutput(fmt.json_schema.schema_ or None)


def _tool_answer(body, tools: list[P.Tool], choice, fmt: P.ResponseFormat | None) -> ToolAnswer:
    names = [t.function.name for t in tools]
    if len(set(names)) != len(names):
        raise P.APIError(400, "tool function names must be unique", param="tools")
    if fmt is not None and fmt.type != "text":
        raise P.APIError(400, "tool calls and a JSON response_format cannot be combined: set tool_choice to "
                              "'none' for a JSON answer", param="response_format")
    raw = choice.model_dump() if isinstance(choice, P.NamedToolChoice) else choice
    try:
        parsed = ToolChoice.parse(raw, body.parallel_tool_calls, names)
    except ValueError as exc:
        raise P.APIError(400, str(exc), param="tool_choice") from None
    return ToolAnswer(tuple(request_tools(body)), parsed)
