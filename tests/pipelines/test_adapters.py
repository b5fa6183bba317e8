"""The pipelines as LlamaIndex query engines and LangChain runnables."""

from __future__ import annotations

import pytest

from cachedrag.errors import ConfigError
from cachedrag.pipelines import HyDE, IterRetGen, PipelineQueryEngine, PipelineRun, as_runnable

from .conftest import QUESTION, FakeRetriever, ScriptedGenerator


def _hyde():
    return HyDE(ScriptedGenerator({"Question:": ["An answer."]}), FakeRetriever(), top_k=2)


def test_query_engine_returns_answer_sources_and_run():
    from llama_index.core.base.response.schema import Response
    from llama_index.core.query_engine import CustomQueryEngine

    engine = PipelineQueryEngine(_hyde())
    assert isinstance(engine, CustomQueryEngine)
    response = engine.query(QUESTION)
    assert isinstance(response, Response) and response.response == "An answer."
    assert [n.node.node_id for n in response.source_nodes] == [f"{QUESTION[:8]}#0", f"{QUESTION[:8]}#1"]
    assert response.source_nodes[0].node.get_content().startswith("chunk 0 for")
    assert response.metadata["pipeline_run"]["pipeline"] == "hyde"
    quiet = _hyde().as_query_engine(include_run=False, include_sources=False).query(QUESTION)
    assert quiet.metadata is None and quiet.source_nodes == []


async def test_query_engine_async():
    response = await PipelineQueryEngine(_hyde()).aquery(QUESTION)
    assert response.response == "An answer."


def test_runnable_invoke_batch_and_outputs():
    from langchain_core.runnables import Runnable, RunnableLambda

    chain = as_runnable(_hyde())
    assert isinstance(chain, Runnable) and chain.name == "cachedrag-hyde"
    assert chain.invoke(QUESTION) == "An answer."
    assert chain.invoke({"question": QUESTION}) == "An answer."
    assert chain.batch([QUESTION, {"input": QUESTION}]) == ["An answer.", "An answer."]
    assert (chain | RunnableLambda(str.upper)).invoke(QUESTION) == "AN ANSWER."
    assert isinstance(_hyde().as_runnable(output="run").invoke(QUESTION), PipelineRun)
    assert as_runnable(_hyde(), output="dict").invoke(QUESTION)["answer"] == "An answer."
    with pytest.raises(ConfigError):
        chain.invoke({"nope": 1})
    with pytest.raises(ConfigError):
        as_runnable(_hyde(), output="tokens")


def test_adapters_on_the_tiny_model(engine, lookahead):
    pipeline = IterRetGen(engine, lookahead, rounds=2, max_new_tokens=4, top_k=2)
    response = pipeline.as_query_engine().query(QUESTION)
    assert isinstance(response.response, str) and response.source_nodes
    assert isinstance(as_runnable(pipeline).invoke(QUESTION), str)
