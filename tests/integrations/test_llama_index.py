"""LlamaIndex classes on a tiny engine and a tiny index: LLM API, async, retriever, postprocessor."""

from __future__ import annotations

import pytest
from llama_index.core import QueryBundle
from llama_index.core.base.llms.types import ChatMessage, ImageBlock, TextBlock
from llama_index.core.query_engine import RetrieverQueryEngine
from llama_index.core.schema import NodeWithScore, TextNode

from cachedrag.prompt.registry import ChunkRegistry, chunk_registry
from cachedrag.integrations.llama_index import CachedRAGLLM, CachedRAGNodePostprocessor, CachedRAGRetriever

from .conftest import TINY, LoopTicker

A = "The heapq module provides an implementation of the heap queue algorithm."


@pytest.fixture
def llm(tiny_engine):
    return CachedRAGLLM(model=TINY, max_new_tokens=6)


def test_fields_and_metadata(llm, tiny_engine):
    meta = llm.metadata
    assert meta.context_window == tiny_engine.runner.max_context
    assert meta.num_output == 6 and meta.model_name == TINY and meta.is_chat_model
    assert CachedRAGLLM(model=TINY, context_window=4096).metadata.context_window == 4096
    for name in ("model", "max_new_tokens", "temperature", "stop", "reuse_mode", "timeout"):
        assert CachedRAGLLM.model_fields[name].description
    assert "_engine" in CachedRAGLLM.__private_attributes__
    assert CachedRAGLLM.class_name() == "CachedRAGLLM"


def test_complete_and_chat_agree(llm):
    c = llm.complete("What is a heap?")
    m = llm.chat([ChatMessage(role="user", content="What is a heap?")])
    assert c.text == m.message.content and m.message.role.value == "assistant"
    assert c.raw["prompt_tokens"] > 0 and c.additional_kwargs["total_tokens"] == (
        c.additional_kwargs["prompt_tokens"] + c.additional_kwargs["completion_tokens"])
    assert llm.last_stats["finish_reason"] in ("stop", "length")


def test_streams_accumulate_to_the_answer(llm):
    full = llm.complete("stream me").text
    parts = list(llm.stream_complete("stream me"))
    assert "".join(p.delta for p in parts) == parts[-1].text == full
    assert parts[-1].delta == "" and parts[-1].raw is not None and all(p.raw is None for p in parts[:-1])
    chat_parts = list(llm.stream_chat([ChatMessage(role="user", content="stream me")]))
    assert chat_parts[-1].message.content == full


def test_formatted_prompt_is_not_wrapped(llm):
    raw = llm.complete("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", formatted=True)
    wrapped = llm.complete("hi")
    assert raw.text == wrapped.text  # the same rendered input, once by hand and once by the template


def test_system_prompt_goes_into_the_template(tiny_engine):
    llm = CachedRAGLLM(model=TINY, max_new_tokens=4, system_prompt="Be brief.")
    rendered = llm._completion_prompt("hi", formatted=False)
    assert rendered.text.startswith("<|im_start|>system\nBe brief.<|im_end|>")


def test_per_call_kwargs_and_stop(llm):
    free = llm.complete("count", max_tokens=10).text
    assert len(llm.last_stats and llm.complete("count", max_new_tokens=2).raw["chunk_cfo"]) == 0
    assert llm.last_stats["prompt_tokens"] > 0
    cut = next((i for i in range(1, len(free)) if free[i].isprintable() and free[i] not in free[:i]), None)
    if cut is not None:
        assert CachedRAGLLM(model=TINY, max_new_tokens=10, stop=[free[cut]]).complete("count").text == free[:cut]


def test_non_text_blocks_are_rejected(llm):
    msg = ChatMessage(role="user", blocks=[TextBlock(text="look"), ImageBlock(url="http://example.invalid/x.png")])
    with pytest.raises(ValueError, match="text only"):
        llm.chat([msg])


async def test_async_variants_match_sync(llm):
    sync = llm.complete("async?").text
    assert (await llm.acomplete("async?")).text == sync
    assert (await llm.achat([ChatMessage(role="user", content="async?")])).message.content == sync
    gen = await llm.astream_complete("async?")
    assert "".join([r.delta async for r in gen]) == sync
    gen = await llm.astream_chat([ChatMessage(role="user", content="async?")])
    assert [r async for r in gen][-1].message.content == sync


async def test_async_generation_does_not_block_the_event_loop(tiny_engine):
    llm = CachedRAGLLM(model=TINY, max_new_tokens=1000)  # ~0.15 s even on a fast CPU
    async with LoopTicker() as loop:
        before = loop.ticks
        response = await llm.acomplete("write a long answer " * 4)
        during_complete = loop.ticks - before
        before = loop.ticks
        async for _ in await llm.astream_complete("write another long answer " * 4):
            pass
        during_stream = loop.ticks - before
    assert response.raw["total_s"] > 0.05
    assert during_complete >= 3 and during_stream >= 3


def test_retriever_returns_chunks_and_registers_them(tiny_index_dir):
    reg = ChunkRegistry()
    retriever = CachedRAGRetriever(index_dir=str(tiny_index_dir), similarity_top_k=2, chunk_registry=reg,
                                   auto_prefetch=False)
    nodes = retriever.retrieve("How do I pretty-print JSON?")
    assert len(nodes) == 2 and all(isinstance(n, NodeWithScore) for n in nodes)
    top = nodes[0].node
    assert top.node_id == top.metadata["chunk_id"] and top.metadata["doc_id"] == "json"
    assert nodes[0].score >= nodes[1].score
    for n in nodes:  # registered unless too short to be worth caching
        text = n.node.get_content()
        assert (text in reg) == (len(text.strip()) >= reg.config.min_chars)
    # metadata stays out of the LLM's view: the prompt holds the chunk text itself
    assert top.get_content(metadata_mode="llm") == top.get_content()


def test_retriever_uses_embedding_strs(tiny_index_dir):
    retriever = CachedRAGRetriever(index_dir=str(tiny_index_dir), similarity_top_k=3, auto_prefetch=False)
    hyde = QueryBundle("short question", custom_embedding_strs=["uuid4 makes a random UUID", "short question"])
    direct = retriever._searcher.search(["uuid4 makes a random UUID", "short question"], k=3)
    assert [n.node.node_id for n in retriever.retrieve(hyde)] == [h.chunk_id for h in direct]


async def test_retriever_async(tiny_index_dir):
    retriever = CachedRAGRetriever(index_dir=str(tiny_index_dir), similarity_top_k=2, auto_prefetch=False)
    nodes = await retriever.aretrieve("SHA-256 hexdigest")
    assert nodes[0].node.metadata["doc_id"] == "hashlib"


def test_query_engine_prefetches_the_original_query_and_hits_chunk_caches(tiny_index_dir, tiny_engine):
    llm = CachedRAGLLM(model=TINY, max_new_tokens=4)
    retriever = CachedRAGRetriever(index_dir=str(tiny_index_dir), similarity_top_k=2)
    engine = RetrieverQueryEngine.from_args(retriever, llm=llm)
    question = "What does uuid4 do?"
    first = engine.query(question)
    assert retriever._searcher.last_prefetch_query == question  # QueryStartEvent started the lookahead
    assert [n.node.node_id for n in first.source_nodes]
    assert llm.last_stats["registered_chunks"] == 2
    engine.query(question)
    # both registered chunks from cache (template text between them, shorter than min_reuse_tokens, is computed)
    assert llm.last_stats["registered_chunks_cached"] == 2 and llm.last_stats["registered_chunks_computed"] == 0
    retriever.close()


def test_postprocessor_registers_foreign_nodes_unchanged():
    reg = ChunkRegistry()
    post = CachedRAGNodePostprocessor(chunk_registry=reg)
    nodes = [NodeWithScore(node=TextNode(text=A, metadata={"source": "x"}), score=0.5)]
    assert post.postprocess_nodes(nodes, query_str="q") == nodes
    assert A in reg
    CachedRAGNodePostprocessor().postprocess_nodes([NodeWithScore(node=TextNode(text=A + " (global)"))])
    assert A + " (global)" in chunk_registry()


@pytest.fixture
def query_engine_parts(tiny_index_dir, tiny_engine):
    llm = CachedRAGLLM(model=TINY, max_new_tokens=4)
    retriever = CachedRAGRetriever(index_dir=str(tiny_index_dir), similarity_top_k=2)
    yield llm, retriever
    retriever.close()


def test_query_engine_response_metadata_carries_the_cache_stats(query_engine_parts):
    from cachedrag.integrations.llama_index import _query_spans

    llm, retriever = query_engine_parts
    engine = RetrieverQueryEngine.from_args(retriever, llm=llm)
    question = "What does hashlib.sha256 do?"
    first = engine.query(question)
    stats = first.metadata["cachedrag"]
    assert stats["llm_calls"] == 1 and stats["calls"] == [llm.last_stats]
    for name in ("prompt_tokens", "cached_tokens", "recomputed_tokens", "checked_tokens", "chunks_hit"):
        assert stats[name] == llm.last_stats[name]
    assert all(n.node.node_id in first.metadata for n in first.source_nodes)  # LlamaIndex's own entries stay
    second = engine.query(question).metadata["cachedrag"]
    assert second["llm_calls"] == 1 and second["registered_chunks_cached"] == 2
    assert second["cached_tokens"] > 0 and second["cached_fraction"] == second["cached_tokens"] / second["prompt_tokens"]
    assert not _query_spans._queries  # nothing kept once the queries ended


def test_nested_queries_sum_their_llm_calls(query_engine_parts):
    from llama_index.core.indices.query.query_transform import HyDEQueryTransform
    from llama_index.core.query_engine import TransformQueryEngine

    llm, retriever = query_engine_parts
    inner = RetrieverQueryEngine.from_args(retriever, llm=llm)
    outer = TransformQueryEngine(inner, HyDEQueryTransform(llm=llm, include_original=True))
    stats = outer.query("What does uuid4 do?").metadata["cachedrag"]
    assert stats["llm_calls"] == 2  # the hypothetical document, then the answer (the inner query's call)
    assert stats["prompt_tokens"] == sum(c["prompt_tokens"] for c in stats["calls"])
    assert stats["calls"][-1] == llm.last_stats


def test_streaming_and_async_queries_get_their_stats(query_engine_parts):
    import asyncio

    llm, retriever = query_engine_parts
    streaming = RetrieverQueryEngine.from_args(retriever, llm=llm, streaming=True).query("What does uuid4 do?")
    assert streaming.metadata["cachedrag"]["llm_calls"] == 0  # the answer has not been generated yet
    "".join(streaming.response_gen)
    assert streaming.metadata["cachedrag"]["llm_calls"] == 1
    assert streaming.metadata["cachedrag"]["calls"] == [llm.last_stats]
    response = asyncio.run(RetrieverQueryEngine.from_args(retriever, llm=llm).aquery("What does uuid4 do?"))
    assert response.metadata["cachedrag"]["calls"] == [llm.last_stats]


def test_a_failed_query_leaves_nothing_behind(query_engine_parts):
    from cachedrag.integrations.llama_index import _query_spans

    llm, retriever = query_engine_parts

    class Broken(RetrieverQueryEngine):
        def _query(self, query_bundle):
            llm.complete("hi")
            raise RuntimeError("boom")

    engine = Broken.from_args(retriever, llm=llm)
    with pytest.raises(RuntimeError, match="boom"):
        engine.query("anything")
    assert not _query_spans._queries
    assert llm.complete("hi").raw == llm.last_stats  # a call outside any query still works


def test_a_query_without_our_llm_gets_no_stats(query_engine_parts):
    from llama_index.core.llms import MockLLM

    _, retriever = query_engine_parts
    response = RetrieverQueryEngine.from_args(retriever, llm=MockLLM(max_tokens=4)).query("What does uuid4 do?")
    assert "cachedrag" not in (response.metadata or {})


def test_async_streaming_query_gets_its_stats(query_engine_parts):
    import asyncio

    llm, retriever = query_engine_parts
    engine = RetrieverQueryEngine.from_args(retriever, llm=llm, streaming=True, use_async=True)

    async def run():
        response = await engine.aquery("What does uuid4 do?")
        text = "".join([t async for t in response.async_response_gen()])
        return response, text

    response, text = asyncio.run(run())
    assert response.metadata["cachedrag"]["llm_calls"] == 1
    assert response.metadata["cachedrag"]["calls"] == [llm.last_stats]
