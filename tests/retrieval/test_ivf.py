"""The torch IVF runtime equals Faiss IndexIVFFlat; assign/search_preassigned; ties; staged search."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cachedrag.errors import ConfigError, EmptyInputError
from cachedrag.retrieval.config import IndexConfig
from cachedrag.retrieval.ivf import (IVFIndex, effective_nlist, merge_topk, search_blocks, search_gathered, topk,
                                    train_faiss_ivf)

from .conftest import random_vectors


def _faiss_scores(ivf: IVFIndex, distances: np.ndarray) -> np.ndarray:
    return distances if ivf.metric == "ip" else -distances  # faiss reports +||q - v||^2


@pytest.mark.parametrize("nprobe", [1, 3, 8, 16])
def test_search_equals_faiss(random_ivf, queries, nprobe):
    faiss_index, ivf = random_ivf
    faiss_index.nprobe = nprobe
    D, I = faiss_index.search(queries.numpy(), 10)  # [B, 10]
    scores, ids = ivf.search(queries, 10, nprobe)  # batched: [B, 10]
    np.testing.assert_array_equal(ids.numpy(), I)
    np.testing.assert_allclose(scores.numpy(), _faiss_scores(ivf, D), rtol=1e-5, atol=1e-5)


def test_assign_equals_faiss_quantizer(random_ivf, queries):
    faiss_index, ivf = random_ivf
    _, expected = faiss_index.quantizer.search(queries.numpy(), 5)  # [B, 5]
    assert ivf.assign(queries, 5).tolist() == expected.tolist()


def test_search_preassigned_equals_faiss(random_ivf, queries):
    faiss_index, ivf = random_ivf
    # an arbitrary (not nearest) assignment: search_preassigned must search exactly these lists
    probe = torch.stack([torch.randperm(ivf.nlist, generator=torch.Generator().manual_seed(i))[:4] for i in range(len(queries))])
    faiss_index.nprobe = 4
    D, I = faiss_index.search_preassigned(queries.numpy(), 10, probe.numpy(), None)
    scores, ids = ivf.search_preassigned(queries, probe, 10)
    np.testing.assert_array_equal(ids.numpy(), I)
    np.testing.assert_allclose(scores.numpy(), _faiss_scores(ivf, D), rtol=1e-5, atol=1e-5)
    cluster_of = torch.empty(ivf.ntotal, dtype=torch.long)
    for c in range(ivf.nlist):
        cluster_of[ivf.ids[ivf.offsets[c] : ivf.offsets[c + 1]]] = c
    for row in range(len(queries)):
        assert set(cluster_of[ids[row]].tolist()) <= set(probe[row].tolist())


def test_to_faiss_round_trip(random_ivf, queries):
    faiss_index, ivf = random_ivf
    rebuilt = ivf.to_faiss()
    rebuilt.nprobe = faiss_index.nprobe = 4
    np.testing.assert_array_equal(rebuilt.search(queries.numpy(), 10)[1], faiss_index.search(queries.numpy(), 10)[1])


def test_ties_are_ordered_by_id_and_match_faiss_sets():
    base = random_vectors(40, 8, seed=3)
    x = np.concatenate([base, base, base])  # every vector three times: ids i, i+40, i+80 tie
    faiss_index = train_faiss_ivf(x, IndexConfig(nlist=4))
    ivf = IVFIndex.from_faiss(faiss_index)
    q = torch.from_numpy(random_vectors(6, 8, seed=4))
    k = 10  # ties of three: the 10th result cuts a tie group
    faiss_index.nprobe = 4
    D, I = faiss_index.search(q.numpy(), k)
    scores, ids = ivf.search(q, k, 4)
    np.testing.assert_allclose(scores.numpy(), D, rtol=1e-5, atol=1e-5)
    for row in range(len(q)):
        s, i = scores[row].tolist(), ids[row].tolist()
        assert all((s[j], -i[j]) >= (s[j + 1], -i[j + 1]) for j in range(k - 1))  # score desc, then id asc
        ours = {(round(a, 4), b % 40) for a, b in zip(s, i)}
        theirs = {(round(a, 4), b % 40) for a, b in zip(D[row].tolist(), I[row].tolist())}
        assert ours == theirs  # same vectors, whichever copy of a tie each picked
        assert i[-1] % 40 == i[-2] % 40 or i[-1] < 40  # a cut tie group keeps its lowest ids


def test_exact_search_is_brute_force(random_ivf, queries):
    _, ivf = random_ivf
    scores, ids = ivf.exact_search(queries, 5)
    full = ivf.search(queries, 5, ivf.nlist)
    np.testing.assert_array_equal(ids.numpy(), full[1].numpy())


def test_nprobe_out_of_range(random_ivf, queries):
    _, ivf = random_ivf
    with pytest.raises(ConfigError):
        ivf.search(queries, 10, ivf.nlist + 1)
    with pytest.raises(ConfigError):
        ivf.assign(queries, 0)


def test_topk_pads_short_results():
    scores = torch.tensor([[0.5, float("-inf"), 0.9]])
    s, i = topk(scores, torch.tensor([7, 8, 9]), 4)
    assert i.tolist() == [[9, 7, -1, -1]]
    assert s[0, :2].tolist() == [0.8999999761581421, 0.5] and torch.isneginf(s[0, 2:]).all()


def test_merge_topk_equals_topk_of_union():
    gen = torch.Generator().manual_seed(0)
    scores = torch.randn(3, 30, generator=gen).round(decimals=1)  # rounding plants ties
    ids = torch.randperm(30, generator=gen).expand(3, 30)
    whole = topk(scores, ids, 7)
    parts = [topk(scores[:, a:b], ids[:, a:b], 7) for a, b in [(0, 11), (11, 12), (12, 30)]]
    merged = merge_topk(parts, 7)
    assert torch.equal(merged[0], whole[0]) and torch.equal(merged[1], whole[1])


def test_search_blocks_skips_absent_clusters(random_ivf, queries):
    _, ivf = random_ivf
    probe = ivf.assign(queries, 4)
    present = ivf.blocks(probe[:, 0].unique().tolist())  # only each query's nearest cluster
    scores, ids = search_blocks(queries, probe, present, 10, ivf.metric)
    first_only = ivf.search_preassigned(queries, probe[:, :1], 10)
    # a query sees clusters it probes among the present ones: its own first, maybe others' firsts
    assert (scores >= first_only[0]).all()


def test_gathered_scoring_equals_the_per_cluster_blocks(random_ivf, queries):
    """The one-product form CUDA runs (``search_gathered``) gives the per-cluster path's top-k,
    queries probing different clusters (masked rows) included."""
    _, ivf = random_ivf
    probe = ivf.assign(queries, 5)  # [B, 5]
    wanted = probe.unique().tolist()
    blocks = ivf.blocks(wanted)
    member = (probe[:, :, None] == torch.tensor(wanted)[None, None, :]).any(dim=1)  # [B, C]
    assert not member.all()  # some rows masked for some queries
    ids = torch.cat([blocks[c].ids for c in wanted])
    got_s, got_i = search_gathered(queries, member, [blocks[c] for c in wanted], ids, 10, ivf.metric)
    want_s, want_i = search_blocks(queries, probe, blocks, 10, ivf.metric)
    torch.testing.assert_close(got_s, want_s, atol=1e-5, rtol=1e-5)
    assert torch.equal(got_i, want_i)


@pytest.mark.parametrize("n_stages", [1, 2, 3, 8, 20])
def test_staged_final_equals_plain(random_ivf, queries, n_stages):
    _, ivf = random_ivf
    stages = list(ivf.search_stages(queries, 10, 8, n_stages))
    assert len(stages) == min(n_stages, 8) and stages[-1].final and not any(s.final for s in stages[:-1])
    assert [s.clusters_searched for s in stages][-1] == 8
    scores, ids = ivf.search(queries, 10, 8)
    assert torch.equal(stages[-1].ids, ids) and torch.equal(stages[-1].scores, scores)
    best = [s.scores[:, 0] for s in stages]
    assert all((b >= a).all() for a, b in zip(best, best[1:]))  # the running top-1 only improves


def test_nlist_clamped_to_vector_count():
    x = random_vectors(5, 8, seed=0)
    with pytest.warns(UserWarning, match="nlist 16 exceeds"):
        ivf = IVFIndex.train(x, IndexConfig(nlist=16))
    assert ivf.nlist == 5
    with pytest.raises(EmptyInputError):
        effective_nlist(4, 0)
