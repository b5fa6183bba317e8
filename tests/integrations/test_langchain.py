"""LangChain classes on a tiny engine and a tiny index: LCEL chains, messages, usage, async, retriever."""

from __future__ import annotations

import pytest
from langchain_core.documents import Document
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage
from langchain_core.output_parsers import StrOutputParser
from langchain_core.prompts import ChatPromptTemplate
from langchain_core.runnables import RunnablePassthrough

from cachedrag.prompt.registry import ChunkRegistry
from cachedrag.integrations.langchain import CachedRAGRetriever, ChatCachedRAG, _messages

from .conftest import TINY, LoopTicker


@pytest.fixture
def chat(tiny_engine):
    return ChatCachedRAG(model=TINY, max_tokens=6)


@pytest.fixture
def retriever(tiny_index_dir):
    return CachedRAGRetriever(index_dir=str(tiny_index_dir), k=2)


def format_docs(docs):
    return "\n\n".join(d.page_content for d in docs)


@pytest.fixture
def chain(retriever, chat):
    prompt = ChatPromptTemplate.from_messages([
        ("system", "Answer from the context."),
        ("human", "Context:\n{context}\n\nQuestion: {question}"),
    ])
    return {"context": retriever | format_docs, "question": RunnablePassthrough()} | prompt | chat | StrOutputParser()


def test_fields_are_the_standard_params(chat):
    for name in ("model", "temperature", "max_tokens", "stop", "timeout", "max_retries"):
        assert name in ChatCachedRAG.model_fields and ChatCachedRAG.model_fields[name].description
    params = chat._get_ls_params(stop=["x"])
    assert params["ls_provider"] == "cachedrag" and params["ls_model_name"] == TINY and params["ls_stop"] == ["x"]
    assert "_engine" in ChatCachedRAG.__private_attributes__


def test_lcel_invoke_stream_batch(chain):
    answer = chain.invoke("How do I pretty-print JSON?")
    assert isinstance(answer, str)
    assert "".join(chain.stream("How do I pretty-print JSON?")) == answer
    assert chain.batch(["How do I pretty-print JSON?", "What does uuid4 do?"])[0] == answer


async def test_lcel_ainvoke_and_astream(chain):
    answer = await chain.ainvoke("What does uuid4 do?")
    assert "".join([d async for d in chain.astream("What does uuid4 do?")]) == answer


def test_chain_prompt_hits_the_chunk_caches(retriever, chat):
    prompt = ChatPromptTemplate.from_template("Docs:\n{context}\nQ: {question}")
    chain = {"context": retriever | format_docs, "question": RunnablePassthrough()} | prompt | chat
    chain.invoke("SHA-256 hexdigest of bytes")
    second = chain.invoke("SHA-256 hexdigest of bytes")
    cache = second.response_metadata["cache"]
    assert cache["registered_chunks"] >= 1 and cache["registered_chunks_cached"] == cache["registered_chunks"]
    assert cache["chunks_missed"] == 0
    assert second.usage_metadata["input_token_details"]["cache_read"] > 0
    assert second.response_metadata["model_name"] == TINY


def test_usage_and_metadata_on_invoke_and_stream(chat):
    msg = chat.invoke("hello")
    usage = msg.usage_metadata
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
    assert msg.response_metadata["finish_reason"] in ("stop", "length")
    chunks = list(chat.stream("hello"))
    assert chunks[-1].chunk_position == "last" and chunks[-1].usage_metadata["input_tokens"] == usage["input_tokens"]
    assert sum(c.usage_metadata is not None for c in chunks) == 1
    assert "".join(c.text for c in chunks) == msg.text


def test_all_messages_go_through_the_chat_template(tiny_engine):
    messages = [SystemMessage("sys"), HumanMessage("q1"), AIMessage("a1"),
                HumanMessage([{"type": "text", "text": "q2"}]), ToolMessage("42", tool_call_id="t")]
    msgs = _messages(messages)
    assert [m.role for m in msgs] == ["system", "human", "ai", "human", "tool"]
    rendered = ChatCachedRAG(model=TINY)._generator.render_messages(msgs).text
    assert rendered.startswith("<|im_start|>system\nsys<|im_end|>")
    assert "<|im_start|>assistant\na1<|im_end|>" in rendered
    with pytest.raises(ValueError, match="text only"):
        _messages([HumanMessage([{"type": "image_url", "image_url": {"url": "http://example.invalid/x.png"}}])])


def test_registered_chunk_in_an_earlier_message_is_a_cache_segment(tiny_engine):
    reg = ChunkRegistry()
    text = "A retrieved passage quoted in an earlier turn of the conversation, long enough to register."
    reg.register([text])
    chat = ChatCachedRAG(model=TINY, max_tokens=3, chunk_registry=reg)
    msg = chat.invoke([HumanMessage(f"Read: {text}"), AIMessage("ok"), HumanMessage("and?")])
    assert msg.response_metadata["cache"]["registered_chunks"] == 1


def test_timeout(tiny_engine):
    with pytest.raises(TimeoutError):
        ChatCachedRAG(model=TINY, max_tokens=200, timeout=1e-6).invoke("go on")


async def test_async_does_not_block_the_event_loop(tiny_engine):
    chat = ChatCachedRAG(model=TINY, max_tokens=1000)  # ~0.15 s even on a fast CPU
    async with LoopTicker() as loop:
        before = loop.ticks
        await chat.ainvoke("write a long answer " * 4)
        during_invoke = loop.ticks - before
        before = loop.ticks
        async for _ in chat.astream("write another long answer " * 4):
            pass
    assert during_invoke >= 3 and loop.ticks - before >= 3


def test_retriever_documents_and_registration(tiny_index_dir):
    reg = ChunkRegistry()
    retriever = CachedRAGRetriever(index_dir=str(tiny_index_dir), k=3, chunk_registry=reg)
    docs = retriever.invoke("random UUID")
    assert len(docs) == 3 and all(isinstance(d, Document) for d in docs)
    assert docs[0].id == docs[0].metadata["chunk_id"] and docs[0].metadata["doc_id"] == "uuid"
    assert docs[0].metadata["score"] >= docs[1].metadata["score"] and docs[0].metadata["rank"] == 0
    assert any(d.page_content.strip() in reg for d in docs)
    assert len(retriever.invoke("random UUID", k=1)) == 1
    assert retriever.prefetch("random UUID") in (True, False)
