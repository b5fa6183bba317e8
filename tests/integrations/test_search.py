"""Index search for the retrievers: combined queries, registration, prefetch, shared per directory."""

from __future__ import annotations

import pytest
import torch

from cachedrag.prompt.registry import ChunkRegistry
from cachedrag.integrations.search import IndexSearcher, shared_searcher


@pytest.fixture(scope="module")
def searcher(tiny_index_dir):
    s = IndexSearcher(tiny_index_dir, ChunkRegistry())
    yield s
    s.close()


def test_single_query_equals_plain_ivf_search(searcher):
    hits = searcher.search("How do I pretty-print JSON?", k=3)
    nprobe = min(16, searcher.nlist)
    plain = searcher.index.search("How do I pretty-print JSON?", k=3, nprobe=nprobe)[0]
    assert [h.chunk_id for h in hits] == [h.chunk.id for h in plain]
    assert hits[0].doc_id == "json" and hits[0].rank == 0
    assert hits[0].metadata()["chunk_id"] == hits[0].chunk_id


def test_several_texts_search_the_renormalised_mean(searcher):
    texts = ["json.dumps with indent", "a random UUID from uuid4"]
    q = torch.nn.functional.normalize(torch.from_numpy(searcher.index.embedder.encode(texts)), dim=-1)  # [2, d]
    mean = torch.nn.functional.normalize(q.mean(0, keepdim=True), dim=-1)  # [1, d]
    assert torch.allclose(searcher.query_vector(texts), mean, atol=1e-6)
    expected = searcher.index.search(mean, k=4, nprobe=searcher.nlist)[0]
    assert [h.chunk_id for h in searcher.search(texts, k=4)] == [h.chunk.id for h in expected]


def test_results_are_registered(searcher):
    hits = searcher.search("SHA-256 digest", k=2)
    assert all(h.text in searcher.registry for h in hits)


def test_prefetch_once_per_query(searcher):
    assert searcher.prefetch("What does heappush do?") is True
    assert searcher.prefetch("What does heappush do?") is False
    assert searcher.last_prefetch_query == "What does heappush do?"
    assert searcher.prefetch("   ") is False
    hits = searcher.search("heappush maintains the heap invariant", k=2)
    assert hits[0].doc_id == "heapq"


def test_empty_query_rejected(searcher):
    with pytest.raises(ValueError):
        searcher.search(["", "  "], k=2)


def test_shared_per_directory(tiny_index_dir, tmp_path):
    assert shared_searcher(tiny_index_dir) is shared_searcher(str(tiny_index_dir) + "/")
    with pytest.raises(FileNotFoundError):
        shared_searcher(tmp_path)
