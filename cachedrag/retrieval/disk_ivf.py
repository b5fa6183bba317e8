"""IVF indexes larger than RAM: clusters memory-mapped from disk, optional IVF-PQ + exact re-rank.

Owns: ``build_disk_ivf`` (train the coarse quantizer on a sample, assign every vector, write
cluster-contiguous files; resumable block by block, with a progress bar), ``DiskIVF`` (search,
staged search, exact search and IVF-PQ search with exact re-ranking over those files) and
``MmapClusterStore`` (the ``ClusterStore`` over the memory-mapped cluster files). Does not own:
where vectors come from (``VectorSource``: ``scale`` makes the 1M-vector corpus), the search
kernels (``ivf``), or prefetch (``lookahead``).

Why our own memory-mapped files rather than Faiss ``OnDiskInvertedLists``: the files have the
same cluster-contiguous layout as ``RetrievalIndex`` (``vectors.npy``/``ids.npy``/``offsets.npy``),
so every existing piece works on them unchanged: ``search_blocks``/``staged_search`` score a
cluster as a zero-copy view of the mapping (bit-identical to ``IVFIndex``, hence to Faiss
``IndexIVFFlat``), ``DiskClusterStore`` and the lookahead prefetcher read whole clusters from
them, and a benchmark can make reads cold (``madvise``/``fadvise DONTNEED``). Faiss's on-disk
lists hide the cluster reads inside its C++ search, so neither staging nor prefetching nor
cold-read control would be possible. Faiss still trains the k-means, assigns, and provides the
product quantizer (``IndexIVFPQ``, codes in RAM: 1M x ``pq_m`` bytes).

Layout of a directory (no pickle; ``pq.faiss`` is Faiss's own binary index format)::

    disk_ivf.json   DiskIVFManifest (dim, metric, nlist, ntotal, pq, file sizes + sha256)
    centroids.npy   float32 [nlist, d]
    offsets.npy     int64 [nlist + 1]   cluster c is rows offsets[c]:offsets[c + 1]
    vectors.npy     float32 [N, d]      cluster-contiguous (memory-mapped, never loaded whole)
    ids.npy         int64 [N]           source row of each vector row
    pq.faiss        optional IndexIVFPQ over the same centroids and assignment

A build works in ``<out>.partial/`` with ``build_state.json``; an interrupted build resumes at
the first unfinished block, and the directory is renamed into place when complete.
"""

from __future__ import annotations

import json
import mmap
import os
import shutil
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Protocol

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict
from tqdm.auto import tqdm

from cachedrag.errors import ConfigError, CorruptCacheError
from cachedrag.retrieval.cluster_store import OffsetClusterStore
from cachedrag.retrieval.config import DiskIndexConfig, Metric
from cachedrag.retrieval.ivf import ClusterBlock, Quantizer, Stage, check_nprobe, merge_topk, search_blocks
from cachedrag.retrieval.index_files import file_sha256
from cachedrag.retrieval.ivf import similarity, staged_search, topk

MANIFEST = "disk_ivf.json"
_PAGE = mmap.PAGESIZE
_MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)  # Linux >= 5.14; Python 3.11 lacks the name
_EXACT_BATCH_ROWS = 1 << 16


class VectorSource(Protocol):
    """Deterministic rows: ``block(start, stop)`` always returns the same ``float32 [stop - start, d]``."""

    ntotal: int
    dim: int

    def block(self, start: int, stop: int) -> np.ndarray: ...


class ArraySource:
    """A ``VectorSource`` over an in-memory array (tests, small indexes)."""

    def __init__(self, vectors: np.ndarray):
        assert vectors.ndim == 2, vectors.shape
        self.vectors = np.ascontiguousarray(vectors, dtype=np.float32)  # [N, d]
        self.ntotal, self.dim = self.vectors.shape

    def block(self, start: int, stop: int) -> np.ndarray:
        return self.vectors[start:stop]


class DiskIVFManifest(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    format: str = "cachedrag-disk-ivf"
    format_version: int = 1
    dim: int
    metric: Metric
    nlist: int
    ntotal: int
    config: DiskIndexConfig
    source: dict = {}  # how the vectors were made (free-form, from the source)
    files: dict[str, dict] = {}  # name -> {"bytes": n, "sha256": hex}


# ---------------------------------------------------------------------------------- building
def build_disk_ivf(source: VectorSource, out: str | Path, config: DiskIndexConfig | None = None,
                   progress: bool = True, source_info: dict | None = None) -> Path:
    """Build (or finish building) the on-disk IVF of ``source`` at ``out``; returns ``out``.

    Steps, each resumable: train k-means on the first ``train_size`` rows; assign every block
    (``assign.npy`` in the work directory); count clusters; scatter every block into the
    cluster-contiguous ``vectors.npy``/``ids.npy``; optionally add IVF-PQ codes. An existing
    complete directory at ``out`` is returned as is.
    """
    config = config or DiskIndexConfig()
    out = Path(out)
    if (out / MANIFEST).is_file():
        return out
    if config.pq_m and source.dim % config.pq_m:
        raise ConfigError(f"pq_m ({config.pq_m}) must divide the dimension ({source.dim})")
    state = _BuildState(out.with_name(out.name + ".partial"), config, source.ntotal)
    n, rows = source.ntotal, config.block_rows
    nlist = min(config.nlist, n)
    blocks = [(s, min(s + rows, n)) for s in range(0, n, rows)]
    centroids = _train(state, source, nlist)  # [nlist, d]
    assign = _assign(state, source, centroids, blocks, progress)
    _scatter(state, source, assign, nlist, blocks, progress)
    del assign
    if config.pq_m and "pq" not in state.done:
        _build_pq(state.work, source, centroids, config, blocks, progress)
        state.mark(pq=True)
    return _finish(state, out, dict(dim=source.dim, metric=config.metric, nlist=nlist, ntotal=n, config=config,
                                    source=source_info or {}))


class _BuildState:
    """The work directory of a build and its resumable progress (``build_state.json``, replaced atomically)."""

    def __init__(self, work: Path, config: DiskIndexConfig, ntotal: int):
        self.work, self.config = work, config
        work.mkdir(parents=True, exist_ok=True)
        self.path = work / "build_state.json"
        self.done = json.loads(self.path.read_text()) if self.path.is_file() else {}
        if self.done.get("config", config.model_dump()) != config.model_dump() or self.done.get("ntotal", ntotal) != ntotal:
            raise ConfigError(f"{work} holds a build with other settings; remove it to start over")
        self.done.update(config=config.model_dump(), ntotal=ntotal)

    def mark(self, **progress) -> None:
        self.done.update(progress)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.done))
        os.replace(tmp, self.path)


def _train(state: _BuildState, source: VectorSource, nlist: int) -> np.ndarray:
    """k-means centroids over the first ``train_size`` rows (trained once, then read back)."""
    import faiss

    config, work = state.config, state.work
    if "trained" not in state.done:
        n, rows = source.ntotal, config.block_rows
        train = np.concatenate([source.block(s, t) for s, t in _spans(0, min(config.train_size, n), rows)])
        km = faiss.Kmeans(source.dim, nlist, niter=config.kmeans_iters, seed=config.seed,
                          spherical=config.metric == "ip", min_points_per_centroid=1,
                          max_points_per_centroid=max(1, config.train_size // nlist + 1))
        km.train(train)
        np.save(work / "centroids.npy", km.centroids.astype(np.float32))
        state.mark(trained=True)
    return np.load(work / "centroids.npy")  # [nlist, d]


def _assign(state: _BuildState, source: VectorSource, centroids: np.ndarray, blocks, progress: bool):
    """Each row's nearest centroid, block by block, in ``assign.npy`` (a memory map, [n])."""
    quantizer = _flat(centroids, state.config.metric)
    assign = _open_rows(state.work / "assign.npy", (source.ntotal,), np.int32)
    done = state.done.setdefault("assigned", 0)
    for b, (s, t) in enumerate(tqdm(blocks, desc="disk IVF: assign", unit="block", disable=not progress,
                                    initial=done), start=0):
        if b < done:
            continue
        assign[s:t] = quantizer.search(source.block(s, t), 1)[1][:, 0]
        assign.flush()
        state.mark(assigned=b + 1)
    return assign


def _scatter(state: _BuildState, source: VectorSource, assign, nlist: int, blocks, progress: bool) -> None:
    """Every block's rows written cluster-contiguous into ``vectors.npy`` / ``ids.npy`` (source
    order within a cluster), with the clusters' ``offsets.npy``."""
    work, n, d = state.work, source.ntotal, source.dim
    counts = np.bincount(assign[:], minlength=nlist)
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)  # [nlist + 1]
    np.save(work / "offsets.npy", offsets)
    vectors = _open_rows(work / "vectors.npy", (n, d), np.float32)
    ids = _open_rows(work / "ids.npy", (n,), np.int64)
    done = state.done.setdefault("written", 0)
    cursor = offsets[:-1] + np.bincount(assign[: blocks[done][0]] if done < len(blocks) else assign[:],
                                        minlength=nlist)
    for b, (s, t) in enumerate(tqdm(blocks, desc="disk IVF: write", unit="block", disable=not progress)):
        if b < done:
            continue
        a = np.asarray(assign[s:t])  # [n_b]
        order = np.argsort(a, kind="stable")  # rows of one cluster together, in source order
        sorted_a = a[order]
        first = np.searchsorted(sorted_a, sorted_a, side="left")  # [n_b] first index of each row's cluster run
        dest = cursor[sorted_a] + (np.arange(len(order)) - first)  # [n_b] destination rows
        vectors[dest] = source.block(s, t)[order]
        ids[dest] = s + order
        cursor += np.bincount(a, minlength=nlist)
        vectors.flush()
        ids.flush()
        state.mark(written=b + 1)


def _finish(state: _BuildState, out: Path, fields: dict) -> Path:
    """The manifest (``fields`` and the files' checksums) written, the build's scratch dropped, the
    directory moved into place."""
    work = state.work
    names = ["centroids.npy", "offsets.npy", "vectors.npy", "ids.npy"] + (["pq.faiss"] if state.config.pq_m else [])
    files = {name: {"bytes": (work / name).stat().st_size, "sha256": file_sha256(work / name)} for name in names}
    manifest = DiskIVFManifest(**fields, files=files)
    (work / "assign.npy").unlink()
    state.path.unlink()
    (work / MANIFEST).write_text(manifest.model_dump_json(indent=2))
    if out.exists():
        shutil.rmtree(out)
    os.replace(work, out)
    return out


def _build_pq(work: Path, source: VectorSource, centroids: np.ndarray, config: DiskIndexConfig, blocks, progress):
    """IVF-PQ over the same coarse centroids, filled with the build's own assignment."""
    import faiss
    from faiss.contrib.ivf_tools import add_preassigned

    d = centroids.shape[1]
    metric = faiss.METRIC_INNER_PRODUCT if config.metric == "ip" else faiss.METRIC_L2
    index = faiss.IndexIVFPQ(_flat(centroids, config.metric), d, len(centroids), config.pq_m, config.pq_bits, metric)
    index.train(np.concatenate([source.block(s, t) for s, t in _spans(0, min(config.train_size, source.ntotal),
                                                                     config.block_rows)]))
    assign = np.load(work / "assign.npy", mmap_mode="r")
    for s, t in tqdm(blocks, desc="disk IVF: PQ codes", unit="block", disable=not progress):
        x = np.ascontiguousarray(source.block(s, t), dtype=np.float32)  # [n_b, d]
        a = np.ascontiguousarray(assign[s:t], dtype=np.int64)  # [n_b]
        ids = np.arange(s, t, dtype=np.int64)  # kept alive here: add_preassigned passes a raw pointer
        add_preassigned(index, x, a, ids=ids)
    faiss.write_index(index, str(work / "pq.faiss"))


def _spans(start: int, stop: int, rows: int) -> list[tuple[int, int]]:
    return [(s, min(s + rows, stop)) for s in range(start, stop, rows)]


def _flat(centroids: np.ndarray, metric: Metric):
    import faiss

    index = faiss.IndexFlatIP(centroids.shape[1]) if metric == "ip" else faiss.IndexFlatL2(centroids.shape[1])
    index.add(np.ascontiguousarray(centroids, dtype=np.float32))
    return index


def _open_rows(path: Path, shape: tuple[int, ...], dtype) -> np.memmap:
    """A ``.npy`` file of ``shape``/``dtype`` opened for in-place writes (created if missing)."""
    if path.is_file():
        arr = np.load(path, mmap_mode="r+")
        if arr.shape == shape and arr.dtype == dtype:
            return arr
    return np.lib.format.open_memmap(path, mode="w+", dtype=dtype, shape=shape)


# ---------------------------------------------------------------------------------- the tier
class MmapClusterStore(OffsetClusterStore):
    """Every cluster as a zero-copy view of the memory-mapped ``vectors.npy``/``ids.npy``.

    ``get`` first tells the kernel to read all requested clusters (``MADV_WILLNEED``: large
    asynchronous reads of exactly those ranges), then maps each cluster's pages in one call
    (``MADV_POPULATE_READ``: measured here 2-4x faster than taking a page fault per 4 KiB while
    scoring) and returns views. Where the kernel lacks ``MADV_POPULATE_READ``, ``populate`` turns
    False and scoring faults the pages in. ``read`` returns RAM copies (what a prefetch into a
    fast tier needs). ``drop_page_cache`` makes the next reads come from disk.
    """

    def __init__(self, directory: str | Path, offsets: Sequence[int]):
        self.device = torch.device("cpu")
        self.offsets = np.asarray(offsets, dtype=np.int64)
        directory = Path(directory)
        self._maps = []
        self.vectors = self._map(directory / "vectors.npy", np.float32)  # [N, d]
        self.ids = self._map(directory / "ids.npy", np.int64)  # [N]
        if self.vectors.shape[0] != self.offsets[-1] or self.ids.shape != (self.offsets[-1],):
            raise CorruptCacheError(f"{directory}: cluster files do not hold {self.offsets[-1]} rows")
        self.dim = self.vectors.shape[1]
        self.populate = True  # MADV_POPULATE_READ works here (set False on the first refusal)

    def _map(self, path: Path, dtype) -> np.ndarray:
        from cachedrag.retrieval.cluster_store import _npy_layout

        start, shape, file_dtype = _npy_layout(path)
        if file_dtype != dtype:
            raise CorruptCacheError(f"{path} holds {file_dtype}, expected {np.dtype(dtype)}")
        fd = os.open(path, os.O_RDONLY)
        try:
            mm = mmap.mmap(fd, 0, access=mmap.ACCESS_COPY)  # private: writable views, the file never changes
        finally:
            os.close(fd)
        self._maps.append((mm, str(path), start))
        count = int(np.prod(shape))
        return np.frombuffer(mm, dtype=dtype, count=count, offset=start).reshape(shape)

    def get(self, cluster_ids: Sequence[int]) -> dict[int, ClusterBlock]:
        wanted = [int(c) for c in cluster_ids if self.contains(int(c))]
        self.will_need(wanted)
        if self.populate:
            try:
                for c in wanted:
                    start, stop = int(self.offsets[c]), int(self.offsets[c + 1])
                    if stop > start:
                        self._advise(0, start * self.dim * 4, stop * self.dim * 4, _MADV_POPULATE_READ)
                        self._advise(1, start * 8, stop * 8, _MADV_POPULATE_READ)
            except OSError:
                self.populate = False  # old kernel: pages fault in while scoring
        return {c: self._view(c) for c in wanted}

    def read(self, cluster_ids: Sequence[int]) -> dict[int, ClusterBlock]:
        """RAM copies of the clusters (reads them now)."""
        return {c: ClusterBlock(b.vectors.clone(), b.ids.clone()) for c, b in self.get(cluster_ids).items()}

    def rows(self, positions: np.ndarray) -> torch.Tensor:
        """Vectors at file rows ``positions`` (any order) -> ``[n, d]`` copies."""
        return torch.from_numpy(self.vectors[positions])

    def will_need(self, cluster_ids: Sequence[int]) -> None:
        """Start asynchronous reads of these clusters' bytes."""
        for c in cluster_ids:
            start, stop = int(self.offsets[c]), int(self.offsets[c + 1])
            if stop > start:
                self._advise(0, start * self.dim * 4, stop * self.dim * 4, mmap.MADV_WILLNEED)
                self._advise(1, start * 8, stop * 8, mmap.MADV_WILLNEED)

    def _advise(self, which: int, lo: int, hi: int, advice: int) -> None:
        mm, _, base = self._maps[which]
        lo, hi = base + lo, base + hi
        lo -= lo % _PAGE
        mm.madvise(advice, lo, min(hi, len(mm)) - lo)

    def _view(self, cid: int) -> ClusterBlock:
        start, stop = int(self.offsets[cid]), int(self.offsets[cid + 1])
        return ClusterBlock(torch.from_numpy(self.vectors[start:stop]), torch.from_numpy(self.ids[start:stop]))

    def drop_page_cache(self) -> bool:
        """Discard the mapping's pages and the files' page cache (next reads come from disk)."""
        if not hasattr(os, "posix_fadvise"):
            return False
        for mm, path, _ in self._maps:
            mm.madvise(mmap.MADV_DONTNEED)
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
        return True


# ---------------------------------------------------------------------------------- the index
class DiskIVF:
    """An IVF index whose clusters stay on disk (memory-mapped); centroids and PQ codes in RAM.

    >>> ivf = DiskIVF.open(path)                                  # doctest: +SKIP
    >>> scores, ids = ivf.search(q, k=10, nprobe=64)              # [B, 10] each, ids = source rows
    """

    def __init__(self, path: Path, manifest: DiskIVFManifest):
        self.path = path
        self.manifest = manifest
        self.metric: Metric = manifest.metric
        self.quantizer = Quantizer(torch.from_numpy(np.load(path / "centroids.npy")), manifest.metric)
        self.offsets = np.load(path / "offsets.npy")  # [nlist + 1]
        self.store = MmapClusterStore(path, self.offsets)
        self._pq = None
        self._positions: np.ndarray | None = None
        if self.quantizer.nlist != manifest.nlist or self.store.dim != manifest.dim:
            raise CorruptCacheError(f"{path}: arrays disagree with {MANIFEST}")

    @classmethod
    def open(cls, path: str | Path, verify: bool = False) -> "DiskIVF":
        """Open a built directory; sizes are always checked, sha256 too with ``verify``."""
        path = Path(path)
        if not (path / MANIFEST).is_file():
            raise FileNotFoundError(f"{path} is not a disk IVF directory (no {MANIFEST})")
        try:
            manifest = DiskIVFManifest.model_validate_json((path / MANIFEST).read_text())
        except ValueError as exc:
            raise CorruptCacheError(f"{path / MANIFEST} is not a valid manifest: {exc}") from exc
        for name, meta in manifest.files.items():
            f = path / name
            if not f.is_file() or f.stat().st_size != meta["bytes"] or (verify and file_sha256(f) != meta["sha256"]):
                raise CorruptCacheError(f"index file {f} is missing or damaged; rebuild the index")
        return cls(path, manifest)

    @property
    def nlist(self) -> int:
        return self.quantizer.nlist

    @property
    def ntotal(self) -> int:
        return self.manifest.ntotal

    @property
    def has_pq(self) -> bool:
        return "pq.faiss" in self.manifest.files

    def cluster_sizes(self) -> list[int]:
        return np.diff(self.offsets).tolist()

    def cluster_nbytes(self) -> list[int]:
        return self.store.cluster_nbytes()

    def assign(self, q: torch.Tensor, nprobe: int) -> torch.Tensor:
        """``q [B, d]`` -> probed clusters ``[B, nprobe]``, nearest first."""
        return self.quantizer.assign(q, nprobe)

    def search(self, q: torch.Tensor, k: int, nprobe: int) -> tuple[torch.Tensor, torch.Tensor]:
        """IVF-Flat search (== Faiss ``IndexIVFFlat`` at the same nprobe) -> ``(scores [B, k], ids [B, k])``."""
        probe = self.assign(q, nprobe)  # [B, nprobe]
        return search_blocks(q, probe, self.store.get(torch.unique(probe).tolist()), k, self.metric)

    def search_stages(self, q: torch.Tensor, k: int, nprobe: int, n_stages: int) -> Iterator[Stage]:
        """Running top-k after each group of probed clusters (centroid order); the last equals ``search``."""
        return staged_search(q, self.assign(q, nprobe), k, self.metric, self.store.get, n_stages)

    def exact_search(self, q: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Brute force over every vector, streamed from the file (the recall reference)."""
        best = None
        for s in range(0, self.ntotal, _EXACT_BATCH_ROWS):
            t = min(s + _EXACT_BATCH_ROWS, self.ntotal)
            part = topk(similarity(q, torch.from_numpy(self.store.vectors[s:t]), self.metric),
                        torch.from_numpy(self.store.ids[s:t]), k)  # [B, k] x2
            best = part if best is None else merge_topk([best, part], k)
        return best

    def search_pq(self, q: torch.Tensor, k: int, nprobe: int, shortlist: int) -> tuple[torch.Tensor, torch.Tensor]:
        """IVF-PQ over the codes in RAM for a ``shortlist`` of candidates, re-ranked exactly.

        Only the shortlist's rows are read from disk. The result equals exact scoring of the
        shortlist (not necessarily IVF-Flat's top-k: PQ may leave a true neighbour out).
        """
        if not self.has_pq:
            raise ConfigError(f"{self.path} has no IVF-PQ codes; build it with pq_m > 0")
        check_nprobe(nprobe, self.nlist)
        pq = self._load_pq()
        pq.nprobe = nprobe
        _, cand = pq.search(q.numpy(), max(shortlist, k))  # [B, R] source rows, -1 = none
        positions = self._row_positions()
        out = []
        for i, row in enumerate(cand):
            row = row[row >= 0]
            vecs = self.store.rows(positions[row]) if len(row) else torch.empty(0, self.store.dim)  # [R, d]
            out.append(topk(similarity(q[i : i + 1], vecs, self.metric), torch.from_numpy(row.astype(np.int64)), k))
        return torch.cat([s for s, _ in out]), torch.cat([i for _, i in out])

    def _load_pq(self):
        if self._pq is None:
            import faiss

            self._pq = faiss.read_index(str(self.path / "pq.faiss"))
        return self._pq

    def _row_positions(self) -> np.ndarray:
        """File row of each source row (the inverse of ``ids.npy``), computed once."""
        if self._positions is None:
            positions = np.empty(self.ntotal, dtype=np.int64)
            positions[np.asarray(self.store.ids)] = np.arange(self.ntotal)
            self._positions = positions
        return self._positions

    def to_faiss_flat(self):
        """An equivalent Faiss ``IndexIVFFlat`` in RAM (tests on small indexes)."""
        import faiss

        index = faiss.IndexIVFFlat(_flat(self.quantizer.centroids.numpy(), self.metric), self.manifest.dim, self.nlist,
                                   faiss.METRIC_INNER_PRODUCT if self.metric == "ip" else faiss.METRIC_L2)
        for c in range(self.nlist):
            b = self.store._view(c)
            if b.ids.numel():
                codes = np.ascontiguousarray(b.vectors.numpy()).view(np.uint8)
                index.invlists.add_entries(c, b.ids.numel(), faiss.swig_ptr(np.ascontiguousarray(b.ids.numpy())),
                                           faiss.swig_ptr(codes))
        index.ntotal = self.ntotal
        return index
