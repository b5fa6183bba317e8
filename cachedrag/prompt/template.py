"""Chat messages to one prompt string through the tokenizer's chat template.

Owns: ``Message`` (role + text, framework-neutral), ``render_messages`` (the tokenizer's chat
template with the generation prompt, or a plain ``role: text`` layout for tokenizers without
one) and ``RenderedPrompt``, which also records where the last message's content starts: the
text before it (system prompt, earlier turns, template markup) is a stable prefix the engine
can cache exactly; ``template_split``, the same rendering around an empty user message (the
text before and after it), which the engine's own chat layout puts its chunks and question in.
Does not own: finding chunks in the string (``splitter``), tokenisation (``segments``) or
generation.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

_SENTINEL = "CACHEDRAGxLASTxCONTENTx7f3a9c"  # no whitespace: templates may trim content

# framework role names -> the roles chat templates know
_ROLES = {
    "system": "system", "developer": "system",
    "user": "user", "human": "user",
    "assistant": "assistant", "ai": "assistant", "chatbot": "assistant", "model": "assistant",
    "tool": "tool", "function": "tool",
}


@dataclass(frozen=True)
class Message:
    role: str
    content: str


@dataclass(frozen=True)
class RenderedPrompt:
    """The prompt string the model sees; ``prefix_end`` = start of the last message's content (or None)."""

    text: str
    prefix_end: int | None = None
    notes: tuple[str, ...] = field(default=())


def template_role(role: str) -> str:
    """Map a framework's role name to a chat-template role (unknown roles pass through)."""
    return _ROLES.get(role.lower(), role.lower())


def render_messages(tokenizer, messages: Sequence[Message]) -> RenderedPrompt:
    """Render ``messages`` for generation (the assistant turn is opened).

    Templates that reject a message sequence (e.g. ones that insist on alternating roles) get
    consecutive same-role messages merged; the result's ``notes`` say so.
    """
    if not messages:
        raise ValueError("no messages to render")
    msgs = [Message(template_role(m.role), m.content) for m in messages]
    notes: list[str] = []
    try:
        text = _apply(tokenizer, msgs)
    except Exception as exc:  # jinja raises TemplateError (or its own exceptions) from the template
        merged = _merge_same_roles(msgs)
        if len(merged) == len(msgs):
            raise
        text = _apply(tokenizer, merged)
        notes.append(f"chat template rejected the messages ({exc}); merged consecutive same-role messages")
        msgs = merged
    return RenderedPrompt(text, _prefix_end(tokenizer, msgs, text), tuple(notes))


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


def _apply(tokenizer, messages: Sequence[Message]) -> str:
    if has_chat_template(tokenizer):
        return tokenizer.apply_chat_template([{"role": m.role, "content": m.content} for m in messages],
                                             tokenize=False, add_generation_prompt=True)
    return "".join(f"{m.role}: {m.content}\n" for m in messages) + "assistant:"


def _prefix_end(tokenizer, messages: Sequence[Message], text: str) -> int | None:
    """Where the last message's content starts in ``text``, when the template keeps it verbatim."""
    last = messages[-1]
    if not last.content:
        return None
    probe = _apply(tokenizer, [*messages[:-1], Message(last.role, _SENTINEL)])
    before, found, after = probe.partition(_SENTINEL)
    if found and before + last.content + after == text:
        return len(before)
    return None  # the template rewrites the content (e.g. trims it): no safe boundary


def _merge_same_roles(messages: Sequence[Message]) -> list[Message]:
    out: list[Message] = []
    for m in messages:
        if out and out[-1].role == m.role:
            out[-1] = Message(m.role, out[-1].content + "\n\n" + m.content)
        else:
            out.append(m)
    return out
