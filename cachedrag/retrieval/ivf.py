"""The IVF-Flat index as torch tensors, and the search kernels the tiers share.

Owns: ``ClusterBlock`` (one cluster's vectors and ids), scoring (``similarity``), the result
order (score descending, then id ascending, padded with ``-inf``/``-1``), ``search_blocks``
over any set of cluster blocks, staged search, the ``Quantizer`` (centroids, ``assign``) and
``IVFIndex`` (all clusters in memory, contiguous per cluster; equal to Faiss
``IndexIVFFlat`` at the same nprobe), plus training through Faiss and conversion both ways.
Does not own: where clusters live (``cluster_store``) or which ones to prefetch (``policy``).

Scores are similarities, higher is better: the inner product for metric ``"ip"``, the
negated squared L2 distance for ``"l2"`` (Faiss reports the positive distance).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from cachedrag.errors import ConfigError, EmptyInputError
from cachedrag.retrieval.config import IndexConfig, Metric
from cachedrag.retrieval.policy import stage_bounds

PAD_ID = -1


@dataclass(frozen=True)
class ClusterBlock:
    """One IVF cluster: its vectors and their ids, on one device."""

    vectors: torch.Tensor  # [n, d] float32
    ids: torch.Tensor  # [n] int64

    def __post_init__(self) -> None:
        assert self.vectors.dim() == 2 and self.ids.dim() == 1, (self.vectors.shape, self.ids.shape)
        assert self.vectors.shape[0] == self.ids.shape[0], (self.vectors.shape, self.ids.shape)

    @property
    def nbytes(self) -> int:
        return self.vectors.numel() * self.vectors.element_size() + self.ids.numel() * self.ids.element_size()

    @property
    def device(self) -> torch.device:
        return self.vectors.device

    def to(self, device: torch.device | str, non_blocking: bool = False) -> "ClusterBlock":
        return ClusterBlock(self.vectors.to(device, non_blocking=non_blocking), self.ids.to(device, non_blocking=non_blocking))


@dataclass(frozen=True)
class Stage:
    """The top-k after one stage of a staged search."""

    index: int  # 0-based stage number
    clusters_searched: int  # probed clusters covered so far (per query)
    scores: torch.Tensor  # [B, k]
    ids: torch.Tensor  # [B, k]
    final: bool


def check_nprobe(nprobe: int, nlist: int) -> None:
    """Raise ``ConfigError`` unless 1 <= nprobe <= nlist."""
    if not 1 <= nprobe <= nlist:
        raise ConfigError(f"nprobe ({nprobe}) must be between 1 and the index's nlist ({nlist})")


def similarity(q: torch.Tensor, v: torch.Tensor, metric: Metric) -> torch.Tensor:
    """Scores of queries ``q [B, d]`` against vectors ``v [n, d]`` -> ``[B, n]`` (higher is better)."""
    ip = q @ v.T  # [B, n]
    if metric == "ip":
        return ip
    return -((q * q).sum(1, keepdim=True) - 2 * ip + (v * v).sum(1)[None, :])  # [B, n] = -||q - v||^2


def topk(scores: torch.Tensor, ids: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Best ``k`` of ``scores [B, M]`` with ``ids [M]`` or ``[B, M]``, ordered by (score desc, id asc).

    Rows with fewer than ``k`` finite scores are padded with ``-inf`` and id ``-1``.
    """
    B, M = scores.shape
    ids = ids.expand(B, M) if ids.dim() == 1 else ids  # [B, M]
    by_id = torch.argsort(ids, dim=1, stable=True)  # [B, M]
    scores, ids = scores.gather(1, by_id), ids.gather(1, by_id)  # [B, M], [B, M]
    order = torch.sort(scores, dim=1, descending=True, stable=True).indices[:, :k]  # [B, min(k, M)]
    top_scores, top_ids = scores.gather(1, order), ids.gather(1, order)  # [B, min(k, M)]
    top_ids = top_ids.masked_fill(torch.isneginf(top_scores), PAD_ID)
    if top_scores.shape[1] < k:
        pad = k - top_scores.shape[1]
        top_scores = torch.cat([top_scores, top_scores.new_full((B, pad), float("-inf"))], dim=1)  # [B, k]
        top_ids = torch.cat([top_ids, top_ids.new_full((B, pad), PAD_ID)], dim=1)  # [B, k]
    return top_scores, top_ids


def merge_topk(parts: Sequence[tuple[torch.Tensor, torch.Tensor]], k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge per-part results ``(scores [B, k_i], ids [B, k_i])`` into one top-k (all on one device)."""
    scores = torch.cat([s for s, _ in parts], dim=1)  # [B, sum k_i]
    ids = torch.cat([i for _, i in parts], dim=1)  # [B, sum k_i]
    return topk(scores, ids, k)


def empty_result(batch: int, k: int, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """A result with no hit: ``-inf`` scores and ``-1`` ids, ``[B, k]`` each."""
    return (
        torch.full((batch, k), float("-inf"), device=device),
        torch.full((batch, k), PAD_ID, dtype=torch.int64, device=device),
    )


def search_blocks(
    q: torch.Tensor, probe: torch.Tensor, blocks: Mapping[int, ClusterBlock], k: int, metric: Metric
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k of each query over the clusters it probes that are among ``blocks``.

    ``q [B, d]`` and ``probe [B, P]`` (cluster ids) must be on the blocks' device; clusters
    of ``probe`` missing from ``blocks`` are skipped (another tier searches them). Each
    cluster is scored as its own block, so any split of the clusters over calls or tiers
    gives bit-identical scores (on the CPU; on CUDA the probed clusters are gathered and scored
    in one product, whose rounding may depend on how many there are).
    """
    B = q.shape[0]
    assert q.dim() == 2 and probe.shape[0] == B, (q.shape, probe.shape)
    wanted = [c for c in torch.unique(probe).tolist() if c in blocks]
    if not wanted:
        return empty_result(B, k, q.device)
    cids = torch.tensor(wanted, device=probe.device)  # [C]
    member = (probe[:, :, None] == cids[None, None, :]).any(dim=1)  # [B, C] query b probes cluster j
    ids = torch.cat([blocks[c].ids for c in wanted])  # [M]
    if q.is_cuda:  # one product over the gathered clusters: a launch per cluster costs more than its math
        return search_gathered(q, member, [blocks[c] for c in wanted], ids, k, metric)
    probed_by_all = member.all(dim=0).tolist()  # [C] no mask needed (always so for B = 1)
    parts = []
    for j, cid in enumerate(wanted):
        s = similarity(q, blocks[cid].vectors, metric)  # [B, n_j]
        parts.append(s if probed_by_all[j] else s.masked_fill(~member[:, j : j + 1], float("-inf")))
    scores = torch.cat(parts, dim=1)  # [B, M]
    return topk(scores, ids, k)


def search_gathered(q: torch.Tensor, member: torch.Tensor, blocks: list[ClusterBlock], ids: torch.Tensor, k: int,
                    metric: Metric) -> tuple[torch.Tensor, torch.Tensor]:
    """``search_blocks``' scoring as one product: ``blocks`` (C clusters, ``ids [M]`` their rows in
    order) gathered, scored for every query ``q [B, d]``, rows of clusters query b does not probe
    (``member [B, C]`` false) masked out. What CUDA runs (a launch per cluster costs more than its math)."""
    scores = similarity(q, torch.cat([b.vectors for b in blocks]), metric)  # [B, M]
    sizes = torch.tensor([b.ids.shape[0] for b in blocks], device=q.device)  # [C]
    visible = member.repeat_interleave(sizes, dim=1)  # [B, M]
    return topk(scores.masked_fill(~visible, float("-inf")), ids, k)


def staged_search(
    q: torch.Tensor,
    probe: torch.Tensor,
    k: int,
    metric: Metric,
    fetch: Callable[[list[int]], Mapping[int, ClusterBlock]],
    n_stages: int,
) -> Iterator[Stage]:
    """Search ``probe [B, P]`` in centroid order, yielding the running top-k after each stage.

    Stage ``s`` covers probe columns ``stage_bounds(P, n_stages)[s]`` (more stages than
    probed clusters gives one per cluster); ``fetch(cluster_ids)`` returns their blocks on
    ``q``'s device. The last stage equals ``search_blocks`` over all probed clusters.
    """
    best = None
    bounds = stage_bounds(probe.shape[1], n_stages)
    for s, (start, stop) in enumerate(bounds):
        group = probe[:, start:stop]  # [B, g]
        part = search_blocks(q, group, fetch(torch.unique(group).tolist()), k, metric)
        best = part if best is None else merge_topk([best, part], k)
        yield Stage(index=s, clusters_searched=stop, scores=best[0], ids=best[1], final=s == len(bounds) - 1)


class Quantizer:
    """IVF centroids ``[nlist, d]`` and the assignment of queries to clusters."""

    def __init__(self, centroids: torch.Tensor, metric: Metric):
        assert centroids.dim() == 2, centroids.shape
        self.centroids = centroids.float().contiguous()  # [nlist, d]
        self.metric = metric

    @property
    def nlist(self) -> int:
        return self.centroids.shape[0]

    @property
    def dim(self) -> int:
        return self.centroids.shape[1]

    def order(self, q: torch.Tensor, n: int | None = None) -> torch.Tensor:
        """Clusters nearest first (ties: lower cluster id first) -> ``[B, n]`` int64."""
        assert q.dim() == 2 and q.shape[1] == self.dim, (q.shape, self.dim)
        s = similarity(q.to(self.centroids.device), self.centroids, self.metric)  # [B, nlist]
        order = torch.sort(s, dim=1, descending=True, stable=True).indices  # [B, nlist]
        return order[:, : n or self.nlist]

    def assign(self, q: torch.Tensor, nprobe: int) -> torch.Tensor:
        """The ``nprobe`` clusters each query probes, nearest first -> ``[B, nprobe]`` int64."""
        check_nprobe(nprobe, self.nlist)
        return self.order(q, nprobe)


class IVFIndex:
    """IVF-Flat with every cluster in memory: contiguous rows per cluster.

    ``vectors [N, d]`` are sorted by cluster; cluster ``c`` is rows
    ``offsets[c]:offsets[c + 1]`` with ids ``ids[offsets[c]:offsets[c + 1]]``.
    """

    def __init__(
        self, centroids: torch.Tensor, vectors: torch.Tensor, ids: torch.Tensor, offsets: torch.Tensor, metric: Metric
    ):
        self.quantizer = Quantizer(centroids, metric)
        self.vectors = vectors  # [N, d] float32, cluster-contiguous
        self.ids = ids  # [N] int64
        self.offsets = offsets  # [nlist + 1] int64
        self.metric = metric
        assert vectors.dim() == 2 and vectors.shape[1] == self.quantizer.dim, (vectors.shape, centroids.shape)
        assert ids.shape == (vectors.shape[0],), (ids.shape, vectors.shape)
        assert offsets.shape == (self.nlist + 1,) and int(offsets[-1]) == vectors.shape[0], (offsets.shape, vectors.shape)

    @property
    def nlist(self) -> int:
        return self.quantizer.nlist

    @property
    def dim(self) -> int:
        return self.quantizer.dim

    @property
    def ntotal(self) -> int:
        return self.vectors.shape[0]

    def cluster_sizes(self) -> list[int]:
        return (self.offsets[1:] - self.offsets[:-1]).tolist()

    def cluster_nbytes(self) -> list[int]:
        """Bytes of each cluster's block (vectors + ids), as a prefetch moves them."""
        row = self.dim * self.vectors.element_size() + self.ids.element_size()
        return [n * row for n in self.cluster_sizes()]

    def block(self, cid: int) -> ClusterBlock:
        start, stop = int(self.offsets[cid]), int(self.offsets[cid + 1])
        return ClusterBlock(self.vectors[start:stop], self.ids[start:stop])  # views, no copy

    def blocks(self, cluster_ids: Sequence[int]) -> dict[int, ClusterBlock]:
        return {int(c): self.block(int(c)) for c in cluster_ids}

    def assign(self, q: torch.Tensor, nprobe: int) -> torch.Tensor:
        """Cluster ids probed per query, nearest first: ``q [B, d]`` -> ``[B, nprobe]``."""
        return self.quantizer.assign(q, nprobe)

    def search_preassigned(self, q: torch.Tensor, probe: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k over given clusters: ``q [B, d]``, ``probe [B, P]`` -> ``(scores [B, k], ids [B, k])``."""
        return search_blocks(q, probe, self.blocks(torch.unique(probe).tolist()), k, self.metric)

    def search(self, q: torch.Tensor, k: int, nprobe: int) -> tuple[torch.Tensor, torch.Tensor]:
        """IVF search: ``assign`` then ``search_preassigned``."""
        return self.search_preassigned(q, self.assign(q, nprobe), k)

    def search_stages(self, q: torch.Tensor, k: int, nprobe: int, n_stages: int) -> Iterator[Stage]:
        """Running top-k after each group of probed clusters; the last equals ``search``."""
        return staged_search(q, self.assign(q, nprobe), k, self.metric, self.blocks, n_stages)

    def exact_search(self, q: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Brute-force top-k over every vector (the recall reference)."""
        return topk(similarity(q, self.vectors, self.metric), self.ids, k)

    @classmethod
    def train(cls, vectors: np.ndarray, config: IndexConfig) -> "IVFIndex":
        """Train centroids with Faiss k-means and fill the lists (``vectors [N, d]``, id = row)."""
        return cls.from_faiss(train_faiss_ivf(vectors, config))

    @classmethod
    def from_faiss(cls, index) -> "IVFIndex":
        """Copy a Faiss ``IndexIVFFlat``'s centroids and inverted lists."""
        import faiss
        from faiss.contrib.inspect_tools import get_invlist

        ivf = faiss.extract_index_ivf(index)  # keep ``index`` alive: it owns the quantizer
        metric: Metric = "ip" if ivf.metric_type == faiss.METRIC_INNER_PRODUCT else "l2"
        centroids = ivf.quantizer.reconstruct_n(0, ivf.nlist)  # [nlist, d]
        vec_parts, id_parts, sizes = [], [], []
        for cid in range(ivf.nlist):
            list_ids, codes = get_invlist(ivf.invlists, cid)
            vec_parts.append(codes.view(np.float32).reshape(len(list_ids), ivf.d))  # [n_c, d]
            id_parts.append(list_ids.astype(np.int64))
            sizes.append(len(list_ids))
        offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)  # [nlist + 1]
        return cls(
            torch.from_numpy(np.ascontiguousarray(centroids, dtype=np.float32)),
            torch.from_numpy(np.ascontiguousarray(np.concatenate(vec_parts), dtype=np.float32)),
            torch.from_numpy(np.concatenate(id_parts)),
            torch.from_numpy(offsets),
            metric,
        )

    def to_faiss(self):
        """An equivalent Faiss ``IndexIVFFlat`` (same centroids, same lists, same order)."""
        import faiss

        d = self.dim
        quantizer = faiss.IndexFlatIP(d) if self.metric == "ip" else faiss.IndexFlatL2(d)
        quantizer.add(self.quantizer.centroids.cpu().numpy())
        faiss_metric = faiss.METRIC_INNER_PRODUCT if self.metric == "ip" else faiss.METRIC_L2
        index = faiss.IndexIVFFlat(quantizer, d, self.nlist, faiss_metric)
        assert index.is_trained
        vectors = np.ascontiguousarray(self.vectors.cpu().numpy())  # [N, d]
        ids = np.ascontiguousarray(self.ids.cpu().numpy())  # [N]
        for cid in range(self.nlist):
            start, stop = int(self.offsets[cid]), int(self.offsets[cid + 1])
            if stop > start:
                codes = np.ascontiguousarray(vectors[start:stop]).view(np.uint8)  # [n_c, 4d] bytes
                list_ids = np.ascontiguousarray(ids[start:stop])
                index.invlists.add_entries(cid, stop - start, faiss.swig_ptr(list_ids), faiss.swig_ptr(codes))
        index.ntotal = self.ntotal
        return index


def effective_nlist(requested: int, n_vectors: int) -> int:
    """``requested`` clamped to the number of vectors (with a warning): a cluster needs a point."""
    if n_vectors < 1:
        raise EmptyInputError("cannot build an IVF index from zero vectors")
    if requested > n_vectors:
        warnings.warn(
            f"nlist {requested} exceeds the number of chunks ({n_vectors}); using nlist={n_vectors}",
            stacklevel=3,
        )
        return n_vectors
    return requested


def train_faiss_ivf(vectors: np.ndarray, config: IndexConfig):
    """Train and fill a Faiss ``IndexIVFFlat`` (ids are row numbers; nlist clamped to N)."""
    import faiss

    assert vectors.ndim == 2 and vectors.dtype == np.float32, (vectors.shape, vectors.dtype)
    n, d = vectors.shape
    nlist = effective_nlist(config.nlist, n)
    quantizer = faiss.IndexFlatIP(d) if config.metric == "ip" else faiss.IndexFlatL2(d)
    faiss_metric = faiss.METRIC_INNER_PRODUCT if config.metric == "ip" else faiss.METRIC_L2
    index = faiss.IndexIVFFlat(quantizer, d, nlist, faiss_metric)
    index.cp.niter = config.kmeans_iters
    index.cp.seed = config.seed
    index.cp.min_points_per_centroid = 1  # small corpora are expected; no "too few points" noise
    index.train(vectors)
    index.add(vectors)
    return index
