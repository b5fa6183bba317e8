"""Content-defined passages: the paragraphs of request text that may be retrieved chunks.

Owns: ``paragraphs`` (a text split at blank lines and at separator lines without letters or
digits, e.g. ``-----``; each paragraph normalized, the short ones dropped), ``last_paragraph``
(the paragraph a request's question is taken to be) and ``context_passages``, the rule both the
server's automatic chunk detection and the cluster router's fingerprints apply to a request's
message texts: every paragraph of at least ``min_chars`` characters, except the last message's
last paragraph (the question). Pure Python, no tokenizer: the same text gives the same passages
in every process.

Does not own: remembering passages or finding them in a prompt (``registry``), the request
bodies they come from (``cachedrag.server.protocol``, ``cachedrag.cluster.fingerprints``).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Sequence

from cachedrag.prompt.registry import normalize

_BOUNDARY = re.compile(r"^[^\w]*$")  # a blank line or a separator line (no letters or digits)
TOOL_ROLES = ("tool", "function", "ipython")  # the roles of a tool's result in chat messages


def paragraphs(text: str, min_chars: int) -> list[str]:
    """Paragraphs of ``text`` (split at blank and separator lines), normalized, at least
    ``min_chars`` long, in order: the content-defined passages the server detects and the
    cluster router fingerprints."""
    out: list[str] = []
    block: list[str] = []
    for line in text.split("\n") + [""]:
        if _BOUNDARY.match(line):
            para = normalize("\n".join(block))
            if len(para) >= min_chars:
                out.append(para)
            block = []
        else:
            block.append(line)
    return out


def last_paragraph(text: str) -> str | None:
    """The last paragraph of ``text`` (after its last blank or separator line), normalized, the
    form ``paragraphs`` gives it; None if ``text`` has none. The server's automatic passage
    detection takes it as the question."""
    block: list[str] = []
    last: list[str] = []
    for line in text.split("\n") + [""]:
        if _BOUNDARY.match(line):
            last, block = (block or last), []
        else:
            block.append(line)
    return normalize("\n".join(last)) or None


def context_passages(contents: Sequence[str], min_chars: int, roles: Sequence[str] | None = None) -> list[str]:
    """The passages of a request's message texts, in order: every paragraph of at least
    ``min_chars`` characters, except the last message's last paragraph when it ends that message
    (the question is never a passage). With ``roles``, a tool message's passages are
    ``tool_passages`` (a tool result holds no question)."""
    found: list[str] = []
    for j, content in enumerate(contents):
        if roles is not None and roles[j] in TOOL_ROLES:
            found.extend(tool_passages(content, min_chars))
            continue
        paras = paragraphs(content, min_chars)
        if j == len(contents) - 1 and paras and normalize(content).endswith(paras[-1]):
            paras = paras[:-1]
        found.extend(paras)
    return found


def tool_passages(content: str, min_chars: int) -> list[str]:
    """The passages of a tool result (an agent's retrieval step): when ``content`` is JSON (a
    retriever tool's ``json.dumps`` of documents, ``[{"page_content": ...}]``, or of strings),
    every string value of at least ``min_chars`` characters in the form the JSON text holds it
    (escaped, as the prompt then does), not the JSON text as a whole, which would be one passage
    covering them all; otherwise every paragraph, the last one included."""
    stripped = content.strip()
    if stripped[:1] in ("[", "{", '"'):
        try:
            value = json.loads(stripped)
        except ValueError:
            value = None
        if value is not None and not isinstance(value, (int, float, bool)):
            return [t for s in _strings(value) if len(s.strip()) >= min_chars
                    for t in _as_written(s, content)]
    return paragraphs(content, min_chars)


def _strings(value) -> Iterator[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _strings(v)
    elif isinstance(value, list):
        for v in value:
            yield from _strings(v)


def _as_written(text: str, content: str) -> list[str]:
    """``text`` as ``content`` writes it inside a JSON string: escaped with or without ASCII
    escapes (the first that occurs; none when neither does)."""
    for ascii_only in (True, False):
        written = normalize(json.dumps(text, ensure_ascii=ascii_only)[1:-1])
        if written in content:
            return [written]
    return []
