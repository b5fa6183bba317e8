"""Tool calling's nouns, framework-neutral: the tools offered, the calls made, the choice asked for.

Owns: ``ToolSpec`` (a function the model may call: name, description, JSON-schema parameters,
strict), ``ToolCall`` (one call: id, name, arguments as a JSON string, as OpenAI's wire format
has them), ``ToolChoice`` (``"none"`` | ``"auto"`` | ``"required"`` | a tool's name, plus
``parallel`` calls allowed or not) and their conversions from and to the OpenAI function format
that LangChain, LlamaIndex and the server all speak. ``new_call_id`` makes the ids of calls the
model makes.

Does not own: rendering tools and calls into a prompt (``template``, ``toolformat``), parsing
the model's output (``toolparse``), or the grammar that constrains it (``toolgrammar``,
``model.constraint``). Pure Python.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


def new_call_id() -> str:
    """A fresh id for a call the model made (OpenAI's ``call_`` + 24 hex digits)."""
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True)
class ToolSpec:
    """A function the model may call; ``parameters`` is the JSON schema of its arguments object."""

    name: str
    description: str = ""
    parameters: Mapping[str, Any] = field(default_factory=lambda: dict(EMPTY_PARAMETERS))
    strict: bool = False

    def __post_init__(self):
        if not self.name:
            raise ValueError("a tool needs a name")

    @classmethod
    def from_openai(cls, tool: Mapping[str, Any]) -> "ToolSpec":
        """From ``{"type": "function", "function": {...}}`` or the bare ``function`` object."""
        fn = tool.get("function", tool) if tool.get("type", "function") == "function" else None
        if fn is None:
            raise ValueError(f"only function tools are supported, not {tool.get('type')!r}")
        return cls(fn["name"], fn.get("description") or "", dict(fn.get("parameters") or EMPTY_PARAMETERS),
                   bool(fn.get("strict") or False))

    def to_openai(self) -> dict[str, Any]:
        """The OpenAI function-tool form (what chat templates' ``tools=`` expect)."""
        fn: dict[str, Any] = {"name": self.name, "description": self.description,
                              "parameters": dict(self.parameters)}
        if self.strict:
            fn["strict"] = True
        return {"type": "function", "function": fn}


@dataclass(frozen=True)
class ToolCall:
    """One call the model made (or a history says it made); ``arguments`` is a JSON object's text."""

    id: str
    name: str
    arguments: str = "{}"

    @property
    def args(self) -> dict[str, Any]:
        """``arguments`` parsed (``{}`` when empty or not a JSON object)."""
        try:
            value = json.loads(self.arguments) if self.arguments else {}
        except json.JSONDecodeError:
            return {}
        return value if isinstance(value, dict) else {}

    @classmethod
    def of(cls, name: str, arguments: Any = None, id: str | None = None) -> "ToolCall":
        """A call from arguments given as a dict or a JSON string."""
        text = arguments if isinstance(arguments, str) else json.dumps(arguments or {}, ensure_ascii=False)
        return cls(id or new_call_id(), name, text)

    @classmethod
    def from_openai(cls, call: Mapping[str, Any]) -> "ToolCall":
        fn = call.get("function", call)
        return cls.of(fn["name"], fn.get("arguments"), call.get("id"))

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}

    def to_template(self) -> dict[str, Any]:
        """The form Hugging Face chat templates expect: arguments as a dict, not a string."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.args}}


@dataclass(frozen=True)
class ToolChoice:
    """What the answer must be: ``mode`` none (text only), auto (text or calls), required (calls
    only) or named (one call of ``name``); ``parallel``: several calls allowed in one answer."""

    mode: str = "auto"
    name: str | None = None
    parallel: bool = True

    def __post_init__(self):
        if self.mode not in ("none", "auto", "required", "named"):
            raise ValueError(f"unknown tool_choice mode {self.mode!r}")
        if (self.mode == "named") != (self.name is not None):
            raise ValueError("a named tool_choice needs a name, and only it has one")

    @classmethod
    def parse(cls, choice: Any = None, parallel: bool | None = None,
              tool_names: Iterable[str] | None = None) -> "ToolChoice":
        """From any of the forms the frameworks use: None (auto), "none" / "auto" / "required" /
        "any" (LangChain's required), True (required), a tool's name, or OpenAI's
        ``{"type": "function", "function": {"name": ...}}``. ``tool_names``, when given, must
        contain a named tool."""
        par = True if parallel is None else bool(parallel)
        if choice is None:
            return cls("auto", parallel=par)
        if choice is True:
            return cls("required", parallel=par)
        if choice is False:
            return cls("none", parallel=par)
        if isinstance(choice, Mapping):
            fn = choice.get("function") or {}
            name = fn.get("name") or choice.get("name")
            if not name:
                raise ValueError(f"tool_choice {dict(choice)!r} names no function")
            choice = name
            named = True
        else:
            named = False
        if not named and choice in ("none", "auto", "required", "any"):
            return cls("required" if choice == "any" else choice, parallel=par)
        names = list(tool_names) if tool_names is not None else None
        if names is not None and choice not in names:
            raise ValueError(f"tool_choice names {choice!r}, which is not among the tools {names}")
        return cls("named", str(choice), par)

    def callable(self, tools: Iterable[ToolSpec]) -> list[ToolSpec]:
        """The tools a call may name under this choice."""
        tools = list(tools)
        if self.mode == "none":
            return []
        if self.mode == "named":
            return [t for t in tools if t.name == self.name]
        return tools


def as_tool_specs(tools: Iterable[Any] | None, unique: bool = True) -> list[ToolSpec]:
    """``ToolSpec``s from ToolSpecs or OpenAI-format dicts. Names must be unique, or with
    ``unique=False`` the first tool of a name is kept (a call names a tool: two of one name
    cannot both be meant)."""
    specs = [t if isinstance(t, ToolSpec) else ToolSpec.from_openai(t) for t in (tools or [])]
    names = [t.name for t in specs]
    if len(set(names)) == len(names):
        return specs
    if unique:
        raise ValueError(f"tool names must be unique: {names}")
    return [t for i, t in enumerate(specs) if t.name not in names[:i]]
