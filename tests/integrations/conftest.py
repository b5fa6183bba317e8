"""Fixtures of the integration tests: tiny shared engines, a tiny index, the default model's index.

Tiny engines (random weights, byte tokenizer, ChatML template) are registered under names so
the framework classes can be built from plain parameters, as the standard suites do.
"""

from __future__ import annotations

import asyncio

import pytest

from cachedrag.corpus import Document

TINY = "cachedrag-tiny-llama"
TINY_OTHER = "cachedrag-tiny-qwen2"

TINY_DOCS = [
    Document("heapq", "The heapq module provides an implementation of the heap queue algorithm, also known as the "
             "priority queue algorithm. heappush pushes a value onto the heap, maintaining the heap invariant."),
    Document("json", "The json module encodes and decodes JSON documents. json.dumps serializes an object to a JSON "
             "formatted string; pass indent to pretty-print it. json.loads parses a string."),
    Document("hashlib", "The hashlib module implements secure hash and message digest algorithms such as SHA-256. "
             "Call hashlib.sha256(data).hexdigest() to get the hexadecimal digest of some bytes."),
    Document("uuid", "The uuid module generates universally unique identifiers. uuid.uuid4 makes a random UUID; "
             "uuid.uuid1 uses the host id and the current time."),
]

# modules of the stdlib corpus for the default-model index (cut short: a few chunks each)
E2E_MODULES = ("json", "heapq", "bisect", "hashlib", "uuid", "textwrap")


def tiny_long_runner():
    """``tiny_runner("llama")`` with a 2,048-token window: LlamaIndex's default prompts are long in bytes."""
    from cachedrag.model.runner import ModelRunner
    from cachedrag.testing import byte_tokenizer, tiny_model

    tok = byte_tokenizer()
    model = tiny_model("llama", vocab_size=len(tok), max_position_embeddings=2048)
    model.generation_config.eos_token_id = tok.eos_token_id
    return ModelRunner(model, tok)


@pytest.fixture(scope="session")
def tiny_engine():
    """A tiny random Llama engine, registered as ``TINY`` (and a Qwen2 one as ``TINY_OTHER``)."""
    from cachedrag.engine import CachedEngine
    from cachedrag.integrations.engines import register_engine
    from cachedrag.testing import tiny_runner

    engine = CachedEngine(tiny_long_runner())
    register_engine(TINY, engine)
    register_engine(TINY_OTHER, CachedEngine(tiny_runner("qwen2", seed=1)))
    return engine


@pytest.fixture(scope="session")
def embedder():
    from cachedrag.retrieval.embedder import Embedder

    return Embedder()


@pytest.fixture(scope="session")
def tiny_index_dir(embedder, tmp_path_factory):
    """``TINY_DOCS`` in 64-byte chunks (byte tokenizer, overlap 8), nlist 2, saved to a directory."""
    from cachedrag.retrieval.config import ChunkConfig, IndexConfig, RetrievalConfig
    from cachedrag.retrieval.index import build_index
    from cachedrag.testing import byte_tokenizer

    out = tmp_path_factory.mktemp("tiny-index") / "index"
    config = RetrievalConfig(chunk=ChunkConfig(chunk_tokens=64, overlap=8), index=IndexConfig(nlist=2))
    build_index(TINY_DOCS, byte_tokenizer(), embedder, config, out=out, progress=False)
    return out


@pytest.fixture(scope="session")
def e2e_index_dir(embedder, tmp_path_factory):
    """A few stdlib modules' docs in 128-token chunks of the default model's tokenizer, nlist 4."""
    from cachedrag.corpus import stdlib_corpus
    from cachedrag.model.loader import load_default_tokenizer
    from cachedrag.retrieval.config import ChunkConfig, IndexConfig, RetrievalConfig
    from cachedrag.retrieval.index import build_index

    out = tmp_path_factory.mktemp("e2e-index") / "index"
    config = RetrievalConfig(chunk=ChunkConfig(chunk_tokens=128, overlap=16), index=IndexConfig(nlist=4))
    docs = stdlib_corpus(E2E_MODULES, max_chars_per_doc=3000)
    build_index(docs, load_default_tokenizer(), embedder, config, out=out, progress=False)
    return out


class LoopTicker:
    """Counts how often a sleeper of ``period`` seconds gets the event loop (``ticks``): work
    that blocks the loop stops the count. ``async with LoopTicker() as t: ...``."""

    def __init__(self, period: float = 0.005):
        self.period = period
        self.ticks = 0

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.period)
            self.ticks += 1

    async def __aenter__(self) -> LoopTicker:
        self._task = asyncio.create_task(self._run())
        await asyncio.sleep(0)
        return self

    async def __aexit__(self, *exc) -> None:
        self._task.cancel()
