"""Disk-backed and memory cluster tiers."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cachedrag.errors import CorruptCacheError
from cachedrag.retrieval.cluster_store import DiskClusterStore, MemoryClusterStore, make_tiers
from cachedrag.retrieval.ivf import ClusterBlock, IVFIndex

from .conftest import random_vectors, save_clusters


def test_disk_store_reads_whole_clusters(random_ivf, tmp_path):
    _, ivf = random_ivf
    with save_clusters(ivf, tmp_path) as disk:
        assert disk.nlist == ivf.nlist and disk.cluster_nbytes() == ivf.cluster_nbytes()
        blocks = disk.get([3, 0, ivf.nlist + 5])  # unknown clusters are left out
        assert sorted(blocks) == [0, 3]
        for cid, block in blocks.items():
            expected = ivf.block(cid)
            assert torch.equal(block.vectors, expected.vectors) and torch.equal(block.ids, expected.ids)
            assert block.nbytes == ivf.cluster_nbytes()[cid]
        assert disk.drop_page_cache() is True
        assert torch.equal(disk.get([5])[5].vectors, ivf.block(5).vectors)  # cold read, same bytes
        with pytest.raises(NotImplementedError):
            disk.put(0, blocks[0])


def test_disk_store_handles_empty_clusters(tmp_path):
    vectors = torch.from_numpy(random_vectors(3, 4, seed=0))
    ivf = IVFIndex(torch.eye(4)[:3], vectors, torch.arange(3), torch.tensor([0, 0, 3, 3]), "ip")
    with save_clusters(ivf, tmp_path) as disk:
        assert disk.get([0])[0].ids.numel() == 0
        assert disk.get([1])[1].ids.tolist() == [0, 1, 2]


def test_disk_store_rejects_wrong_files(tmp_path):
    np.save(tmp_path / "vectors.npy", np.zeros((4, 3), dtype=np.float64))
    np.save(tmp_path / "ids.npy", np.arange(4))
    with pytest.raises(CorruptCacheError):
        DiskClusterStore(tmp_path / "vectors.npy", tmp_path / "ids.npy", [0, 4])


def test_memory_store_put_get_remove():
    store = MemoryClusterStore("cpu")
    block = ClusterBlock(torch.ones(2, 3), torch.tensor([4, 5]))
    store.put(7, block)
    assert store.contains(7) and not store.contains(1)
    assert store.get([7, 1]).keys() == {7}
    assert store.nbytes() == block.nbytes == 2 * 3 * 4 + 2 * 8
    store.remove(7)
    assert store.cluster_ids() == [] and store.nbytes() == 0


def test_make_tiers_cpu(random_ivf, tmp_path):
    _, ivf = random_ivf
    disk = save_clusters(ivf, tmp_path)
    slow, fast = make_tiers(ivf, disk, "cpu")
    assert slow is disk and isinstance(fast, MemoryClusterStore) and fast.device.type == "cpu"
    disk.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_make_tiers_cuda(random_ivf):
    _, ivf = random_ivf
    slow, fast = make_tiers(ivf, None, "cuda")
    assert slow.device.type == "cpu" and fast.device.type == "cuda"
    fast.put(0, slow.get([0])[0])
    assert fast.get([0])[0].vectors.is_cuda
