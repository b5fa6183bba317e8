"""The on-disk embedding cache: chunk embeddings survive an interrupted or failed index build.

Owns: ``EmbeddingCache`` (vectors keyed by the sha256 of a text, one directory per embedder
name + dimension, written in shards as they are computed) and ``CachingEmbedder`` (an
``Embedder`` wrapper whose ``encode`` serves texts embedded before from the cache and embeds
the rest in batches, saving each batch before the next). Embedding a corpus is the slow part
of ``cachedrag index build`` (minutes on CPU); with this, a build that dies at the Faiss step,
is interrupted with Ctrl-C, or is re-run with another ``--nlist`` re-embeds nothing it
already embedded.

Written here rather than taken from a library: sentence-transformers has no persistent
cache, and the format must follow the project's rule for files (no pickle: ``.npz`` of a
fixed-width key array and a float32 matrix, read with ``allow_pickle=False``; written to a
temp file and renamed into place). A shard that fails to load is deleted and counts as a
miss. Does not own: the embedding model (``embedder``) or the index (``index``).
"""

from __future__ import annotations

import hashlib
import os
import tempfile
import threading
from collections.abc import Sequence
from pathlib import Path

import numpy as np

_KEY_DTYPE = "S64"  # hex sha256


def text_key(text: str) -> bytes:
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest().encode()


class EmbeddingCache:
    """Vectors of texts for one embedder (``name``, ``dim``) under ``root``."""

    def __init__(self, root: str | Path, name: str, dim: int):
        tag = hashlib.sha256(f"{name}\0{dim}".encode()).hexdigest()[:16]
        self.dir = Path(root) / tag
        self.dim = int(dim)
        self._lock = threading.Lock()
        self._rows: dict[bytes, np.ndarray] = {}
        self._loaded = False

    def _load(self) -> None:
        if self._loaded:
            return
        self._loaded = True
        if not self.dir.is_dir():
            return
        for shard in sorted(self.dir.glob("*.npz")):
            try:
                with np.load(shard, allow_pickle=False) as data:
                    keys, vectors = data["keys"], data["vectors"]
                if vectors.ndim != 2 or vectors.shape != (len(keys), self.dim) or vectors.dtype != np.float32:
                    raise ValueError(f"shape {vectors.shape} dtype {vectors.dtype}")
            except Exception:  # noqa: BLE001 - a damaged shard is a miss: drop it, embed again
                shard.unlink(missing_ok=True)
                continue
            for key, row in zip(keys.tolist(), vectors):
                self._rows[key] = row

    def lookup(self, keys: Sequence[bytes]) -> dict[bytes, np.ndarray]:
        with self._lock:
            self._load()
            return {k: self._rows[k] for k in keys if k in self._rows}

    def put(self, keys: Sequence[bytes], vectors: np.ndarray) -> None:
        """Save one shard atomically (temp file + rename) and remember its rows."""
        assert vectors.shape == (len(keys), self.dim), (vectors.shape, len(keys), self.dim)
        self.dir.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".shard.", suffix=".npz", dir=self.dir)
        try:
            with os.fdopen(fd, "wb") as fh:
                np.savez(fh, keys=np.asarray(list(keys), dtype=_KEY_DTYPE),
                         vectors=np.ascontiguousarray(vectors, dtype=np.float32))
            digest = hashlib.sha256(b"".join(keys)).hexdigest()[:24]
            os.replace(tmp, self.dir / f"{digest}.npz")
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        with self._lock:
            for key, row in zip(keys, vectors):
                self._rows[key] = row

    def __len__(self) -> int:
        with self._lock:
            self._load()
            return len(self._rows)


class CachingEmbedder:
    """``Embedder`` whose ``encode`` goes through an ``EmbeddingCache``.

    >>> emb = CachingEmbedder(Embedder(), cache_home() / "embeddings")   # doctest: +SKIP
    >>> build_index(docs, tokenizer, emb, out="idx")                      # doctest: +SKIP
    """

    def __init__(self, embedder, root: str | Path, batch_texts: int = 256):
        self.embedder = embedder
        self.name, self.dim = embedder.name, embedder.dim
        self.cache = EmbeddingCache(root, embedder.name, embedder.dim)
        self.batch_texts = batch_texts
        self.served = 0  # texts of the last encode served from the cache
        self.computed = 0  # texts of the last encode embedded now

    def encode(self, texts: Sequence[str], progress: bool = False) -> np.ndarray:
        if isinstance(texts, str):
            texts = [texts]
        keys = [text_key(t) for t in texts]
        have = self.cache.lookup(keys)
        todo: dict[bytes, str] = {}
        for key, text in zip(keys, texts):
            if key not in have and key not in todo:
                todo[key] = text
        self.served, self.computed = len(texts) - sum(k in todo for k in keys), len(todo)
        if not keys:
            return self.embedder.encode(texts, progress=progress)  # its own empty-input error
        items = list(todo.items())
        batches = range(0, len(items), self.batch_texts)
        if progress and items:
            from tqdm import tqdm

            batches = tqdm(batches, desc=f"embedding ({len(have)} cached)", unit="batch")
        for start in batches:
            part = items[start:start + self.batch_texts]
            vectors = self.embedder.encode([t for _, t in part])  # [n, d]
            self.cache.put([k for k, _ in part], vectors)
            have.update(zip((k for k, _ in part), vectors))
        return np.stack([have[k] for k in keys]).astype(np.float32, copy=False)  # [N, d]

    def check_compatible(self, name: str, dim: int) -> None:
        self.embedder.check_compatible(name, dim)

    def __getattr__(self, name: str):
        return getattr(self.embedder, name)

    def __repr__(self) -> str:
        return f"CachingEmbedder({self.embedder!r}, cache={self.cache.dir})"
