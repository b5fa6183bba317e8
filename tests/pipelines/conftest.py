"""Fixtures of the pipeline tests: a tiny engine, a tiny saved index, scripted fakes."""

from __future__ import annotations

import math

import pytest

from cachedrag.pipelines.generators import Generation, GenerationRequest
from cachedrag.pipelines.retrievers import SearchResult
from cachedrag.testing import TINY_DOCS


QUESTION = "How do I pretty-print JSON?"


@pytest.fixture(scope="session")
def tiny_runner():
    from cachedrag.testing import tiny_runner

    return tiny_runner("llama")


@pytest.fixture(scope="session")
def tiny_index(tiny_runner, tmp_path_factory):
    """The tiny corpus in 48-byte chunks (the tiny model's byte tokenizer), nlist 4, saved."""
    from cachedrag.retrieval.config import ChunkConfig, IndexConfig, RetrievalConfig
    from cachedrag.retrieval.embedder import Embedder
    from cachedrag.retrieval.index import build_index

    config = RetrievalConfig(chunk=ChunkConfig(chunk_tokens=48, overlap=8), index=IndexConfig(nlist=4))
    out = tmp_path_factory.mktemp("pipelines") / "index"
    return build_index(TINY_DOCS, tiny_runner.tokenizer, Embedder(), config, out=out, progress=False)


@pytest.fixture
def engine(tiny_runner):
    from cachedrag.config import EngineConfig
    from cachedrag.engine import CachedEngine

    return CachedEngine(tiny_runner, config=EngineConfig(cache_bytes=64 << 20))


@pytest.fixture
def lookahead(tiny_index):
    from cachedrag.pipelines.retrievers import LookaheadSearch
    from cachedrag.retrieval.config import LookaheadConfig, SearchConfig
    from cachedrag.retrieval.lookahead import LookaheadRetriever

    retriever = LookaheadRetriever.from_index(tiny_index, device="cpu", config=LookaheadConfig(),
                                              search_config=SearchConfig(k=3, nprobe=2))
    search = LookaheadSearch(retriever, tiny_index)
    yield search
    search.close()


class ByteTokenizer:
    """Enough of a tokenizer for scripted generations: one token per character."""

    def encode(self, text, add_special_tokens=False):
        return [ord(c) for c in text]

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(i) for i in ids)


class ScriptedGenerator:
    """A generator that replays scripted (text, per-character probability) outputs and logs requests.

    ``script`` maps a step marker found in the request (system prompt or user text) to a list
    of outputs used in turn; an output is a text or (text, [prob per character]).
    """

    def __init__(self, script: dict[str, list], events: list | None = None):
        self.tokenizer = ByteTokenizer()
        self.script = {k: list(v) for k, v in script.items()}
        self.requests: list[GenerationRequest] = []
        self.events = events if events is not None else []

    def generate(self, request: GenerationRequest) -> Generation:
        self.requests.append(request)
        self.events.append(("generate", request.user))
        for marker, outputs in self.script.items():
            if marker in (request.system or "") or marker in request.user:
                item = outputs.pop(0) if len(outputs) > 1 else outputs[0]
                break
        else:
            item = "I do not know."
        text, probs = (item, [0.9] * len(item)) if isinstance(item, str) else item
        ids = [ord(c) for c in text][: request.max_new_tokens]
        logprobs = [math.log(p) for p in probs][: len(ids)]
        out = "".join(chr(i) for i in ids)
        finish = "length" if len(ids) == request.max_new_tokens else "stop"
        for s in request.stop:  # the engine's rule: stop once the text contains a stop string
            at = out.find(s)
            if at >= 0:
                ids, logprobs, out, finish = ids[: at + len(s)], logprobs[: at + len(s)], out[:at], "stop"
        return Generation(text=out, token_ids=ids, token_logprobs=logprobs, finish_reason=finish,
                          prompt_tokens=len(request.user), computed_tokens=len(request.user), seconds=0.0)


class FakeRetriever:
    """Chunks named after the query; logs prefetch/search calls into ``events``."""

    def __init__(self, events: list | None = None):
        self.events = events if events is not None else []
        self.queries: list[list[str]] = []

    def prefetch(self, query: str) -> None:
        self.events.append(("prefetch", query))

    def search(self, queries, k):
        self.events.append(("search", list(queries)))
        self.queries.append(list(queries))
        return SearchResult([[f"chunk {j} for {q}" for j in range(k)] for q in queries],
                            [[f"{q[:8]}#{j}" for j in range(k)] for q in queries], 0.0, {"hit_rate": 1.0})

    def prefetch_report(self):
        return {"elapsed_ms": 1.0, "clusters": [0]}
