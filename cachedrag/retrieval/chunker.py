"""Token-based chunking of documents in the LLM's tokens.

Owns: the ``Chunk`` record (stable id ``"<doc_id>#<index>"``, token ids, token and char
offsets), cutting documents into fixed-size overlapping windows of LLM tokens, and the
identity of the tokenizer that did it (recorded in index manifests, because chunk KV caches
are keyed by these token ids). Does not own: embedding (``embedder``) or the corpus readers
(``cachedrag.corpus``).

Any tokenizer with HF-style ``encode(text, add_special_tokens=False)`` and ``decode(ids)``
works. When it also reports character offsets (Hugging Face fast tokenizers), char offsets
index the original document text; otherwise they index the decoded token stream, which is
the same text for tokenizers that round-trip.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from tqdm.auto import tqdm

from cachedrag.corpus import Document
from cachedrag.errors import EmptyInputError
from cachedrag.retrieval.config import ChunkConfig

# A fixed text whose encoding is part of a tokenizer's fingerprint.
_FINGERPRINT_PROBE = "cachedrag tokenizer probe: Hello, world! 12345 \u00e9\u00e8 \u4f60\u597d\n\tdef f(x): return x"


@runtime_checkable
class Tokenizer(Protocol):
    """The part of a Hugging Face tokenizer the chunker needs."""

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


@dataclass(frozen=True)
class Chunk:
    """A window of a document's LLM tokens.

    ``token_start``/``token_end`` index the document's token ids (end exclusive);
    ``char_start``/``char_end`` its text (see the module docstring). ``text`` is the decoded
    ``token_ids``, exactly what the LLM sees.
    """

    id: str
    doc_id: str
    index: int
    text: str
    token_ids: tuple[int, ...]
    token_start: int
    token_end: int
    char_start: int
    char_end: int

    def to_record(self) -> dict:
        """JSON-ready metadata (token ids are stored apart, as an array)."""
        return {
            "id": self.id,
            "doc_id": self.doc_id,
            "index": self.index,
            "text": self.text,
            "token_start": self.token_start,
            "token_end": self.token_end,
            "char_start": self.char_start,
            "char_end": self.char_end,
        }

    @classmethod
    def from_record(cls, record: dict, token_ids: Sequence[int]) -> "Chunk":
        return cls(token_ids=tuple(int(t) for t in token_ids), **record)


def chunk_id(doc_id: str, index: int) -> str:
    """Stable chunk id: document id plus the chunk's position in it."""
    return f"{doc_id}#{index}"


def window_bounds(n_tokens: int, config: ChunkConfig) -> list[tuple[int, int]]:
    """Token ranges ``[start, end)`` of the chunks of an ``n_tokens`` document.

    Windows of ``chunk_tokens`` start every ``stride`` tokens; the last window ends at the
    document's end and may be shorter. A document of zero tokens has no chunks.
    """
    bounds: list[tuple[int, int]] = []
    start = 0
    while start < n_tokens:
        end = min(start + config.chunk_tokens, n_tokens)
        bounds.append((start, end))
        if end == n_tokens:
            break
        start += config.stride
    return bounds


def chunk_document(doc: Document, tokenizer: Tokenizer, config: ChunkConfig) -> list[Chunk]:
    """Cut one document into chunks of LLM tokens."""
    ids, offsets = _encode(tokenizer, doc.text)
    chunks = []
    for index, (start, end) in enumerate(window_bounds(len(ids), config)):
        window = ids[start:end]
        if offsets is not None:
            char_start, char_end = offsets[start][0], offsets[end - 1][1]
        else:
            char_start, char_end = len(tokenizer.decode(ids[:start])), len(tokenizer.decode(ids[:end]))
        chunks.append(
            Chunk(
                id=chunk_id(doc.id, index),
                doc_id=doc.id,
                index=index,
                text=tokenizer.decode(window),
                token_ids=tuple(window),
                token_start=start,
                token_end=end,
                char_start=char_start,
                char_end=char_end,
            )
        )
    return chunks


def chunk_documents(
    docs: Iterable[Document],
    tokenizer: Tokenizer,
    config: ChunkConfig | None = None,
    progress: bool | None = None,
) -> list[Chunk]:
    """Chunk a corpus; ``progress=None`` shows a bar from ``config.progress_min_docs`` documents.

    Raises ``EmptyInputError`` when no document yields a token.
    """
    config = config or ChunkConfig()
    docs = list(docs)
    if not docs:
        raise EmptyInputError("cannot chunk an empty corpus")
    show = len(docs) >= config.progress_min_docs if progress is None else progress
    chunks: list[Chunk] = []
    for doc in tqdm(docs, desc="chunking", unit="doc", disable=not show):
        chunks.extend(chunk_document(doc, tokenizer, config))
    if not chunks:
        raise EmptyInputError(f"the corpus's {len(docs)} documents contain no tokens")
    return chunks


def tokenizer_identity(tokenizer: Tokenizer) -> dict:
    """Name, class, vocabulary size and a content fingerprint of a tokenizer.

    The fingerprint hashes the vocabulary (when the tokenizer exposes ``get_vocab``) and
    the encoding of a fixed probe text, so two copies of one tokenizer at different paths
    match and different tokenizers do not.
    """
    digest = hashlib.sha256()
    get_vocab = getattr(tokenizer, "get_vocab", None)
    vocab_size = None
    if callable(get_vocab):
        vocab = get_vocab()
        vocab_size = len(vocab)
        digest.update(json.dumps(sorted(vocab.items()), ensure_ascii=False).encode())
    digest.update(json.dumps(list(tokenizer.encode(_FINGERPRINT_PROBE, add_special_tokens=False))).encode())
    return {
        "name": str(getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__),
        "class": type(tokenizer).__name__,
        "vocab_size": vocab_size,
        "fingerprint": digest.hexdigest(),
    }


def _encode(tokenizer: Tokenizer, text: str) -> tuple[list[int], list[tuple[int, int]] | None]:
    """Token ids of ``text`` (no special tokens) and, where the tokenizer offers them, char offsets."""
    if getattr(tokenizer, "is_fast", False) and callable(tokenizer):
        # verbose=False: documents are longer than the model's window on purpose; we cut them.
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True, verbose=False)
        return list(enc["input_ids"]), [(int(a), int(b)) for a, b in enc["offset_mapping"]]
    return list(tokenizer.encode(text, add_special_tokens=False)), None


def load_tokenizer(name_or_path: str | None = None):
    """An LLM tokenizer: the default model's (``None``/``"default"``) or a local directory / cached HF id.

    Delegates to ``cachedrag.model.loader.load_tokenizer`` (imported at call time): local files only,
    ``ModelNotFoundError`` at once when the model is not on disk.
    """
    from cachedrag.model.loader import load_tokenizer as load_model_tokenizer

    return load_model_tokenizer(name_or_path)
