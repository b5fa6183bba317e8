"""Fixtures of the retrieval tests: a fake tokenizer, random IVF data, a tiny corpus and index."""

from __future__ import annotations

import re
import zlib

import numpy as np
import pytest
import torch

from cachedrag.retrieval.cluster_store import DiskClusterStore
from cachedrag.retrieval.config import IndexConfig
from cachedrag.retrieval.ivf import IVFIndex
from cachedrag.testing import TINY_DOCS


class FakeTokenizer:
    """Words and single non-word characters as tokens, ids from a stable hash; decode(encode(t)) == t.

    No offsets API (exercises the chunker's decode-based offsets).
    """

    _TOKEN = re.compile(r"\w+|\W", re.UNICODE)
    _pieces: dict[int, str] = {}  # shared: the same piece always has the same id

    def encode(self, text, add_special_tokens=False):
        ids = []
        for piece in self._TOKEN.findall(text):
            token_id = zlib.crc32(piece.encode()) & 0xFFFFFF
            assert self._pieces.setdefault(token_id, piece) == piece, "hash collision in the fake tokenizer"
            ids.append(token_id)
        return ids

    def decode(self, ids):
        return "".join(self._pieces[i] for i in ids)


TINY_QUESTIONS = [
    "How do I pretty-print JSON?",
    "What does heappush do?",
    "How do I compute a SHA-256 hash?",
    "How do I generate a random UUID?",
]


@pytest.fixture
def fake_tokenizer():
    return FakeTokenizer()


@pytest.fixture(scope="session")
def embedder():
    from cachedrag.retrieval.embedder import Embedder

    return Embedder()


@pytest.fixture(scope="session")
def tiny_index(embedder, tmp_path_factory):
    """The tiny corpus in 16-token chunks (overlap 4), nlist 4, saved to a directory."""
    from cachedrag.retrieval.config import ChunkConfig, RetrievalConfig
    from cachedrag.retrieval.index import build_index

    config = RetrievalConfig(chunk=ChunkConfig(chunk_tokens=16, overlap=4), index=IndexConfig(nlist=4))
    out = tmp_path_factory.mktemp("tiny") / "index"
    return build_index(TINY_DOCS, FakeTokenizer(), embedder, config, out=out, progress=False)


def random_vectors(n: int, d: int, seed: int, normalize: bool = True) -> np.ndarray:
    x = np.random.default_rng(seed).standard_normal((n, d)).astype(np.float32)
    if normalize:
        x /= np.linalg.norm(x, axis=1, keepdims=True)
    return x


@pytest.fixture(scope="session", params=["ip", "l2"])
def random_ivf(request):
    """(faiss index, IVFIndex) over 1,000 random 32-d vectors, 16 lists."""
    from cachedrag.retrieval.ivf import train_faiss_ivf

    x = random_vectors(1000, 32, seed=0)
    faiss_index = train_faiss_ivf(x, IndexConfig(nlist=16, metric=request.param))
    return faiss_index, IVFIndex.from_faiss(faiss_index)


def save_clusters(ivf: IVFIndex, directory) -> DiskClusterStore:
    """Write ``ivf``'s cluster-contiguous arrays like an index directory and open the disk tier."""
    np.save(directory / "vectors.npy", ivf.vectors.numpy())
    np.save(directory / "ids.npy", ivf.ids.numpy())
    return DiskClusterStore(directory / "vectors.npy", directory / "ids.npy", ivf.offsets.tolist())


@pytest.fixture
def queries():
    return torch.from_numpy(random_vectors(12, 32, seed=1))
