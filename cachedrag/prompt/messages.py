"""One chat message, framework-neutral: what the template renders and the tool-calling core reads.

Owns ``Message`` only (role, text, and an assistant's tool calls or a tool result's call id);
rendering is ``template``'s, tool formats ``toolformat``'s.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from cachedrag.prompt.tools import ToolCall


@dataclass(frozen=True)
class Message:
    """One chat message; ``tool_calls`` on an assistant message, ``tool_call_id`` / ``name`` on a
    tool result (``Message(role, content)`` is a plain message)."""

    role: str
    content: str
    tool_calls: tuple["ToolCall", ...] = ()
    tool_call_id: str | None = None
    name: str | None = None

    def with_content(self, content: str, role: str | None = None) -> "Message":
        return dataclasses.replace(self, content=content, role=role or self.role)

    def template_dict(self) -> dict:
        """The message as Hugging Face chat templates take it (call arguments as dicts)."""
        out: dict = {"role": self.role, "content": self.content}
        if self.tool_calls:
            out["tool_calls"] = [c.to_template() for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            out["name"] = self.name
        return out
