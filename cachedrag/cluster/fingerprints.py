"""Chunk fingerprints of an OpenAI-style request body, for routing.

Owns: ``request_fingerprints(body)`` — what the chunk-affinity router hashes: the texts of the
``"cachedrag": {"chunks": [...]}`` extension field when the client sends it, else the long
paragraphs of the messages (or of a completion ``prompt``), the same content-defined passages
the server's automatic mode reuses (``cachedrag.prompt.passages.context_passages``). Each
fingerprint is a short stable digest of the whitespace-stripped text; its weight is the text's
length. Pure Python (no torch, no Ray):
it runs in the ingress for every request, before any tokenizer is involved.

Does not own: chunk cache keys (``cachedrag.kvcache.keys``: token ids + model namespace) —
routing needs only the same fingerprint for the same text, on every ingress replica — nor the
ranking (``cachedrag.cluster.affinity``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass, field

from cachedrag.prompt.passages import context_passages


@dataclass(frozen=True)
class Fingerprints:
    """A request's chunk fingerprints (in prompt order, deduplicated) and their weights."""

    digests: list[str] = field(default_factory=list)
    weights: list[float] = field(default_factory=list)
    source: str = "none"  # "explicit", "auto" or "none"

    def __len__(self) -> int:
        return len(self.digests)


def digest(text: str) -> str:
    return hashlib.blake2b(text.strip().encode(), digest_size=12).hexdigest()


def _content_text(content) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI content parts
        return "\n\n".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
    return ""


def _roles(body: dict) -> list[str] | None:
    """The roles of a chat body's messages (tool results hold passages, not questions), else None."""
    messages = body.get("messages")
    if isinstance(messages, list):
        return [str(m.get("role", "")) for m in messages if isinstance(m, dict)]
    return None


def _texts(body: dict) -> list[str]:
    messages = body.get("messages")
    if isinstance(messages, list):
        return [_content_text(m.get("content")) for m in messages if isinstance(m, dict)]
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and all(isinstance(p, str) for p in prompt):
        return list(prompt)
    return []


def _collect(texts: Iterable[str], source: str) -> Fingerprints:
    seen: dict[str, float] = {}
    for text in texts:
        text = text.strip()
        if text:
            d = digest(text)
            seen.setdefault(d, float(len(text)))
    if not seen:
        return Fingerprints()
    return Fingerprints(list(seen), list(seen.values()), source)


def request_fingerprints(body: dict, *, min_chars: int = 200) -> Fingerprints:
    """Fingerprints of a chat or completion request body (a parsed JSON object).

    Explicit ``cachedrag.chunks`` win; otherwise every paragraph of at least ``min_chars``
    characters, except the last message's last paragraph (the question, as in the server's
    automatic mode). Malformed bodies give no fingerprints (the server answers them with 400).
    """
    if not isinstance(body, dict):
        return Fingerprints()
    ext = body.get("cachedrag")
    if isinstance(ext, dict) and isinstance(ext.get("chunks"), list):
        chunks = [c for c in ext["chunks"] if isinstance(c, str)]
        if chunks:
            return _collect(chunks, "explicit")
    return _collect(context_passages(_texts(body), min_chars, _roles(body)), "auto")
