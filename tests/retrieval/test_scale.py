"""The scale corpus: deterministic distractors around real vectors, a text for every row."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch

from cachedrag.retrieval.config import DiskIndexConfig
from cachedrag.retrieval.disk_ivf import DiskIVF, build_disk_ivf
from cachedrag.retrieval.lookahead import LookaheadRetriever
from cachedrag.retrieval.cluster_store import MemoryClusterStore
from cachedrag.retrieval.scale import GROUP_ROWS, DistractorConfig, DistractorSource, ScaleIndex

from .conftest import random_vectors


def _source(n=GROUP_ROWS * 2 + 100):
    return DistractorSource(random_vectors(50, 16, seed=7), DistractorConfig(ntotal=n, seed=3))


def test_rows_are_deterministic_whatever_the_block_split():
    src = _source()
    whole = src.block(0, src.ntotal)
    parts = np.concatenate([src.block(s, min(s + 1000, src.ntotal)) for s in range(0, src.ntotal, 1000)])
    np.testing.assert_array_equal(whole, parts)
    np.testing.assert_array_equal(_source().block(4000, 8000), whole[4000:8000])
    np.testing.assert_array_equal(whole[:50], src.real)  # real rows first
    np.testing.assert_allclose(np.linalg.norm(whole, axis=1), 1.0, rtol=1e-5)


def test_distractors_lie_near_their_first_parent():
    src = _source()
    rows = np.arange(50, 2050)
    x, parents = src.block(50, 2050), src.parents(rows)
    own = (x * src.real[parents]).sum(1)  # cosine to the first parent
    other = (x * src.real[(parents + 1) % 50]).sum(1)
    assert np.median(own) > 0.35 and (own > other).mean() > 0.8
    assert src.parents([3])[0] == 3


def test_scale_index_texts_and_lookahead_over_mmap_tier(tmp_path):
    src = _source(3000)
    chunks = [SimpleNamespace(id=f"doc#{i}", text=f"chunk text {i}") for i in range(50)]
    out = build_disk_ivf(src, tmp_path / "ivf", DiskIndexConfig(nlist=8, train_size=3000), progress=False)
    index = ScaleIndex(tmp_path, SimpleNamespace(chunks=chunks), DiskIVF.open(out), src)
    assert index.text(7) == "chunk text 7"
    parent = int(src.parents([2000])[0])
    assert index.text(2000) == f"[near-duplicate of doc#{parent}, variant 2000]\nchunk text {parent}"
    ivf = index.ivf
    retriever = LookaheadRetriever(ivf.quantizer, ivf.store, MemoryClusterStore(), ivf.cluster_nbytes())
    q = torch.from_numpy(src.block(2000, 2003))
    retriever.prefetch(q[0]).wait()
    assert retriever.fast.nbytes() > 0
    held = retriever.fast.get(retriever.fast.cluster_ids())
    assert all(b.vectors.untyped_storage().data_ptr() != ivf.store.vectors.ctypes.data for b in held.values())
    result = retriever.search(q, k=5, nprobe=4)
    expected = ivf.search(q, 5, 4)
    assert torch.equal(result.ids, expected[1])
    retriever.close()


def test_scale_index_hits_name_every_row(tmp_path):
    from cachedrag.retrieval.chunker import Chunk

    src = _source(3000)
    chunks = [Chunk(f"doc#{i}", "doc", i, f"chunk text {i}", (i,), 0, 1, 0, 12) for i in range(50)]
    out = build_disk_ivf(src, tmp_path / "ivf", DiskIndexConfig(nlist=8, train_size=3000), progress=False)
    index = ScaleIndex(tmp_path, SimpleNamespace(chunks=chunks), DiskIVF.open(out), src)
    scores, ids = index.ivf.search(torch.from_numpy(src.block(2000, 2002)), 5, 8)  # distractor queries
    hits = index.hits(scores, ids)
    assert [[h.row for h in row] for row in hits] == ids.tolist()
    for row in hits:
        for h in row:
            assert h.chunk.text == index.text(h.row)
            assert h.chunk.id == (f"doc#{h.row}" if h.row < 50 else f"scale/{h.row}")
    assert any(h.row >= 50 for row in hits for h in row)  # distractors were found and named
