"""The embedding cache: an interrupted embedding resumes; cached vectors equal fresh ones."""

from __future__ import annotations

import numpy as np
import pytest

from cachedrag.retrieval.embedding_cache import CachingEmbedder, EmbeddingCache, text_key


class _Fake:
    """Deterministic embedder that counts what it embeds and can die after N calls."""

    name, dim = "fake", 4

    def __init__(self, die_after: int | None = None):
        self.embedded: list[str] = []
        self.calls = 0
        self.die_after = die_after

    def encode(self, texts, progress=False):
        self.calls += 1
        if self.die_after is not None and self.calls > self.die_after:
            raise KeyboardInterrupt
        self.embedded += list(texts)
        return np.array([[len(t), ord(t[0]), ord(t[-1]), 1.0] for t in texts], dtype=np.float32)


def test_interrupted_encode_resumes_without_re_embedding(tmp_path):
    texts = [f"text number {i}" for i in range(10)]
    dying = CachingEmbedder(_Fake(die_after=2), tmp_path, batch_texts=3)
    with pytest.raises(KeyboardInterrupt):
        dying.encode(texts)
    assert len(EmbeddingCache(tmp_path, "fake", 4)) == 6  # two batches saved before the interrupt
    fake = _Fake()
    again = CachingEmbedder(fake, tmp_path, batch_texts=3)
    got = again.encode(texts + texts[:2])  # duplicates are embedded once
    assert fake.embedded == texts[6:] and (again.served, again.computed) == (8, 4)
    np.testing.assert_array_equal(got, _Fake().encode(texts + texts[:2]))


def test_other_embedder_or_damaged_shard_is_a_miss(tmp_path):
    CachingEmbedder(_Fake(), tmp_path).encode(["a", "b"])
    other = _Fake()
    other.name = "other"
    assert EmbeddingCache(tmp_path, "other", 4).lookup([text_key("a")]) == {}
    (shard,) = (tmp_path).glob("*/*.npz")
    shard.write_bytes(b"garbage")
    fake = _Fake()
    CachingEmbedder(fake, tmp_path).encode(["a", "b"])
    assert fake.embedded == ["a", "b"]


def test_cached_vectors_equal_the_real_embedders(embedder, tmp_path):
    texts = ["heapq pushes items", "json.dumps with indent", "uuid4 is random"]
    first = CachingEmbedder(embedder, tmp_path, batch_texts=2).encode(texts)
    again = CachingEmbedder(embedder, tmp_path)
    second = again.encode(texts)
    assert again.served == 3
    np.testing.assert_allclose(second, embedder.encode(texts), atol=1e-5)
    np.testing.assert_allclose(first, second, atol=0)
