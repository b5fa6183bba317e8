"""The OpenAI client classes (LlamaIndex ``OpenAILike``, LangChain ``ChatOpenAI``) against a live server."""

from __future__ import annotations

import asyncio

import pytest
from pydantic import BaseModel, Field

from cachedrag.prompt.registry import ChunkRegistry
from cachedrag.integrations.openai_transport import attach_chunks
from cachedrag.testing import TINY_DOCS

CHUNKS = [TINY_DOCS[1].text, TINY_DOCS[2].text]
PROMPT = f"Context:\n\n{CHUNKS[0]}\n\n{CHUNKS[1]}\n\nQuestion: what are they?"


def _registry():
    reg = ChunkRegistry()
    reg.register(CHUNKS)
    return reg


def _recording(server):
    """Wrap the server's prompt planner: record the explicit chunks each request carried."""
    planner = server.app.state.planner
    seen = []
    chat, completion = planner.chat, planner.completion

    def record_chat(messages, chunks=None, **kw):
        seen.append(list(chunks or []))
        return chat(messages, chunks, **kw)

    def record_completion(prompt, chunks=None):
        seen.append(list(chunks or []))
        return completion(prompt, chunks)

    planner.chat, planner.completion = record_chat, record_completion
    return seen


def test_attach_chunks_adds_only_registered_texts_found_in_the_body():
    reg = _registry()
    body = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": PROMPT}]}
    assert attach_chunks(body, reg) and body["cachedrag"] == {"chunks": CHUNKS}
    assert not attach_chunks(body, reg)  # already there: unchanged
    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": PROMPT}]}]}
    assert attach_chunks(parts, reg) and parts["cachedrag"]["chunks"] == CHUNKS
    assert attach_chunks(completion := {"prompt": "x " + CHUNKS[1]}, reg) and completion["cachedrag"]["chunks"] == CHUNKS[1:]
    plain = {"messages": [{"role": "user", "content": "nothing registered here"}]}
    assert not attach_chunks(plain, reg) and "cachedrag" not in plain


def test_openai_sdk_with_the_chunk_client(live_server):
    openai = pytest.importorskip("openai")
    from cachedrag.integrations.openai_transport import chunk_http_client

    s = live_server(passages={"enabled": False})
    seen = _recording(s)
    client = openai.OpenAI(base_url=s.base_url, api_key="none", http_client=chunk_http_client(_registry()))
    client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": PROMPT}], max_tokens=2)
    client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "no chunks"}], max_tokens=2)
    assert seen == [CHUNKS, []]


def test_llama_index_openai_like_sends_the_chunks(live_server):
    pytest.importorskip("llama_index.llms.openai_like")
    from llama_index.core.llms import ChatMessage

    from cachedrag.integrations.openai_llama_index import CachedRAGOpenAILike

    s = live_server(passages={"enabled": False})
    seen = _recording(s)
    llm = CachedRAGOpenAILike(model="tiny", api_base=s.base_url, chunk_registry=_registry(), max_tokens=3,
                              temperature=0.0)
    reply = llm.chat([ChatMessage(role="user", content=PROMPT)])
    streamed = "".join(r.delta or "" for r in llm.stream_chat([ChatMessage(role="user", content=PROMPT)]))
    done = asyncio.run(llm.acomplete(PROMPT))
    assert reply.message.content == streamed  # same prompt, greedy
    assert done.text is not None
    assert seen == [CHUNKS, CHUNKS, CHUNKS]
    usage = reply.raw.usage
    assert usage.completion_tokens == 3


def test_langchain_chat_openai_sends_the_chunks_and_reports_cache_reads(live_server):
    pytest.importorskip("langchain_openai")
    from cachedrag.integrations.openai_langchain import ChatCachedRAGOpenAI

    s = live_server(passages={"enabled": False})
    seen = _recording(s)
    llm = ChatCachedRAGOpenAI(model="tiny", base_url=s.base_url, chunk_registry=_registry(), max_tokens=3,
                              temperature=0.0)
    first = llm.invoke(PROMPT)
    second = llm.invoke(PROMPT)
    pieces = [c.content for c in llm.stream(PROMPT)]
    third = asyncio.run(llm.ainvoke(PROMPT))
    assert seen == [CHUNKS] * 4
    assert first.usage_metadata["input_token_details"].get("cache_read", 0) == 0
    assert second.usage_metadata["input_token_details"]["cache_read"] > sum(len(c.encode()) for c in CHUNKS)
    assert "".join(pieces) == second.content == third.content


class Pick(BaseModel):
    ok: bool
    n: int = Field(ge=0, le=99)  # bounded: a random-weight model would write digits to max_tokens


def test_langchain_structured_output_through_the_server(live_server, long_engine):
    """``ChatOpenAI.with_structured_output`` sends a JSON schema (default) or a named tool; the
    server constrains decoding to it, so even a random-weight model answers with a ``Pick``."""
    pytest.importorskip("langchain_openai")
    from cachedrag.integrations.openai_langchain import ChatCachedRAGOpenAI

    s = live_server(long_engine, passages={"enabled": False})  # tools take a system prompt
    # 120 byte tokens: a call in the generic envelope is ~60
    llm = ChatCachedRAGOpenAI(model="tiny", base_url=s.base_url, max_tokens=120, temperature=0.0)
    for method in ("json_schema", "function_calling"):
        pick = llm.with_structured_output(Pick, method=method).invoke("Pick one.")
        assert isinstance(pick, Pick) and 0 <= pick.n <= 99
    raw = llm.with_structured_output(Pick, include_raw=True).invoke("Pick one.")
    assert raw["parsing_error"] is None and isinstance(raw["parsed"], Pick)


def test_llama_index_structured_predict_through_the_server(live_server):
    pytest.importorskip("llama_index.llms.openai_like")
    from llama_index.core.prompts import PromptTemplate

    from cachedrag.integrations.openai_llama_index import CachedRAGOpenAILike

    s = live_server(passages={"enabled": False})
    llm = CachedRAGOpenAILike(model="tiny", api_base=s.base_url, max_tokens=40, temperature=0.0)
    pick = llm.structured_predict(Pick, PromptTemplate("Pick one for {who}."), who="me")
    assert isinstance(pick, Pick) and 0 <= pick.n <= 99
    again = asyncio.run(llm.astructured_predict(Pick, PromptTemplate("Pick one for {who}."), who="me"))
    assert again == pick  # greedy, same prompt


def test_langchain_logprobs_through_the_server(live_server):
    """``ChatOpenAI(logprobs=True)`` (what LangChain's FLARE chain reads) gets one entry per token."""
    pytest.importorskip("langchain_openai")
    from cachedrag.integrations.openai_langchain import ChatCachedRAGOpenAI

    s = live_server(passages={"enabled": False})
    llm = ChatCachedRAGOpenAI(model="tiny", base_url=s.base_url, max_tokens=5, temperature=0.0, logprobs=True)
    reply = llm.invoke("Say something.")
    content = reply.response_metadata["logprobs"]["content"]
    assert len(content) == 5 and all(e["logprob"] <= 0 for e in content)
