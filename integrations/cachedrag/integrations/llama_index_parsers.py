"""The JSON shapes LlamaIndex's output parsers expect, so ``CachedRAGLLM.predict`` decodes them under a grammar.

Owns: :func:`parser_schema`, the JSON schema of what a prompt's output parser will parse, for the
parsers whose shape is known: ``PydanticOutputParser`` (its ``output_cls``) and
``SubQuestionOutputParser`` (``{"items": [{"sub_question", "tool_name"}, ...]}``, the shape of
LlamaIndex's own few-shot example, with ``tool_name`` one of the tools the prompt lists). A small
model asked in prose for "json markdown" often writes something else, and the parser then raises
("No valid JSON found"); decoding under the schema makes the output parse whatever the model size.
Any other parser returns ``None`` and ``predict`` runs unconstrained, as LlamaIndex's does.

Contract: the schema only narrows what the parser already accepts; the parser still parses the
text. Bounds (items, string lengths) keep a complete answer within a few hundred tokens, so a
``max_new_tokens`` cut is rare; a cut answer raises with the limit named.
"""

from __future__ import annotations

import json
from typing import Any

MAX_SUB_QUESTIONS = 4  # sub-questions per question; LlamaIndex's example writes 4
MAX_SUB_QUESTION_CHARS = 120  # one sub-question's length, in characters


def parser_schema(parser: Any, prompt_args: dict[str, Any]) -> dict | None:
    """The JSON schema ``parser`` parses, or ``None`` for a parser of unknown shape.
    ``prompt_args``: the template's arguments (``tools_str`` names the sub-question tools)."""
    from llama_index.core.output_parsers import PydanticOutputParser
    from llama_index.core.question_gen.output_parser import SubQuestionOutputParser

    if isinstance(parser, PydanticOutputParser):
        return parser.output_cls.model_json_schema()
    if isinstance(parser, SubQuestionOutputParser):
        return sub_question_schema(_tool_names(prompt_args.get("tools_str")))
    return None


def sub_question_schema(tool_names: list[str]) -> dict:
    """``{"items": [{"sub_question": str, "tool_name": one of tool_names}, ...]}``, 1 to
    ``MAX_SUB_QUESTIONS`` items (any tool name when ``tool_names`` is empty)."""
    tool = {"type": "string", "enum": tool_names} if tool_names else {"type": "string", "minLength": 1}
    item = {
        "type": "object",
        "properties": {"sub_question": {"type": "string", "minLength": 1, "maxLength": MAX_SUB_QUESTION_CHARS},
                       "tool_name": tool},
        "required": ["sub_question", "tool_name"],
        "additionalProperties": False,
    }
    return {
        "type": "object",
        "properties": {"items": {"type": "array", "items": item, "minItems": 1, "maxItems": MAX_SUB_QUESTIONS}},
        "required": ["items"],
        "additionalProperties": False,
    }


def _tool_names(tools_str: Any) -> list[str]:
    """The tool names of LlamaIndex's ``build_tools_text`` (a JSON object name -> description);
    none when the text is not that."""
    try:
        tools = json.loads(tools_str) if isinstance(tools_str, str) else None
    except ValueError:
        return []
    return [name for name in tools if isinstance(name, str)] if isinstance(tools, dict) else []
