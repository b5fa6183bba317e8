"""Lookahead prefetch + tiered search: same results as plain IVF, budget kept, hook called."""

from __future__ import annotations

import threading

import pytest
import torch

from cachedrag.errors import ConfigError
from cachedrag.retrieval.cluster_store import MemoryClusterStore
from cachedrag.retrieval.config import LookaheadConfig, SearchConfig
from cachedrag.retrieval.ivf import search_blocks
from cachedrag.retrieval.lookahead import LookaheadRetriever

from .conftest import save_clusters

NPROBE = 6


@pytest.fixture
def make_retriever(random_ivf, tmp_path):
    made = []

    def make(budget_bytes: int, on_candidates=None, candidate_chunks: int = 3) -> LookaheadRetriever:
        _, ivf = random_ivf
        disk = save_clusters(ivf, tmp_path)
        retriever = LookaheadRetriever(
            ivf.quantizer,
            disk,
            MemoryClusterStore("cpu"),
            ivf.cluster_nbytes(),
            config=LookaheadConfig(budget_bytes=budget_bytes, candidate_chunks=candidate_chunks),
            search_config=SearchConfig(k=10, nprobe=NPROBE),
            chunk_ids=[f"chunk-{i}" for i in range(ivf.ntotal)],
            on_candidates=on_candidates,
        )
        made.append((retriever, disk))
        return retriever

    yield make
    for retriever, disk in made:
        retriever.close()
        disk.close()


def _budgets(ivf):
    sizes = ivf.cluster_nbytes()
    return [0, min(sizes), sum(sorted(sizes)[: ivf.nlist // 2]), sum(sizes)]


@pytest.mark.parametrize("budget_index", [0, 1, 2, 3])
def test_prefetch_then_search_equals_plain_search(random_ivf, make_retriever, queries, budget_index):
    _, ivf = random_ivf
    retriever = make_retriever(_budgets(ivf)[budget_index])
    for i in range(0, len(queries) - 1, 2):
        original, transformed = queries[i], queries[i + 1]  # unrelated: the worst case for overlap
        retriever.prefetch(original).wait()
        result = retriever.search(transformed)
        scores, ids = ivf.search(transformed[None], 10, NPROBE)
        assert torch.equal(result.ids, ids)
        torch.testing.assert_close(result.scores, scores)
        assert len(result.hit_clusters) + len(result.missed_clusters) == len(set(result.probe[0].tolist()))
    # a prefetch for the query itself makes every probed cluster a hit when the budget allows
    handle = retriever.prefetch(queries[0])
    handle.wait()
    result = retriever.search(queries[0])
    if budget_index == 3:
        assert result.hit_rate == 1.0 and not result.missed_clusters
    if budget_index == 0:
        assert result.hit_rate == 0.0 and not result.hit_clusters


def test_batched_search_equals_plain(random_ivf, make_retriever, queries):
    _, ivf = random_ivf
    retriever = make_retriever(_budgets(ivf)[2])
    retriever.prefetch(queries[0]).wait()
    result = retriever.search(queries)
    assert torch.equal(result.ids, ivf.search(queries, 10, NPROBE)[1])


@pytest.mark.parametrize("budget_index", [1, 2, 3])
def test_budget_respected_with_whole_clusters(random_ivf, make_retriever, queries, budget_index):
    _, ivf = random_ivf
    budget = _budgets(ivf)[budget_index]
    retriever = make_retriever(budget)
    sizes = ivf.cluster_nbytes()
    for q in queries[:4]:  # consecutive prefetches evict what the new plan does not keep
        report = retriever.prefetch(q).wait()
        assert retriever.fast.nbytes() <= budget
        assert set(retriever.fast.cluster_ids()) == set(report.clusters)
        for cid, block in retriever.fast.get(report.clusters).items():
            assert block.nbytes == sizes[cid]  # whole clusters only
        order = ivf.quantizer.order(q[None])[0].tolist()
        assert list(report.clusters) == order[: len(report.clusters)]  # nearest centroids first
        nxt = order[len(report.clusters)] if len(report.clusters) < ivf.nlist else None
        assert nxt is None or report.planned_bytes + sizes[nxt] > budget  # stopped where the next did not fit


def test_resident_clusters_are_not_copied_again(random_ivf, make_retriever, queries):
    _, ivf = random_ivf
    retriever = make_retriever(sum(ivf.cluster_nbytes()))
    first = retriever.prefetch(queries[0]).wait()
    second = retriever.prefetch(queries[0]).wait()
    assert len(first.copied) == ivf.nlist and second.copied == () and second.copied_bytes == 0


def test_on_candidates_gets_top_chunks_of_prefetched_clusters(random_ivf, make_retriever, queries):
    _, ivf = random_ivf
    seen: list[list[str]] = []
    retriever = make_retriever(_budgets(ivf)[2], on_candidates=seen.append, candidate_chunks=3)
    report = retriever.prefetch(queries[0]).wait()
    probe = torch.tensor([list(report.clusters)])
    _, ids = search_blocks(queries[:1], probe, ivf.blocks(report.clusters), 3, ivf.metric)
    expected = [f"chunk-{i}" for i in ids[0].tolist()]
    assert seen == [expected] and list(report.candidates) == expected


def test_hook_error_is_reported_not_swallowed(random_ivf, make_retriever, queries):
    _, ivf = random_ivf

    def broken(_ids):
        raise RuntimeError("engine is down")

    retriever = make_retriever(_budgets(ivf)[3], on_candidates=broken)
    handle = retriever.prefetch(queries[0])
    with pytest.raises(RuntimeError, match="engine is down"):
        handle.wait()
    result = retriever.search(queries[1])
    assert result.prefetch_error == "RuntimeError: engine is down"
    assert torch.equal(result.ids, ivf.search(queries[1:2], 10, NPROBE)[1])  # results still complete


def test_search_during_prefetch_is_correct(random_ivf, make_retriever, queries):
    _, ivf = random_ivf
    gate = threading.Event()

    class SlowDisk:  # delays each read so the search overtakes the prefetch
        def __init__(self, inner):
            self.inner = inner

        def __getattr__(self, name):
            return getattr(self.inner, name)

        def get(self, cluster_ids):
            if len(cluster_ids) == 1:
                gate.wait(0.05)
            return self.inner.get(cluster_ids)

    retriever = make_retriever(sum(ivf.cluster_nbytes()))
    retriever.slow = SlowDisk(retriever.slow)
    handle = retriever.prefetch(queries[0])
    result = retriever.search(queries[1])  # cancels the prefetch (default config)
    report = handle.wait()
    assert report.cancelled and len(report.copied) < ivf.nlist
    assert torch.equal(result.ids, ivf.search(queries[1:2], 10, NPROBE)[1])


@pytest.mark.parametrize("n_stages", [1, 2, 4])
def test_staged_search_over_tiers_ends_at_plain_search(random_ivf, make_retriever, queries, n_stages):
    _, ivf = random_ivf
    retriever = make_retriever(_budgets(ivf)[2])
    retriever.prefetch(queries[0]).wait()
    stages = list(retriever.search_stages(queries[:3], n_stages))
    assert len(stages) == n_stages and stages[-1].final
    assert torch.equal(stages[-1].ids, retriever.search(queries[:3]).ids)


def test_nprobe_above_nlist_is_a_config_error(random_ivf, make_retriever, queries):
    _, ivf = random_ivf
    retriever = make_retriever(0)
    with pytest.raises(ConfigError):
        retriever.search(queries[0], nprobe=ivf.nlist + 1)


def test_text_query_without_embedder_is_a_config_error(make_retriever):
    with pytest.raises(ConfigError):
        make_retriever(0).search("what is a heap?")


def test_profile_budget(random_ivf, make_retriever):
    _, ivf = random_ivf
    retriever = make_retriever(0)
    bandwidth = retriever.measure_bandwidth(n_clusters=4)
    assert bandwidth.nbytes == sum(s for s in ivf.cluster_nbytes()[:4]) and bandwidth.bytes_per_s > 0
    budget = retriever.profile_budget([0.01, 0.03], bandwidth)
    assert budget == int(bandwidth.bytes_per_s * 0.02) == retriever.config.budget_bytes


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_tiers_match_plain_search(random_ivf, queries):
    from cachedrag.retrieval.cluster_store import make_tiers

    _, ivf = random_ivf
    slow, fast = make_tiers(ivf, None, "cuda")
    config = LookaheadConfig(budget_bytes=sum(ivf.cluster_nbytes()) // 2)
    with LookaheadRetriever(ivf.quantizer, slow, fast, ivf.cluster_nbytes(), config=config,
                            search_config=SearchConfig(k=10, nprobe=NPROBE)) as retriever:
        retriever.prefetch(queries[0]).wait()
        assert fast.cluster_ids() and fast.nbytes() <= config.budget_bytes
        result = retriever.search(queries)
        scores, ids = ivf.search(queries, 10, NPROBE)
        torch.testing.assert_close(result.scores, scores, rtol=1e-4, atol=1e-4)  # GPU rounding may swap near-ties
        assert (result.ids == ids).float().mean() > 0.95
