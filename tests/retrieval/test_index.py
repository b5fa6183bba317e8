"""Index build, save/load round trip, mismatch and corruption errors, text search."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from cachedrag.corpus import Document
from cachedrag.errors import ConfigError, CorruptCacheError, EmptyInputError, IndexMismatchError
from cachedrag.retrieval.config import ChunkConfig, IndexConfig, RetrievalConfig
from cachedrag.retrieval.embedder import Embedder
from cachedrag.retrieval.index import build_index, load_index
from cachedrag.retrieval.lookahead import LookaheadRetriever

from .conftest import TINY_DOCS, TINY_QUESTIONS, FakeTokenizer


def _stub_embedder(name: str, dim: int) -> Embedder:
    stub = object.__new__(Embedder)  # no model load: only the identity is compared
    stub.name, stub.dim = name, dim
    return stub


def test_embedder_records_model_and_normalises(embedder):
    assert embedder.name == "sentence-transformers/all-MiniLM-L6-v2" and embedder.dim == 384
    vectors = embedder.encode(["hello world", "heap queue"])
    assert vectors.dtype == np.float32 and vectors.shape == (2, 384)
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, rtol=1e-5)
    with pytest.raises(EmptyInputError):
        embedder.encode([])


def test_manifest_records_build_settings(tiny_index):
    m = tiny_index.manifest
    assert (m.embedder, m.dim, m.metric, m.nlist) == ("sentence-transformers/all-MiniLM-L6-v2", 384, "ip", 4)
    assert (m.chunk.chunk_tokens, m.chunk.overlap, m.n_docs) == (16, 4, len(TINY_DOCS))
    assert m.tokenizer["class"] == "FakeTokenizer" and len(m.tokenizer["fingerprint"]) == 64
    on_disk = json.loads((tiny_index.path / "manifest.json").read_text())
    assert set(on_disk["files"]) == {"chunks.jsonl", "token_ids.npy", "token_offsets.npy", "centroids.npy",
                                     "vectors.npy", "ids.npy", "offsets.npy"}
    assert not list(tiny_index.path.glob("*.pkl"))


def test_save_load_round_trip(tiny_index, embedder):
    loaded = load_index(tiny_index.path, embedder=embedder)
    assert loaded.manifest == tiny_index.manifest
    assert loaded.chunks == tiny_index.chunks  # ids, texts, token ids, offsets
    for name in ("vectors", "ids", "offsets"):
        assert torch.equal(getattr(loaded.ivf, name), getattr(tiny_index.ivf, name))
    assert torch.equal(loaded.ivf.quantizer.centroids, tiny_index.ivf.quantizer.centroids)
    a = tiny_index.search(TINY_QUESTIONS, k=3, nprobe=2)
    b = loaded.search(TINY_QUESTIONS, k=3, nprobe=2)
    assert [[h.chunk.id for h in row] for row in a] == [[h.chunk.id for h in row] for row in b]


def test_text_search_finds_the_right_document(tiny_index):
    hits = tiny_index.search(TINY_QUESTIONS, k=3, nprobe=tiny_index.ivf.nlist)
    assert [row[0].chunk.doc_id for row in hits] == ["json", "heapq", "hashlib", "uuid"]
    assert all(row[0].score >= row[1].score for row in hits)


def test_staged_text_search_final_equals_plain(tiny_index):
    stages = list(tiny_index.search_stages(TINY_QUESTIONS, k=3, nprobe=4, n_stages=2))
    plain = tiny_index.search(TINY_QUESTIONS, k=3, nprobe=4)
    assert stages[-1][0].final
    assert [[h.row for h in r] for r in stages[-1][1]] == [[h.row for h in r] for r in plain]


def test_lookahead_from_index_with_text_queries(tiny_index):
    seen = []
    with LookaheadRetriever.from_index(tiny_index, device="cpu", on_candidates=seen.append) as retriever:
        retriever.prefetch("How do I pretty-print JSON?").wait()
        result = retriever.search("json.dumps indent pretty print", k=3, nprobe=2)
        expected = tiny_index.ivf.search(tiny_index.embed("json.dumps indent pretty print"), 3, 2)
        assert torch.equal(result.ids, expected[1])
        assert seen and all(cid in tiny_index.chunk_ids for cid in seen[0])


@pytest.mark.parametrize("name, dim", [("other/model", 384), ("sentence-transformers/all-MiniLM-L6-v2", 768)])
def test_embedder_mismatch(tiny_index, name, dim):
    with pytest.raises(IndexMismatchError):
        load_index(tiny_index.path, embedder=_stub_embedder(name, dim))
    fresh = load_index(tiny_index.path)
    with pytest.raises(IndexMismatchError):
        fresh.attach_embedder(_stub_embedder(name, dim))


def test_query_dimension_mismatch(tiny_index):
    with pytest.raises(IndexMismatchError):
        tiny_index.search(torch.zeros(1, 10), k=1, nprobe=1)


def test_tokenizer_mismatch(tiny_index):
    tiny_index.check_tokenizer(FakeTokenizer())

    class Other(FakeTokenizer):
        def encode(self, text, add_special_tokens=False):
            return [i + 1 for i in super().encode(text)]

    with pytest.raises(IndexMismatchError):
        tiny_index.check_tokenizer(Other())


def test_nprobe_above_nlist(tiny_index):
    with pytest.raises(ConfigError):
        tiny_index.search("heap", k=1, nprobe=tiny_index.ivf.nlist + 1)


def test_empty_corpus(embedder, tmp_path):
    with pytest.raises(EmptyInputError):
        build_index([], FakeTokenizer(), embedder)
    with pytest.raises(EmptyInputError):
        build_index([Document("a", "")], FakeTokenizer(), embedder)
    from cachedrag.corpus import load_corpus

    (tmp_path / "empty").mkdir()
    with pytest.raises(EmptyInputError):
        load_corpus(tmp_path / "empty")


def test_nlist_above_chunk_count_is_clamped(embedder):
    config = RetrievalConfig(chunk=ChunkConfig(chunk_tokens=64, overlap=0), index=IndexConfig(nlist=50))
    with pytest.warns(UserWarning, match="exceeds the number of chunks"):
        index = build_index(TINY_DOCS[:2], FakeTokenizer(), embedder, config)
    assert index.manifest.nlist == index.manifest.n_chunks < 50 and index.manifest.nlist_requested == 50


def test_corrupt_file_fails_checksum(tiny_index, tmp_path):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(tiny_index.path, copy)
    data = bytearray((copy / "vectors.npy").read_bytes())
    data[-1] ^= 0xFF
    (copy / "vectors.npy").write_bytes(bytes(data))
    with pytest.raises(CorruptCacheError):
        load_index(copy)
    load_index(copy, verify=False)  # explicit opt-out still loads


def test_save_refuses_foreign_directory(tiny_index, tmp_path):
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError):
        tiny_index.save(foreign)


def test_save_replaces_an_index(tiny_index, tmp_path):
    out = tmp_path / "idx"
    path = tiny_index.save(out)
    path = tiny_index.save(out)  # second save replaces the first atomically
    assert load_index(path).manifest.n_chunks == tiny_index.manifest.n_chunks
    assert sorted(p.name for p in tmp_path.iterdir()) == ["idx"]  # no temp dirs left
