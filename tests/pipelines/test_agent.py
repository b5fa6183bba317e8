"""The agentic RAG recipe end to end on the default model (SmolLM2-135M-Instruct): LangGraph's ReAct
agent over ``ChatCachedRAG`` and over ``ChatOpenAI`` against ``cachedrag serve``, LlamaIndex's
``FunctionAgent`` over ``CachedRAGLLM``, each answering through two retrieval calls.

The default model rarely calls a tool on its own (docs/agents.md), so the agents follow a
``ToolScript``: the first two steps must call the tool (the grammar makes each call valid), the
third must answer. Asserts the shape of the runs and the cache behaviour, never answer wording.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import pytest

from cachedrag.pipelines.agent import ToolScript
from cachedrag.testing import listening_url

pytestmark = pytest.mark.slow
QUESTION = "How do I pretty-print a JSON document with indentation?"
SCRIPT = ToolScript(min_calls=2, max_calls=2)


@pytest.fixture(scope="module")
def index_dir(tmp_path_factory):
    from cachedrag.corpus import stdlib_corpus
    from cachedrag.model.loader import load_default_tokenizer
    from cachedrag.retrieval.config import ChunkConfig, IndexConfig, RetrievalConfig
    from cachedrag.retrieval.embedder import Embedder
    from cachedrag.retrieval.index import build_index

    out = tmp_path_factory.mktemp("agent-index") / "index"
    config = RetrievalConfig(chunk=ChunkConfig(chunk_tokens=96, overlap=16), index=IndexConfig(nlist=4))
    docs = stdlib_corpus(("json", "heapq", "bisect", "textwrap"), max_chars_per_doc=2500)
    build_index(docs, load_default_tokenizer(), Embedder(), config, out=out, progress=False)
    return str(out)


def _check_langgraph_run(out) -> list:
    messages = out["messages"]
    tools = [m for m in messages if m.type == "tool"]
    assert len(tools) == 2 and all(m.content for m in tools)  # two retrieval calls, passages returned
    final = messages[-1]
    assert final.type == "ai" and not final.tool_calls and isinstance(final.content, str)
    return messages


def test_langgraph_react_agent_over_chat_cachedrag(index_dir):
    from cachedrag.integrations.langchain import CachedRAGRetriever, ChatCachedRAG
    from cachedrag.pipelines.agent import langgraph_agent

    chat = ChatCachedRAG(max_tokens=48)
    agent = langgraph_agent(chat, CachedRAGRetriever(index_dir=index_dir, k=3), script=SCRIPT)
    messages = _check_langgraph_run(agent.invoke({"messages": [("user", QUESTION)]}))
    steps = [m.response_metadata["cache"] for m in messages if m.type == "ai"]
    assert len(steps) == 3
    for before, step in zip(steps, steps[1:]):  # each step: the previous prompt and call are a prefix hit
        assert step["prefix_hit_tokens"] >= before["prompt_tokens"]
        assert step["computed_tokens"] < step["prompt_tokens"] - before["prompt_tokens"] + 8


@pytest.fixture(scope="module")
def served():
    pytest.importorskip("uvicorn")
    proc = subprocess.Popen([sys.executable, "-m", "cachedrag.cli", "serve", "--port", "0", "--max-tokens", "48"],
                            stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    url, lines = listening_url(proc, 300)
    try:
        assert url, "".join(lines)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def test_langgraph_react_agent_over_chat_openai_against_the_server(index_dir, served):
    pytest.importorskip("langchain_openai")
    from langchain_openai import ChatOpenAI

    from cachedrag.integrations.langchain import CachedRAGRetriever
    from cachedrag.pipelines.agent import langgraph_agent

    chat = ChatOpenAI(base_url=served + "/v1", api_key="unused", model="SmolLM2-135M-Instruct", max_tokens=48,
                      temperature=0.0)
    agent = langgraph_agent(chat, CachedRAGRetriever(index_dir=index_dir, k=3), script=SCRIPT)
    messages = _check_langgraph_run(agent.invoke({"messages": [("user", QUESTION)]}))
    usage = [m.usage_metadata for m in messages if m.type == "ai"]
    assert len(usage) == 3
    for before, step in zip(usage, usage[1:]):  # the server stored each step's prompt and call: a prefix hit
        assert step["input_token_details"]["cache_read"] >= before["input_tokens"]


def test_llama_index_function_agent_over_cachedrag_llm(index_dir):
    from cachedrag.integrations.llama_index import CachedRAGLLM, CachedRAGRetriever
    from cachedrag.pipelines.agent import function_agent

    llm = CachedRAGLLM(max_new_tokens=48)
    retriever = CachedRAGRetriever(index_dir=index_dir, similarity_top_k=3)
    agent = function_agent(llm, retriever, script=SCRIPT)
    async def run():  # the workflow needs a running event loop
        return await agent.run(user_msg=QUESTION)

    out = asyncio.run(run())
    assert [c.tool_name for c in out.tool_calls] == ["search_docs", "search_docs"]
    assert all(c.tool_output.content for c in out.tool_calls)
    assert isinstance(out.response.content, str)
    stats = llm.last_stats  # the answer step: both earlier steps were a prefix hit
    assert stats["prefix_hit_tokens"] > stats["prompt_tokens"] / 2
