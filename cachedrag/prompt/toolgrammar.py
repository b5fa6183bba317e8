"""The grammar a tool-calling answer is constrained to, per ``tool_choice`` and format.

Owns: ``ToolGrammar`` (an llguidance Lark grammar, and the trigger text a lazy one waits for)
and ``tool_grammar(fmt, tools, choice)``:

    none       no grammar (None): the answer is free text
    required   eager: the answer is the format's calls, nothing else (one call, or one or more
               with ``parallel``), each a call of one of the tools with arguments valid for its
               schema
    named      eager, as required, with only the named tool
    auto       lazy: free text until the format's trigger (``<tool_call>``, the envelope's
               ``{"tool_calls":``, ...) appears, then the rest is constrained to valid calls
               (llama.cpp calls this a lazy grammar). A trigger that is one special token needs
               no laziness: the text branch can never produce it. The bare Llama-3 format
               (no ``<|python_tag|>`` token) is decided by the first character: ``{`` opens a call.

A call object is ``{"name": <const>, <args key>: <the tool's parameters>}`` with an ``anyOf``
over the tools; objects are closed (``additionalProperties: false`` where a schema lists its
properties and says nothing else, as ``model.constraint.closed_objects``) and JSON is compact.
While a lazy grammar has not triggered, the constraint (``model.constraint.GrammarConstraint``)
also allows EOS: the answer may end as plain text.

Does not own: compiling or applying the grammar (``model.constraint``), the formats
(``toolformat``). Pure Python.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from cachedrag.prompt.toolformat import ToolFormat
from cachedrag.prompt.tools import EMPTY_PARAMETERS, ToolChoice, ToolSpec

_JSON_OPTIONS = {"whitespace_flexible": False}
_REGEX_META = set("\\.+*?()|[]{}^$#&-~/")


@dataclass(frozen=True)
class ToolGrammar:
    """``lark``: the grammar text; ``lazy_trigger``: the text whose appearance starts the
    constrained part (None: the grammar decides from the first token, so EOS needs no help)."""

    lark: str
    lazy_trigger: str | None = None


def _closed(schema: Any) -> Any:
    if isinstance(schema, list):
        return [_closed(x) for x in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _closed(v) for k, v in schema.items()}
    if "properties" in out and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def call_schema(fmt: ToolFormat, tools: Sequence[ToolSpec]) -> dict[str, Any]:
    """The JSON schema of one call object of any of ``tools``."""
    branches = [{"type": "object",
                 "properties": {"name": {"const": t.name},
                                fmt.args_key: _closed(dict(t.parameters or EMPTY_PARAMETERS))},
                 "required": ["name", fmt.args_key], "additionalProperties": False} for t in tools]
    return branches[0] if len(branches) == 1 else {"anyOf": branches}


def _json(schema: dict[str, Any]) -> str:
    return "%json " + json.dumps({**schema, "x-guidance": _JSON_OPTIONS})


def _regex_escape(text: str) -> str:
    return "".join("\\" + c if c in _REGEX_META else c for c in text)


def _lark_string(text: str) -> str:
    return json.dumps(text)


def tool_grammar(fmt: ToolFormat, tools: Sequence[ToolSpec], choice: ToolChoice,
                 trigger_id: int | None = None) -> ToolGrammar | None:
    """The grammar for an answer under ``choice`` (None under ``none`` or with no callable tool).
    ``trigger_id``: the token id of ``fmt.trigger`` when it is a special token."""
    callable_tools = choice.callable(tools)
    if choice.mode == "none" or not callable_tools:
        return None
    if fmt.trigger_token and trigger_id is None:
        raise ValueError(f"the {fmt.name} format's trigger {fmt.trigger!r} is a special token: pass its id")
    one = _json(call_schema(fmt, callable_tools))
    rules = [f"call_obj: {one}"]
    lead = f"<[{trigger_id}]>" if fmt.trigger_token else _lark_string(fmt.trigger) if fmt.trigger else ""
    if fmt.layout == "tagged":
        rules.append(f"call: {lead} \"\\n\" call_obj \"\\n\" {_lark_string(fmt.closer)}")
        rules.append("calls: call (\"\\n\" call)*" if choice.parallel else "calls: call")
        rest = f"\"\\n\" call_obj \"\\n\" {_lark_string(fmt.closer)}" + (" (\"\\n\" call)*" if choice.parallel else "")
    elif fmt.layout == "single":
        sep = _lark_string(fmt.separator)
        body = f"call_obj ({sep} call_obj)*" if choice.parallel else "call_obj"
        rules.append(f"calls: {lead} {body}".replace("calls:  ", "calls: "))
        rest = body
    else:
        array = {"type": "array", "items": call_schema(fmt, callable_tools), "minItems": 1}
        if not choice.parallel:
            array["maxItems"] = 1
        if fmt.layout == "array":
            rules.append(f"calls: {lead} {_json(array)}")
            rest = _json(array)
        else:
            envelope = {"type": "object", "properties": {"tool_calls": array}, "required": ["tool_calls"],
                        "additionalProperties": False}
            rules.append(f"calls: {_json(envelope)}")
            rest = f"{_json(array)} \"}}\""
    rules = rules[1:] if "call_obj" not in " ".join(rules[1:]) else rules
    if choice.mode in ("required", "named"):
        return ToolGrammar("\n".join(["start: calls", *rules]))
    if fmt.trigger_token:  # the text branch cannot produce the special token
        return ToolGrammar("\n".join(["start: TEXT | TEXT? calls", "TEXT: /(.|\\n)+/", *rules]))
    if not fmt.trigger:  # bare JSON: a call starts with "{", text does not
        return ToolGrammar("\n".join(["start: TEXT | calls", "TEXT: /[^{](.|\\n)*/", *rules]))
    pre = f"pre[lazy]: /(.|\\n)*{_regex_escape(fmt.trigger)}/"
    return ToolGrammar("\n".join([f"start: pre {rest}", pre, *rules]), lazy_trigger=fmt.trigger)
