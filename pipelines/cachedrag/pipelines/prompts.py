"""Prompt templates of the prebuilt pipelines, overridable by users.

Owns: ``PromptTemplate`` (a system prompt + a user-message template with ``{named}`` fields,
checked once against the fields a step provides) and the default templates of every step.
The system prompt is fixed text so that the engine keeps its KV in the prefix tree: put
instructions there and only the per-request text in ``user``. Retrieved chunks are not part of
a template: the generator places them between the system prompt and the user text, as
separately cached segments. Does not own: model calls or chat templates (``generators``).
"""

from __future__ import annotations

import string
from collections.abc import Iterable

from pydantic import BaseModel, ConfigDict, Field

from cachedrag.errors import ConfigError


class PromptTemplate(BaseModel):
    """``system`` (fixed text, or None for the model's default) and ``user`` (``str.format`` fields).

    >>> PromptTemplate(system="Be brief.", user="Question: {question}").render(question="Why?")
    ('Be brief.', 'Question: Why?')
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    system: str | None = Field(None, description="system prompt (fixed text; cached as a prefix by the engine)")
    user: str = Field("Question: {question}", description="user message after the retrieved chunks; str.format fields")

    def fields(self) -> set[str]:
        """Names of the ``{fields}`` the user template uses."""
        try:
            return {name for _, name, _, _ in string.Formatter().parse(self.user) if name}
        except ValueError as exc:
            raise ConfigError(f"bad prompt template {self.user!r}: {exc}") from exc

    def check(self, allowed: Iterable[str], step: str) -> "PromptTemplate":
        """``ConfigError`` unless every field is one the step provides."""
        unknown = self.fields() - set(allowed)
        if unknown:
            raise ConfigError(f"prompt of step {step!r} uses unknown fields {sorted(unknown)}; "
                              f"available: {sorted(allowed)}")
        return self

    def render(self, **values: str) -> tuple[str | None, str]:
        """(system, user text) with ``values`` filled in."""
        try:
            return self.system, self.user.format(**values)
        except (KeyError, IndexError, ValueError) as exc:
            raise ConfigError(f"cannot fill prompt template {self.user!r}: {exc!r}") from exc


ANSWER = PromptTemplate(
    system=("You are a helpful assistant. Answer the question using the Python documentation excerpts "
            "given by the user. Be brief."),
    user="Question: {question}",
)

HYDE_PASSAGE = PromptTemplate(
    system=("You write passages of the Python standard library documentation. Write one short passage "
            "that answers the user's question, in the style of the documentation."),
    user="Question: {question}",
)

DECOMPOSE = PromptTemplate(
    system=("Split the user's question into at most three short, self-contained sub-questions that together "
            "answer it. Reply only with a JSON list of strings."),
    user="Question: {question}",
)

SYNTHESIZE = PromptTemplate(
    system=("You are a helpful assistant. Answer the question using the answers to its sub-questions given "
            "by the user. Be brief."),
    user="{subanswers}\n\nQuestion: {question}",
)

SUBANSWER_LINE = "Sub-question: {subquestion}\nAnswer: {answer}"
