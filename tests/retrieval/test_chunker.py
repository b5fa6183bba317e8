"""Chunk boundaries, overlap, offsets and ids; fake and real (offline) tokenizers."""

from __future__ import annotations

import pytest

from cachedrag.corpus import Document
from cachedrag.errors import ConfigError, EmptyInputError
from cachedrag.retrieval.chunker import chunk_document, chunk_documents, tokenizer_identity, window_bounds
from cachedrag.retrieval.config import ChunkConfig

from .conftest import TINY_DOCS, FakeTokenizer


@pytest.mark.parametrize(
    "n_tokens, size, overlap, expected",
    [
        (0, 4, 1, []),
        (3, 4, 1, [(0, 3)]),
        (4, 4, 1, [(0, 4)]),
        (5, 4, 1, [(0, 4), (3, 5)]),
        (7, 4, 1, [(0, 4), (3, 7)]),
        (8, 4, 1, [(0, 4), (3, 7), (6, 8)]),
        (10, 4, 0, [(0, 4), (4, 8), (8, 10)]),
        (6, 3, 2, [(0, 3), (1, 4), (2, 5), (3, 6)]),
        (1, 1, 0, [(0, 1)]),
    ],
)
def test_window_bounds(n_tokens, size, overlap, expected):
    assert window_bounds(n_tokens, ChunkConfig(chunk_tokens=size, overlap=overlap)) == expected


@pytest.mark.parametrize("size, overlap", [(8, 0), (8, 3), (16, 4), (5, 4), (1000, 10)])
def test_chunks_cover_document_with_overlap(size, overlap):
    tok = FakeTokenizer()
    doc = TINY_DOCS[0]
    ids = tok.encode(doc.text)
    chunks = chunk_document(doc, tok, ChunkConfig(chunk_tokens=size, overlap=overlap))
    assert chunks[0].token_start == 0 and chunks[-1].token_end == len(ids)
    for i, c in enumerate(chunks):
        assert c.id == f"{doc.id}#{i}" and c.doc_id == doc.id and c.index == i
        assert list(c.token_ids) == ids[c.token_start : c.token_end]
        assert len(c.token_ids) <= size
        assert c.text == tok.decode(c.token_ids)
        assert doc.text[c.char_start : c.char_end] == c.text  # round-tripping tokenizer: offsets index the text
    for a, b in zip(chunks, chunks[1:]):
        assert a.token_end - b.token_start == overlap
        assert len(a.token_ids) == size


def test_overlap_must_be_below_size():
    with pytest.raises(ConfigError):
        ChunkConfig(chunk_tokens=4, overlap=4)


def test_ids_are_stable_across_runs():
    a = chunk_documents(TINY_DOCS, FakeTokenizer(), ChunkConfig(chunk_tokens=10, overlap=2))
    b = chunk_documents(TINY_DOCS, FakeTokenizer(), ChunkConfig(chunk_tokens=10, overlap=2))
    assert [c.id for c in a] == [c.id for c in b]
    assert len({c.id for c in a}) == len(a)


def test_empty_inputs():
    with pytest.raises(EmptyInputError):
        chunk_documents([], FakeTokenizer())
    with pytest.raises(EmptyInputError):
        chunk_documents([Document("blank", "")], FakeTokenizer())


def test_progress_bar_on_request(capsys):
    chunk_documents(TINY_DOCS, FakeTokenizer(), ChunkConfig(chunk_tokens=8, overlap=0), progress=True)
    assert "chunking" in capsys.readouterr().err


def test_real_hf_tokenizer_offsets():
    """The MiniLM directory's BERT tokenizer (offline): offsets come from the fast tokenizer."""
    transformers = pytest.importorskip("transformers")
    from cachedrag.retrieval.embedder import default_embedder_path

    tok = transformers.AutoTokenizer.from_pretrained(default_embedder_path(), local_files_only=True)
    doc = TINY_DOCS[4]
    chunks = chunk_document(doc, tok, ChunkConfig(chunk_tokens=12, overlap=3))
    ids = tok.encode(doc.text, add_special_tokens=False)
    assert [t for c in chunks for t in c.token_ids[: 12 - 3 if c is not chunks[-1] else None]] == ids
    for c in chunks:
        assert c.text == tok.decode(list(c.token_ids))
        assert 0 <= c.char_start < c.char_end <= len(doc.text)
    for a, b in zip(chunks, chunks[1:]):
        assert a.char_start < b.char_start < a.char_end  # overlapping tokens overlap in the text too
    first = chunks[0]
    assert tok.encode(doc.text[first.char_start : first.char_end], add_special_tokens=False) == list(first.token_ids)


def test_tokenizer_identity_distinguishes_tokenizers():
    fake = FakeTokenizer()
    other = FakeTokenizer()
    assert tokenizer_identity(fake)["fingerprint"] == tokenizer_identity(other)["fingerprint"]
    transformers = pytest.importorskip("transformers")
    from cachedrag.retrieval.embedder import default_embedder_path

    bert = transformers.AutoTokenizer.from_pretrained(default_embedder_path(), local_files_only=True)
    ident = tokenizer_identity(bert)
    assert ident["vocab_size"] == len(bert.get_vocab())
    assert ident["fingerprint"] != tokenizer_identity(fake)["fingerprint"]


@pytest.mark.slow
def test_default_llm_tokenizer_chunks_round_trip():
    """Byte-level BPE of the default LLM: each chunk's text is exactly its offset span."""
    from cachedrag.errors import ModelNotFoundError
    from cachedrag.retrieval.chunker import load_tokenizer

    try:
        tok = load_tokenizer(None)
    except (ModelNotFoundError, ConfigError) as exc:
        pytest.skip(f"default LLM tokenizer unavailable: {exc}")
    doc = TINY_DOCS[0]
    chunks = chunk_document(doc, tok, ChunkConfig(chunk_tokens=10, overlap=2))
    assert len(chunks) > 2
    for c in chunks:
        assert doc.text[c.char_start : c.char_end] == c.text
