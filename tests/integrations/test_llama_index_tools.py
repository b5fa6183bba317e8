"""LlamaIndex tool calling on the tiny random engine: CachedRAGLLM is a FunctionCallingLLM, forced
calls are valid, histories with ToolCallBlocks and tool messages render, a FunctionAgent runs."""

from __future__ import annotations

import asyncio

import pytest
from llama_index.core.base.llms.types import ChatMessage, ChatResponse, MessageRole, TextBlock, ToolCallBlock
from llama_index.core.llms.function_calling import FunctionCallingLLM
from llama_index.core.tools import FunctionTool

from cachedrag.integrations.llama_index import CachedRAGLLM
from cachedrag.integrations.llama_index_tools import to_messages

from .conftest import TINY

CALLS: list[str] = []


def search(query: str) -> str:
    """Search the docs for a query."""
    CALLS.append(query)
    return "The heapq module provides a heap queue."


def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


TOOLS = [FunctionTool.from_defaults(search), FunctionTool.from_defaults(add)]


@pytest.fixture
def llm(tiny_engine):
    return CachedRAGLLM(model=TINY, max_new_tokens=120, temperature=1.0, seed=2)


def test_is_a_function_calling_llm(llm):
    assert isinstance(llm, FunctionCallingLLM) and llm.metadata.is_function_calling_model


def test_required_and_named_calls_are_valid(llm):
    resp = llm.chat_with_tools(TOOLS, user_msg="Add two numbers.", tool_required=True)
    calls = llm.get_tool_calls_from_response(resp)
    assert len(calls) == 1 and calls[0].tool_name in ("search", "add") and calls[0].tool_id.startswith("call_")
    named = llm.chat_with_tools(TOOLS, user_msg="Add.", tool_choice="add", allow_parallel_tool_calls=False)
    (call,) = llm.get_tool_calls_from_response(named)
    assert call.tool_name == "add" and set(call.tool_kwargs) == {"a", "b"}
    assert all(isinstance(v, int) for v in call.tool_kwargs.values())
    assert add(**call.tool_kwargs) == call.tool_kwargs["a"] + call.tool_kwargs["b"]


def test_streamed_calls_match_and_partial_json_is_tolerated(llm):
    whole = llm.chat_with_tools(TOOLS, user_msg="Search.", tool_choice="search")
    last = None
    seen_partial = False
    for last in llm.stream_chat_with_tools(TOOLS, user_msg="Search.", tool_choice="search"):
        calls = llm.get_tool_calls_from_response(last, error_on_no_tool_call=False)
        seen_partial |= bool(calls) and any(isinstance(b.tool_kwargs, str) for b in last.message.blocks
                                            if isinstance(b, ToolCallBlock))
    got = llm.get_tool_calls_from_response(last)
    assert [(c.tool_name, c.tool_kwargs) for c in got] == [
        (c.tool_name, c.tool_kwargs) for c in llm.get_tool_calls_from_response(whole)]
    assert seen_partial  # mid-stream arguments were partial JSON, read without error
    partial = ChatResponse(message=ChatMessage(role="assistant", blocks=[
        ToolCallBlock(tool_call_id="c", tool_name="search", tool_kwargs='{"query": "hea')]))
    assert llm.get_tool_calls_from_response(partial)[0].tool_kwargs == {"query": "hea"}
    with pytest.raises(ValueError, match="tool call"):
        llm.get_tool_calls_from_response(ChatResponse(message=ChatMessage(role="assistant", content="hi")))


def test_history_with_tool_call_blocks_and_tool_messages(llm):
    history = [ChatMessage(role=MessageRole.USER, content="What is heapq?"),
               ChatMessage(role=MessageRole.ASSISTANT, blocks=[
                   ToolCallBlock(tool_call_id="call_9", tool_name="search", tool_kwargs={"query": "heapq"})]),
               ChatMessage(role=MessageRole.TOOL, content="The heapq module provides a heap queue.",
                           additional_kwargs={"tool_call_id": "call_9"})]
    msgs = to_messages(history)
    assert msgs[1].tool_calls[0].args == {"query": "heapq"} and msgs[2].tool_call_id == "call_9"
    text = llm._generator.render_messages(msgs).text
    assert '{"tool_calls":[{"name":"search","arguments":{"query":"heapq"}}]}' in text  # compact, as generated
    resp = llm.chat(history, max_new_tokens=8)
    assert isinstance(resp.message.content, str)
    from llama_index.core.base.llms.types import ImageBlock

    image = ImageBlock(url="http://example.invalid/a.png")
    with pytest.raises(ValueError, match="text only"):
        to_messages([ChatMessage(role="user", blocks=[TextBlock(text="x"), image])])


def test_function_agent_runs_with_a_forced_first_call(llm):
    from llama_index.core.agent.workflow import FunctionAgent

    CALLS.clear()
    agent = FunctionAgent(tools=[TOOLS[0]], llm=llm, initial_tool_choice="search", streaming=False)

    async def run():
        return await agent.run(user_msg="What is heapq? Use the search tool.")

    out = asyncio.run(run())
    assert len(CALLS) == 1 and isinstance(CALLS[0], str)  # the forced call ran the tool with a string query
    assert out.tool_calls and out.tool_calls[0].tool_name == "search"
    assert out.tool_calls[0].tool_output.content == "The heapq module provides a heap queue."
    assert isinstance(str(out.response.content), str)


def test_the_openai_like_client_says_it_calls_functions():
    pytest.importorskip("llama_index.llms.openai_like")
    from cachedrag.integrations.openai_llama_index import CachedRAGOpenAILike

    assert CachedRAGOpenAILike(api_base="http://127.0.0.1:9/v1").metadata.is_function_calling_model
