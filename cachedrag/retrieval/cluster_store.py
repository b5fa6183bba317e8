"""Tiers that hold IVF clusters: a disk-backed slow tier and a memory fast tier.

Owns: the narrow ``ClusterStore`` interface (``contains``/``get``/``put``/``remove``, batched
``get`` returning the blocks a tier holds), ``DiskClusterStore`` (reads whole clusters from
an index directory's ``vectors.npy``/``ids.npy`` with ``os.preadv`` — real file I/O — and can
drop the files from the OS page cache so cold reads come from disk), and
``MemoryClusterStore`` (torch tensors in RAM or GPU memory, thread-safe, byte-accounted).
``make_tiers`` picks the pair: CPU-only -> disk slow tier + RAM fast tier; CUDA -> RAM slow
tier + GPU fast tier. Does not own: which clusters to move (``policy``) or scoring (``ivf``).
"""

from __future__ import annotations

import os
import threading
from abc import ABC, abstractmethod
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from cachedrag.errors import CorruptCacheError
from cachedrag.retrieval.ivf import ClusterBlock, IVFIndex

_VECTOR_ITEM_BYTES = np.dtype(np.float32).itemsize
_ID_BYTES = np.dtype(np.int64).itemsize


class ClusterStore(ABC):
    """A tier of IVF cluster blocks on one device."""

    device: torch.device

    @abstractmethod
    def contains(self, cid: int) -> bool: ...

    @abstractmethod
    def get(self, cluster_ids: Sequence[int]) -> dict[int, ClusterBlock]:
        """Blocks of the requested clusters that this tier holds (others are left out)."""

    @abstractmethod
    def cluster_ids(self) -> list[int]:
        """Clusters held now."""

    def put(self, cid: int, block: ClusterBlock) -> None:
        raise NotImplementedError(f"{type(self).__name__} is read-only")

    def remove(self, cid: int) -> None:
        raise NotImplementedError(f"{type(self).__name__} is read-only")

    def drop_page_cache(self) -> bool:
        """Evict this tier's files from the OS page cache; False where that does not apply."""
        return False


class MemoryClusterStore(ClusterStore):
    """Cluster blocks as torch tensors on ``device`` (RAM for CPU, GPU memory for CUDA)."""

    def __init__(self, device: torch.device | str = "cpu", pin_memory: bool = False):
        self.device = torch.device(device)
        self.pin_memory = pin_memory and self.device.type == "cpu" and torch.cuda.is_available()
        self._blocks: dict[int, ClusterBlock] = {}
        self._lock = threading.Lock()
        self._stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None

    @classmethod
    def from_index(cls, ivf: IVFIndex, device: torch.device | str = "cpu", pin_memory: bool = False) -> "MemoryClusterStore":
        """A tier holding every cluster of ``ivf``."""
        store = cls(device, pin_memory)
        for cid in range(ivf.nlist):
            store.put(cid, ivf.block(cid))
        return store

    def contains(self, cid: int) -> bool:
        with self._lock:
            return cid in self._blocks

    def get(self, cluster_ids: Sequence[int]) -> dict[int, ClusterBlock]:
        with self._lock:
            return {int(c): self._blocks[int(c)] for c in cluster_ids if int(c) in self._blocks}

    def cluster_ids(self) -> list[int]:
        with self._lock:
            return sorted(self._blocks)

    def put(self, cid: int, block: ClusterBlock) -> None:
        """Hold ``block`` as cluster ``cid`` on this tier's device (moved there if elsewhere)."""
        moved = self._move(block)
        with self._lock:
            self._blocks[int(cid)] = moved

    def remove(self, cid: int) -> None:
        with self._lock:
            self._blocks.pop(int(cid), None)

    def clear(self) -> None:
        with self._lock:
            self._blocks.clear()

    def nbytes(self) -> int:
        """Bytes held now."""
        with self._lock:
            return sum(b.nbytes for b in self._blocks.values())

    def _move(self, block: ClusterBlock) -> ClusterBlock:
        if self._stream is not None:  # copy on a side stream, finished before the block is visible
            with torch.cuda.stream(self._stream):
                moved = block.to(self.device, non_blocking=True)
            self._stream.synchronize()
            return moved
        moved = block.to(self.device)  # no copy when already there: the tier shares the caller's tensors
        if self.pin_memory:
            moved = ClusterBlock(moved.vectors.pin_memory(), moved.ids.pin_memory())
        return moved


class OffsetClusterStore(ClusterStore):
    """A store of every cluster of a cluster-contiguous file pair: cluster ``c`` is rows
    ``offsets[c]:offsets[c + 1]`` of ``dim`` float32 vectors and int64 ids (``DiskClusterStore``
    reads them, ``disk_ivf.MmapClusterStore`` maps them)."""

    offsets: Sequence[int]
    dim: int

    @property
    def nlist(self) -> int:
        return len(self.offsets) - 1

    def contains(self, cid: int) -> bool:
        return 0 <= cid < self.nlist

    def cluster_ids(self) -> list[int]:
        return list(range(self.nlist))

    def cluster_nbytes(self) -> list[int]:
        row = self.dim * _VECTOR_ITEM_BYTES + _ID_BYTES
        return [int(stop - start) * row for start, stop in zip(self.offsets[:-1], self.offsets[1:])]


class DiskClusterStore(OffsetClusterStore):
    """Every cluster, read from disk on each ``get`` (the slow tier on CPU-only machines).

    ``vectors.npy [N, d] float32`` and ``ids.npy [N] int64`` are cluster-contiguous (the
    layout ``IVFIndex`` saves); cluster ``c`` is rows ``offsets[c]:offsets[c + 1]``. Reads use
    ``os.preadv`` into fresh tensors; ``drop_page_cache`` makes the next reads cold. With
    ``random_access`` (default) the kernel is told not to read ahead: cluster reads jump around
    the file, and read-ahead would both waste bandwidth on big indexes and, on small ones, pull
    the whole file in on the first read (so later "cold" reads would come from RAM).
    """

    def __init__(
        self, vectors_path: str | Path, ids_path: str | Path, offsets: Sequence[int], random_access: bool = True
    ):
        self.device = torch.device("cpu")
        self.offsets = [int(o) for o in offsets]
        n = self.offsets[-1]
        self._vectors_start, v_shape, v_dtype = _npy_layout(vectors_path)
        self._ids_start, i_shape, i_dtype = _npy_layout(ids_path)
        if v_dtype != np.float32 or i_dtype != np.int64 or len(v_shape) != 2 or v_shape[0] != n or i_shape != (n,):
            raise CorruptCacheError(
                f"cluster files {vectors_path} {v_shape}/{v_dtype} and {ids_path} {i_shape}/{i_dtype} "
                f"do not hold {n} float32 vectors and int64 ids"
            )
        self.dim = int(v_shape[1])
        self._paths = (str(vectors_path), str(ids_path))
        self._vfd = os.open(vectors_path, os.O_RDONLY)
        self._ifd = os.open(ids_path, os.O_RDONLY)
        if random_access and hasattr(os, "posix_fadvise"):
            for fd in (self._vfd, self._ifd):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)

    def get(self, cluster_ids: Sequence[int]) -> dict[int, ClusterBlock]:
        return {int(c): self._read(int(c)) for c in cluster_ids if self.contains(int(c))}

    def _read(self, cid: int) -> ClusterBlock:
        start, stop = self.offsets[cid], self.offsets[cid + 1]
        vectors = torch.empty((stop - start, self.dim), dtype=torch.float32)  # [n, d]
        ids = torch.empty((stop - start,), dtype=torch.int64)  # [n]
        _pread_into(self._vfd, vectors.numpy(), self._vectors_start + start * self.dim * _VECTOR_ITEM_BYTES)
        _pread_into(self._ifd, ids.numpy(), self._ids_start + start * _ID_BYTES)
        return ClusterBlock(vectors, ids)

    def drop_page_cache(self) -> bool:
        """Ask the kernel to drop the cluster files from the page cache (Linux ``fadvise``)."""
        if not hasattr(os, "posix_fadvise"):
            return False
        for fd in (self._vfd, self._ifd):
            os.fsync(fd)  # dirty pages cannot be dropped
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        return True

    def close(self) -> None:
        for fd in (self._vfd, self._ifd):
            if fd >= 0:
                os.close(fd)
        self._vfd = self._ifd = -1

    def __enter__(self) -> "DiskClusterStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        # at interpreter exit module globals (os) may already be gone: then the OS closes the fd
        if getattr(self, "_vfd", -1) >= 0 and os is not None and getattr(os, "close", None) is not None:
            self.close()


def make_tiers(ivf: IVFIndex, disk: DiskClusterStore | None, device: torch.device | str | None = None):
    """``(slow, fast)`` tiers for ``device`` (default: CUDA when available, else CPU).

    CPU: the disk store is the slow tier (required), a RAM store the fast tier. CUDA: a
    pinned RAM copy of every cluster is the slow tier, GPU memory the fast tier.
    """
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda":
        return MemoryClusterStore.from_index(ivf, "cpu", pin_memory=True), MemoryClusterStore(device)
    if disk is None:
        raise ValueError("a CPU-only lookahead needs the disk-backed cluster store as its slow tier")
    return disk, MemoryClusterStore(device)


def _npy_layout(path: str | Path) -> tuple[int, tuple[int, ...], np.dtype]:
    """Byte offset of the data, shape and dtype of a C-order ``.npy`` file."""
    with open(path, "rb") as fh:
        major, _minor = np.lib.format.read_magic(fh)
        read_header = np.lib.format.read_array_header_1_0 if major == 1 else np.lib.format.read_array_header_2_0
        shape, fortran_order, dtype = read_header(fh)
        if fortran_order:
            raise CorruptCacheError(f"{path} is Fortran-ordered; expected C order")
        return fh.tell(), tuple(shape), dtype


def _pread_into(fd: int, out: np.ndarray, offset: int) -> None:
    """Fill ``out`` with bytes read from ``fd`` at ``offset`` (short reads retried)."""
    if out.size == 0:
        return
    view = memoryview(out).cast("B")
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n == 0:
            raise CorruptCacheError(f"cluster file ends early at byte {offset + done}")
        done += n
