"""Structured output over the OpenAI API: ``response_format`` and required tool calls as JSON constraints.

Owns: ``StructuredOutput`` (what a request asks its answer to be: the JSON schema its decoding is
constrained to, and whether that JSON is a tool call) and ``structured_output(body)``, which reads
it from a request's ``response_format`` (``json_object``, ``json_schema``) and ``tools`` +
``tool_choice`` (``"required"`` or a named function), answering in the OpenAI error shape (400)
what the server cannot honour: ``tool_choice: "auto"`` (the model would choose between text and a
call in its own free-form syntax, and this server has no parser for one: vLLM refuses the same
without one), a named function missing from ``tools``, a required call beside a JSON
``response_format``, the deprecated ``functions`` / ``function_call``. ``tool_calls(text)`` turns
a finished constrained answer into OpenAI ``tool_calls``.

Decoding is constrained by ``model.constraint.JsonConstraint`` (llguidance over the model's own
vocabulary), so the JSON is valid for the schema whatever the model's size; the model still picks
the values. With one callable function (named, or the only one under ``"required"``) its
``parameters`` schema is the whole answer, which becomes the call's ``arguments``; with several
under ``"required"`` the answer is ``{"name": <one of them>, "arguments": {...}}`` (an ``anyOf``
with one branch per function), split into the call's name and arguments.

Does not own: the grammar engine (``model.constraint``), sampling (``model.generation``), the wire
models (``protocol``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from cachedrag.server import protocol as P

_EMPTY_OBJECT = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class StructuredOutput:
    """The answer's shape: JSON valid for ``schema`` (None: any JSON object); a call of one of
    ``tool_names`` when that is non-empty (one name: the JSON is its arguments)."""

    schema: dict[str, Any] | None
    tool_names: tuple[str, ...] = ()
    param: str = "response_format"  # the request field a schema error is reported against

    @property
    def is_tool_call(self) -> bool:
        return bool(self.tool_names)

    def constraint(self, tokenizer, eos_ids):
        """A fresh ``JsonConstraint`` for one generation (raises ``ConfigError`` for a schema the
        grammar engine cannot compile)."""
        from cachedrag.model.constraint import JsonConstraint

        return JsonConstraint(self.schema, tokenizer, eos_ids)

    def tool_calls(self, text: str) -> list[dict]:
        """The OpenAI ``tool_calls`` of a complete answer ``text`` (valid JSON by construction)."""
        if len(self.tool_names) == 1:
            name, arguments = self.tool_names[0], text
        else:
            call = json.loads(text)
            name, arguments = call["name"], json.dumps(call["arguments"], separators=(",", ":"))
        return [{"id": P.call_id(), "type": "function", "function": {"name": name, "arguments": arguments}}]

    def parser(self) -> "JsonCallParser":
        """A fresh ``stream.CallParser`` of one choice's constrained answer."""
        return JsonCallParser(self)


class JsonCallParser:
    """The call of a required / named tool choice, whose whole answer is constrained JSON: held back
    until it ends (the call's name may be its last field), then one call, or the text when it was
    cut short."""

    def __init__(self, shape: StructuredOutput):
        self.shape, self.held = shape, []

    def feed(self, text: str) -> list:
        self.held.append(text)
        return []

    def close(self, complete: bool) -> list:
        from cachedrag.server.stream import ToolEvent

        text = "".join(self.held)
        try:
            if not complete:
                raise ValueError("cut short")
            json.loads(text)
            (call,) = self.shape.tool_calls(text)
        except (ValueError, KeyError, TypeError):
            return [ToolEvent("content", text)]
        fn = call["function"]
        return [ToolEvent("call", id=call["id"], name=fn["name"]), ToolEvent("arguments", fn["arguments"])]


def structured_output(body) -> StructuredOutput | None:
    """What ``body`` (a chat or completion request) asks its answer to be; None: free text."""
    extra = body.model_extra or {}
    for legacy in ("functions", "function_call"):
        if extra.get(legacy) is not None:
            raise P.APIError(400, f"'{legacy}' is deprecated and not served: use 'tools' and 'tool_choice'",
                             param=legacy)
    fmt = body.response_format
    tools = getattr(body, "tools", None) or []
    choice = getattr(body, "tool_choice", None)
    if choice not in (None, "none") and not tools:
        raise P.APIError(400, "'tool_choice' needs 'tools'", param="tool_choice")
    if tools and choice != "none":
        return _tool_call(tools, choice, fmt)
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return StructuredOutput(None)
    return StructuredOutput(fmt.json_schema.schema_ or None)


def _tool_call(tools: list[P.Tool], choice, fmt: P.ResponseFormat | None) -> StructuredOutput:
    names = [t.function.name for t in tools]
    if len(set(names)) != len(names):
        raise P.APIError(400, "tool function names must be unique", param="tools")
    if choice in (None, "auto"):
        raise P.APIError(400, "tool_choice 'auto' is not served (this server has no parser for the model's own "
                              "tool-call syntax): set tool_choice to 'required', {'type': 'function', 'function': "
                              "{'name': ...}} or 'none'", param="tool_choice")
    if fmt is not None and fmt.type != "text":
        raise P.APIError(400, "a required tool call and a JSON response_format cannot be combined",
                         param="response_format")
    if isinstance(choice, P.NamedToolChoice):
        if choice.function.name not in names:
            raise P.APIError(400, f"tool_choice names {choice.function.name!r}, which is not in tools {names}",
                             param="tool_choice")
        tools = [tools[names.index(choice.function.name)]]
    if len(tools) == 1:
        return StructuredOutput(tools[0].function.parameters or _EMPTY_OBJECT, (tools[0].function.name,), "tools")
    branches = [{"type": "object",
                 "properties": {"name": {"const": t.function.name}, "arguments": t.function.parameters or _EMPTY_OBJECT},
                 "required": ["name", "arguments"]} for t in tools]
    return StructuredOutput({"anyOf": branches}, tuple(t.function.name for t in tools), "tools")
