"""An agent's retrieval step: passages inside tool messages (plain or a JSON-dumped tool result)
are found by the automatic passage detection and served from the chunk cache."""

from __future__ import annotations

import json

import pytest

openai = pytest.importorskip("openai")

DOCS = ["The heapq module keeps a list as a binary heap: heappush and heappop run in logarithmic time each.",
        "A deque from collections appends and pops at both ends in constant time, unlike a list at its front.",
        "The bisect module finds insertion points in a sorted list by binary search, keeping it sorted."]


def _step(question: str, result: str) -> list[dict]:
    call = {"id": "call_0", "type": "function",
            "function": {"name": "search", "arguments": json.dumps({"q": question})}}
    return [{"role": "system", "content": "Answer from the tool results."},
            {"role": "user", "content": question},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_0", "content": result}]


@pytest.mark.parametrize("dump", [
    lambda docs: json.dumps([{"page_content": d, "metadata": {"i": i}} for i, d in enumerate(docs)]),
    lambda docs: json.dumps(docs),
    lambda docs: "\n\n".join(docs),
], ids=["documents", "strings", "plain"])
def test_a_tool_message_holding_passages_seen_before_yields_chunk_hits(live_server, dump):
    s = live_server(passages={"min_chars": 90})
    client = openai.OpenAI(base_url=s.base_url, api_key="none", max_retries=0)
    first = client.chat.completions.create(model="tiny", messages=_step("What is a heap?", dump(DOCS[:2])),
                                           max_tokens=2, temperature=0)
    served = first.model_extra["cachedrag"]
    assert served["chunks_hit"] == 0 and served["chunks_missed"] >= 2  # each passage its own chunk, cold
    later = client.chat.completions.create(model="tiny", messages=_step("And a queue?", dump(DOCS[:0:-1])),
                                           max_tokens=2, temperature=0)
    served = later.model_extra["cachedrag"]
    assert served["chunks_hit"] >= 1  # the passage seen in the earlier step, now at another position
    assert later.usage.prompt_tokens_details.cached_tokens > 0


def test_an_index_given_to_the_server_makes_its_chunks_known_whole(live_server, tmp_path):
    """``index=``: a tool result holding an index chunk of several paragraphs is one chunk, cut as the
    retriever cut it, from the first request on (not paragraph by paragraph, nor computed as new)."""
    from cachedrag.corpus import Document
    from cachedrag.retrieval.config import ChunkConfig, IndexConfig, RetrievalConfig
    from cachedrag.retrieval.embedder import Embedder
    from cachedrag.retrieval.index import build_index, load_index
    from cachedrag.testing import byte_tokenizer

    body = "\n\n".join(DOCS)  # one document of three paragraphs, each a passage on its own
    config = RetrievalConfig(chunk=ChunkConfig(chunk_tokens=400, overlap=0), index=IndexConfig(nlist=1))
    build_index([Document("d", body)], byte_tokenizer(), Embedder(), config, out=tmp_path / "idx", progress=False)
    (chunk,) = load_index(tmp_path / "idx").chunks
    assert chunk.text.count("\n\n") == 2
    plain = live_server(passages={"min_chars": 90})
    indexed = live_server(passages={"min_chars": 90}, index=str(tmp_path / "idx"))
    got = {}
    for name, s in (("plain", plain), ("indexed", indexed)):
        client = openai.OpenAI(base_url=s.base_url, api_key="none", max_retries=0)
        reply = client.chat.completions.create(model="tiny", messages=_step("What is a heap?", chunk.text),
                                               max_tokens=2, temperature=0)
        got[name] = reply.model_extra["cachedrag"]
    assert got["plain"]["chunks_missed"] >= 3  # cut at least paragraph by paragraph
    assert got["indexed"]["chunks_missed"] == 1 and got["indexed"]["chunks_hit"] == 0  # the index chunk, whole
