"""LlamaIndex query engines end to end on the default model (SmolLM2-135M-Instruct).

Asserts well-formed results and cache behaviour, never answer wording. Answers are kept
short (``max_new_tokens``) so the whole module runs in well under a minute on 2 cores.
Nothing reaches for OpenAI: every engine gets the LLM explicitly and ``Settings`` holds
cachedrag's LLM and a mock embedding model for the duration of the module.
"""

from __future__ import annotations

import pytest
from llama_index.core import Settings
from llama_index.core.embeddings import MockEmbedding
from llama_index.core.indices.query.query_transform import HyDEQueryTransform, StepDecomposeQueryTransform
from llama_index.core.query_engine import (
    FLAREInstructQueryEngine,
    MultiStepQueryEngine,
    RetrieverQueryEngine,
    SubQuestionQueryEngine,
    TransformQueryEngine,
)
from llama_index.core.question_gen import LLMQuestionGenerator
from llama_index.core.question_gen.types import SubQuestion
from llama_index.core.response_synthesizers import get_response_synthesizer
from llama_index.core.schema import QueryBundle
from llama_index.core.tools import QueryEngineTool, ToolMetadata

from cachedrag.integrations.llama_index import CachedRAGLLM, CachedRAGRetriever

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def llm():
    return CachedRAGLLM(max_new_tokens=10)  # the embedded default model, process-wide engine


@pytest.fixture(scope="module", autouse=True)
def _settings(llm):
    saved = Settings._llm, Settings._embed_model
    Settings.llm = llm
    Settings.embed_model = MockEmbedding(embed_dim=8)
    yield
    Settings._llm, Settings._embed_model = saved


@pytest.fixture(scope="module")
def retriever(e2e_index_dir):
    r = CachedRAGRetriever(index_dir=str(e2e_index_dir), similarity_top_k=2)
    yield r
    r.close()


@pytest.fixture(scope="module")
def query_engine(retriever, llm):
    return RetrieverQueryEngine.from_args(retriever, llm=llm)


def assert_response(response):
    assert isinstance(response.response, str)
    assert response.source_nodes, "no source nodes"
    for n in response.source_nodes:
        assert n.node.node_id and n.score is not None


def test_retriever_query_engine_repeat_hits_chunk_caches(query_engine, llm):
    question = "How do I pretty-print a JSON document with indentation?"
    first = query_engine.query(question)
    assert_response(first)
    assert all(n.node.node_id == n.node.metadata["chunk_id"] for n in first.source_nodes)
    assert llm.last_stats["registered_chunks"] == 2
    second = query_engine.query(question)
    stats = llm.last_stats
    assert [n.node.node_id for n in second.source_nodes] == [n.node.node_id for n in first.source_nodes]
    assert stats["registered_chunks"] == stats["registered_chunks_cached"] == 2 and stats["chunks_missed"] == 0
    assert stats["prefix_hit_tokens"] > 0 and stats["computed_tokens"] < stats["prompt_tokens"] / 2
    assert second.response == first.response  # greedy, and the whole prompt came from the cache


def test_transform_query_engine_with_hyde(query_engine, retriever, llm):
    question = "What does heapq.heappush do?"
    hyde = TransformQueryEngine(query_engine, HyDEQueryTransform(llm=llm, include_original=True))
    response = hyde.query(question)
    assert_response(response)
    assert retriever._searcher.last_prefetch_query == question  # lookahead started before HyDE ran
    assert llm.last_stats["registered_chunks"] == 2


def test_sub_question_query_engine_with_the_stock_question_generator(query_engine, llm):
    """LlamaIndex's own ``LLMQuestionGenerator`` (its prompt and parser, nothing custom): the sub-question
    JSON is decoded under the parser's schema, so the 135M model's plan parses and names a real tool."""
    question = "What do heapq.heappush and bisect.insort do?"
    question_llm = CachedRAGLLM(max_new_tokens=160)  # room for the JSON; same shared engine and cache
    assert question_llm.engine is llm.engine
    tools = [QueryEngineTool(query_engine=query_engine,
                             metadata=ToolMetadata(name="stdlib_docs", description="Python standard library docs"))]
    generator = LLMQuestionGenerator.from_defaults(llm=question_llm)
    sub_questions = generator.generate([t.metadata for t in tools], QueryBundle(question))
    assert sub_questions and all(isinstance(q, SubQuestion) for q in sub_questions)
    assert {q.tool_name for q in sub_questions} == {"stdlib_docs"} and all(q.sub_question for q in sub_questions)
    engine = SubQuestionQueryEngine.from_defaults(query_engine_tools=tools, llm=llm, use_async=True,
                                                  verbose=False, question_gen=generator)
    response = engine.query(question)
    assert isinstance(response.response, str)
    assert len(response.source_nodes) >= len(sub_questions)  # each sub-answer cites its own sources


def test_multi_step_query_engine(query_engine, llm):
    engine = MultiStepQueryEngine(query_engine, StepDecomposeQueryTransform(llm=llm), num_steps=2,
                                  response_synthesizer=get_response_synthesizer(llm=llm),
                                  index_summary="Python standard library documentation")
    response = engine.query("How do I compute a SHA-256 hash of some bytes?")
    assert isinstance(response.response, str)
    assert response.metadata["sub_qa"], "no step was answered"


def test_flare_instruct_query_engine(query_engine, llm):
    engine = FLAREInstructQueryEngine(query_engine, llm=llm, max_iterations=1)
    response = engine.query("How do I generate a random UUID?")
    assert isinstance(response.response, str)
