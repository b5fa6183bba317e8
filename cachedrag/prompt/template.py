"""Chat messages to one prompt string through the tokenizer's chat template.

Owns: ``Message`` (role + text, framework-neutral; an assistant message may carry ``tool_calls``,
a tool result its ``tool_call_id`` and tool ``name``), ``render_messages`` (the tokenizer's chat
template with the generation prompt, or a plain ``role: text`` layout for tokenizers without
one; with ``tools=``, the tools, assistant calls and tool results rendered the way the
template's own tool format does, or the generic envelope of ``toolformat`` for templates that
render no tools) and ``RenderedPrompt``, which also records where the last message's content starts: the
text before it (system prompt, earlier turns, template markup) is a stable prefix the engine
can cache exactly; ``template_split``, the same rendering around an empty user message (the
text before and after it), which the engine's own chat layout puts its chunks and question in.
Does not own: finding chunks in the string (``splitter``), tokenisation (``segments``) or
generation.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from cachedrag.prompt.messages import Message

if TYPE_CHECKING:
    from cachedrag.prompt.tools import ToolSpec

_SENTINEL = "CACHEDRAGxLASTxCONTENTx7f3a9c"  # no whitespace: templates may trim content

# framework role names -> the roles chat templates know
_ROLES = {
    "system": "system", "developer": "system",
    "user": "user", "human": "user",
    "assistant": "assistant", "ai": "assistant", "chatbot": "assistant", "model": "assistant",
    "tool": "tool", "function": "tool",
}


@dataclass(frozen=True)
class RenderedPrompt:
    """The prompt string the model sees; ``prefix_end`` = start of the last message's content (or None)."""

    text: str
    prefix_end: int | None = None
    notes: tuple[str, ...] = field(default=())
    conversation: bool = False  # earlier turns, tool calls or tools: a next step will extend this prompt


def template_role(role: str) -> str:
    """Map a framework's role name to a chat-template role (unknown roles pass through)."""
    return _ROLES.get(role.lower(), role.lower())


def render_messages(tokenizer, messages: Sequence[Message],
                    tools: "Sequence[ToolSpec] | None" = None) -> RenderedPrompt:
    """Render ``messages`` for generation (the assistant turn is opened).

    With ``tools`` (or messages that carry tool calls or results), a template that renders tools
    gets them as ``tools=`` (OpenAI function format) and the calls and results in its own
    markup; any other template gets the generic envelope (``toolformat``): a system section
    listing the tools and calls / results as text. Templates that reject a message sequence (e.g.
    ones that insist on alternating roles) get consecutive same-role messages merged; the
    result's ``notes`` say so.
    """
    if not messages:
        raise ValueError("no messages to render")
    msgs = [m.with_content(m.content, template_role(m.role)) for m in messages]
    notes: list[str] = []
    tool_dicts = None
    if tools or any(m.tool_calls or m.role == "tool" for m in msgs):
        from cachedrag.prompt.toolformat import prepare_tool_messages

        msgs, tool_dicts = prepare_tool_messages(tokenizer, msgs, list(tools or ()))
    try:
        text = _apply(tokenizer, msgs, tool_dicts)
    except Exception as exc:  # jinja raises TemplateError (or its own exceptions) from the template
        merged = _merge_same_roles(msgs)
        if len(merged) == len(msgs):
            raise
        text = _apply(tokenizer, merged, tool_dicts)
        notes.append(f"chat template rejected the messages ({exc}); merged consecutive same-role messages")
        msgs = merged
    conversation = bool(tools) or any(m.role in ("assistant", "tool") for m in msgs)
    return RenderedPrompt(text, _prefix_end(tokenizer, msgs, text, tool_dicts), tuple(notes), conversation)


def render_completion(tokenizer, prompt: str, system_prompt: str | None = None) -> RenderedPrompt:
    """A completion prompt as the user turn of a chat (after ``system_prompt`` if given)."""
    messages = [Message("system", system_prompt)] if system_prompt else []
    messages.append(Message("user", prompt))
    return render_messages(tokenizer, messages)


def template_split(tokenizer, system_prompt: str | None) -> tuple[str, str]:
    """The prompt ``render_messages`` gives for ``[system_prompt?, user]`` cut where the user
    message's content goes: the text before and after it (generation prompt included). Without a
    chat template: ``system: ...`` / ``user: ...`` / ``assistant:`` lines."""
    messages = [Message("system", system_prompt)] if system_prompt else []
    messages.append(Message("user", _SENTINEL))
    before, _, after = _apply(tokenizer, messages).partition(_SENTINEL)
    return before, after


def has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def _apply(tokenizer, messages: Sequence[Message], tools: list[dict] | None = None) -> str:
    if has_chat_template(tokenizer):
        kwargs = {"tools": tools} if tools else {}
        return tokenizer.apply_chat_template([m.template_dict() for m in messages],
                                             tokenize=False, add_generation_prompt=True, **kwargs)
    return "".join(f"{m.role}: {m.content}\n" for m in messages) + "assistant:"


def _prefix_end(tokenizer, messages: Sequence[Message], text: str, tools: list[dict] | None = None) -> int | None:
    """Where the last message's content starts in ``text``, when the template keeps it verbatim."""
    last = messages[-1]
    if not last.content:
        return None
    probe = _apply(tokenizer, [*messages[:-1], last.with_content(_SENTINEL)], tools)
    before, found, after = probe.partition(_SENTINEL)
    if found and before + last.content + after == text:
        return len(before)
    return None  # the template rewrites the content (e.g. trims it): no safe boundary


def _merge_same_roles(messages: Sequence[Message]) -> list[Message]:
    out: list[Message] = []
    for m in messages:
        if out and out[-1].role == m.role and not (out[-1].tool_calls or m.tool_calls or m.role == "tool"):
            out[-1] = out[-1].with_content(out[-1].content + "\n\n" + m.content)
        else:
            out.append(m)
    return out
