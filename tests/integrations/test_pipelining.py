"""Speculative pipelining through the framework retrievers' ``pipelining=`` option (tiny model)."""

from __future__ import annotations

import threading

import pytest
from langchain_core.output_parsers import StrOutputParser
from langchain_core.prompts import ChatPromptTemplate
from langchain_core.runnables import RunnablePassthrough
from llama_index.core.query_engine import RetrieverQueryEngine

from cachedrag.engine import CachedEngine
from cachedrag.prompt.registry import ChunkRegistry
from cachedrag.integrations.speculation import PromptShape, pipelining_option
from cachedrag.prompt.splitter import SplitPrompt
from cachedrag.retrieval.config import PipeliningConfig

from .conftest import tiny_long_runner

QUESTIONS = ["How do I pretty-print JSON?", "What does uuid4 do?", "SHA-256 hexdigest of some bytes"]
# speculate on every request (the tiny index's searches are far shorter than min_search_s)
ALWAYS = PipeliningConfig(max_stages=2, min_search_s=0.0)


@pytest.fixture(scope="module")
def runner():
    return tiny_long_runner()


def _gate(searcher, engine):
    """Later search stages wait until the engine prefilled the whole previous stage speculatively,
    so the test does not depend on how fast the tiny search is. Returns the step counter."""
    state = {"steps": 0}
    cond = threading.Condition()
    generate, stages = engine.generate_segments, searcher.search_stages

    def counting(segments, params, **kw):
        out = generate(segments, params, **kw)
        if params.max_new_tokens == 1 and not kw.get("stream"):  # a speculative step
            with cond:
                state["steps"] += 1
                cond.notify_all()
        return out

    def gated(texts, k, n_stages, nprobe=None):
        seen, width = state["steps"], 0
        for index, hits, final in stages(texts, k, n_stages, nprobe=nprobe):
            if index > 0:
                with cond:
                    assert cond.wait_for(lambda: state["steps"] >= seen + width, timeout=30)
            width = len(hits)
            yield index, hits, final

    engine.generate_segments = counting
    searcher.search_stages = gated
    return state


def _llama_index_answers(runner, index_dir, pipelining):
    from cachedrag.integrations.llama_index import CachedRAGLLM, CachedRAGRetriever

    engine, reg = CachedEngine(runner), ChunkRegistry()
    llm = CachedRAGLLM(engine=engine, chunk_registry=reg, max_new_tokens=6)
    retriever = CachedRAGRetriever(index_dir=str(index_dir), similarity_top_k=2, chunk_registry=reg,
                                   auto_prefetch=False, pipelining=pipelining)
    if pipelining:
        _gate(retriever._searcher, engine)
    query_engine = RetrieverQueryEngine.from_args(retriever, llm=llm)
    out = []
    for q in QUESTIONS:
        response = query_engine.query(q)
        out.append((str(response), [n.node.node_id for n in response.source_nodes], retriever.last_speculation
                    if pipelining else None, llm.last_stats))
    return out


def test_llama_index_pipelined_answers_equal_the_plain_ones(runner, tiny_index_dir):
    plain = _llama_index_answers(runner, tiny_index_dir, False)
    piped = _llama_index_answers(runner, tiny_index_dir, ALWAYS)
    assert [(a, ids) for a, ids, _, _ in piped] == [(a, ids) for a, ids, _, _ in plain]
    first = piped[0][2]
    assert first["stages"] == 1 and "no LLM prompt" in first["pipelining"]  # no prompt shape learnt yet
    kept = 0
    for (_, _, spec, stats), (_, _, _, ref) in zip(piped[1:], plain[1:]):
        assert spec["stages"] == 2 and spec["speculative_steps"] >= 1
        if spec["kept_chunks"]:  # the LLM call found the speculated chunks in the knowledge tree
            kept += 1
            assert stats["prefix_hit_tokens"] > ref["prefix_hit_tokens"]
            assert stats["computed_tokens"] < ref["computed_tokens"]
    assert kept >= 1


def _langchain_answers(runner, index_dir, pipelining):
    from cachedrag.integrations.langchain import CachedRAGRetriever, ChatCachedRAG

    engine, reg = CachedEngine(runner), ChunkRegistry()
    chat = ChatCachedRAG(engine=engine, chunk_registry=reg, max_tokens=6)
    retriever = CachedRAGRetriever(index_dir=str(index_dir), k=2, chunk_registry=reg, pipelining=pipelining)
    if pipelining:
        _gate(retriever._searcher, engine)
    prompt = ChatPromptTemplate.from_messages([
        ("system", "Answer from the context."),
        ("human", "Context:\n{context}\n\nQuestion: {question}"),
    ])
    fmt = lambda docs: "\n\n".join(d.page_content for d in docs)  # noqa: E731
    chain = {"context": retriever | fmt, "question": RunnablePassthrough()} | prompt | chat | StrOutputParser()
    out = []
    for q in QUESTIONS:
        out.append((chain.invoke(q), retriever.last_speculation))
    return out


def test_langchain_pipelined_answers_equal_the_plain_ones(runner, tiny_index_dir):
    plain = _langchain_answers(runner, tiny_index_dir, False)
    piped = _langchain_answers(runner, tiny_index_dir, ALWAYS)
    assert [a for a, _ in piped] == [a for a, _ in plain]
    assert piped[0][1]["stages"] == 1
    specs = [s for _, s in piped[1:]]
    assert all(s["stages"] == 2 and s["speculative_steps"] >= 1 for s in specs)
    assert any(s["kept_chunks"] >= 1 for s in specs)


def test_prompt_shape_repeats_the_last_separator():
    split = SplitPrompt([("text", "<s>sys"), ("text", "Context:\n"), ("chunk", "A" * 40), ("text", "\n\n"),
                         ("chunk", "B" * 40), ("text", "\nQ: why?")], 2, 80)
    shape = PromptShape.of(split, CachedEngine.__new__(CachedEngine), None)
    assert shape.lead == ("<s>sys", "Context:\n") and shape.separators == (("\n\n",),)
    assert shape.parts(["x", "y", "z"]) == [("text", "<s>sys"), ("text", "Context:\n"), ("chunk", "x"),
                                            ("text", "\n\n"), ("chunk", "y"), ("text", "\n\n"), ("chunk", "z")]
    assert PromptShape.of(SplitPrompt([("text", "no chunks")], 0, 0), None, None) is None


@pytest.mark.parametrize("value, on", [(False, False), (None, False), (True, True), ({"max_stages": 3}, True)])
def test_pipelining_option_values(value, on):
    option = pipelining_option(value)
    assert (option is not None) == on
    if isinstance(value, dict):
        assert option.config.max_stages == 3


def test_pipelining_option_rejects_bad_values():
    from cachedrag.errors import ConfigError

    with pytest.raises(ConfigError):
        pipelining_option({"max_stages": 0})
    with pytest.raises(TypeError):
        pipelining_option("yes")
