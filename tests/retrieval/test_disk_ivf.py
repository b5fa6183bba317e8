"""The on-disk IVF: equal to Faiss IndexIVFFlat, resumable build, staged search, IVF-PQ re-rank."""

from __future__ import annotations

import json

import faiss
import numpy as np
import pytest
import torch

from cachedrag.errors import ConfigError, CorruptCacheError
from cachedrag.retrieval.config import DiskIndexConfig
from cachedrag.retrieval.disk_ivf import ArraySource, DiskIVF, build_disk_ivf

from .conftest import random_vectors


def _config(metric="ip", **kw):
    return DiskIndexConfig(nlist=16, metric=metric, train_size=1500, block_rows=256, kmeans_iters=5, **kw)


@pytest.fixture(scope="module", params=["ip", "l2"])
def built(request, tmp_path_factory):
    x = random_vectors(2000, 32, seed=3)
    out = tmp_path_factory.mktemp("disk") / f"ivf-{request.param}"
    build_disk_ivf(ArraySource(x), out, _config(request.param, pq_m=8), progress=False)
    return x, DiskIVF.open(out, verify=True)


def test_layout_holds_every_vector_once_cluster_contiguous(built):
    x, ivf = built
    ids = np.asarray(ivf.store.ids)
    assert sorted(ids.tolist()) == list(range(len(x)))
    np.testing.assert_array_equal(np.asarray(ivf.store.vectors), x[ids])
    assert sum(ivf.cluster_sizes()) == len(x) and len(ivf.cluster_sizes()) == 16


@pytest.mark.parametrize("nprobe", [1, 4, 16])
def test_search_equals_faiss_ivfflat_at_same_nprobe(built, queries, nprobe):
    x, ivf = built
    # an independent Faiss index: same centroids, Faiss assigns and stores the vectors itself
    metric = faiss.METRIC_INNER_PRODUCT if ivf.metric == "ip" else faiss.METRIC_L2
    quantizer = faiss.IndexFlatIP(32) if ivf.metric == "ip" else faiss.IndexFlatL2(32)
    quantizer.add(ivf.quantizer.centroids.numpy())
    ref = faiss.IndexIVFFlat(quantizer, 32, 16, metric)
    ref.add(x)
    ref.nprobe = nprobe
    ref_d, ref_i = ref.search(queries.numpy(), 10)
    scores, ids = ivf.search(queries, 10, nprobe)
    np.testing.assert_array_equal(ids.numpy(), ref_i)
    expected = ref_d if ivf.metric == "ip" else -ref_d
    np.testing.assert_allclose(scores.numpy(), expected, rtol=1e-5, atol=1e-5)


def test_staged_search_ends_at_search_and_exact_search_is_brute_force(built, queries):
    x, ivf = built
    stages = list(ivf.search_stages(queries, 10, 8, n_stages=3))
    assert [s.final for s in stages] == [False, False, True]
    final_scores, final_ids = ivf.search(queries, 10, 8)
    assert torch.equal(stages[-1].ids, final_ids) and torch.equal(stages[-1].scores, final_scores)
    _, exact = ivf.exact_search(queries, 10)
    scores = queries.numpy() @ x.T if ivf.metric == "ip" else -((queries.numpy()[:, None] - x[None]) ** 2).sum(-1)
    brute = np.argsort(-scores, axis=1, kind="stable")[:, :10]
    assert (exact.numpy() == brute).mean() > 0.99  # float ties between equal scores may swap


def test_pq_shortlist_is_reranked_exactly(built, queries):
    x, ivf = built
    scores, ids = ivf.search_pq(queries, 10, nprobe=16, shortlist=100)
    q = queries.numpy()
    for row_s, row_i, qi in zip(scores.numpy(), ids.numpy(), q):
        exact = qi @ x[row_i].T if ivf.metric == "ip" else -((x[row_i] - qi) ** 2).sum(-1)
        np.testing.assert_allclose(row_s, exact, rtol=1e-5, atol=1e-5)  # exact scores, not PQ estimates
    _, truth = ivf.search(queries, 10, 16)
    recall = np.mean([len(set(a) & set(b)) / 10 for a, b in zip(ids.tolist(), truth.tolist())])
    assert recall >= 0.9


def test_mmap_reads_after_dropping_the_page_cache_are_unchanged(built, queries):
    _, ivf = built
    before = ivf.search(queries, 10, 4)
    assert ivf.store.drop_page_cache()
    after = ivf.search(queries, 10, 4)
    assert torch.equal(before[1], after[1])
    copies = ivf.store.read([0, 1])
    assert torch.equal(copies[0].vectors, ivf.store.get([0])[0].vectors)


class _Interrupt(Exception):
    pass


class _FailingSource(ArraySource):
    """Raises once after ``fail_after`` block reads of the write pass."""

    def __init__(self, x, fail_after):
        super().__init__(x)
        self.calls, self.fail_after = 0, fail_after

    def block(self, start, stop):
        self.calls += 1
        if self.calls == self.fail_after:
            raise _Interrupt
        return super().block(start, stop)


def test_interrupted_build_resumes_to_the_same_index(tmp_path):
    x = random_vectors(1500, 16, seed=4)
    config = DiskIndexConfig(nlist=8, train_size=1000, block_rows=200, kmeans_iters=4)
    ref = build_disk_ivf(ArraySource(x), tmp_path / "ref", config, progress=False)
    out = tmp_path / "idx"
    source = _FailingSource(x, fail_after=14)  # 5 training reads + 8 assign blocks + 1 write block
    with pytest.raises(_Interrupt):
        build_disk_ivf(source, out, config, progress=False)
    state = json.loads((tmp_path / "idx.partial" / "build_state.json").read_text())
    assert state["assigned"] == 8 and state.get("written", 0) == 0
    source.fail_after = -1
    reads_before = source.calls
    build_disk_ivf(source, out, config, progress=False)
    assert source.calls - reads_before == 8  # only the write pass was left: no retraining, no reassignment
    for name in ("vectors.npy", "ids.npy", "offsets.npy", "centroids.npy"):
        np.testing.assert_array_equal(np.load(out / name), np.load(ref / name))
    assert not (tmp_path / "idx.partial").exists()


def test_bad_settings_and_damaged_files(tmp_path):
    x = random_vectors(300, 16, seed=5)
    with pytest.raises(ConfigError):
        build_disk_ivf(ArraySource(x), tmp_path / "a", DiskIndexConfig(nlist=4, pq_m=5), progress=False)
    out = build_disk_ivf(ArraySource(x), tmp_path / "b", DiskIndexConfig(nlist=4, train_size=300), progress=False)
    with pytest.raises(ConfigError):
        DiskIVF.open(out).search_pq(torch.from_numpy(x[:1]), 5, 2, 10)
    with open(out / "ids.npy", "r+b") as fh:
        fh.seek(-8, 2)
        fh.write(b"\xff" * 8)
    with pytest.raises(CorruptCacheError):
        DiskIVF.open(out, verify=True)
    (out / "ids.npy").write_bytes(b"short")
    with pytest.raises(CorruptCacheError):
        DiskIVF.open(out)
