"""LangChain tool calling on the tiny random engine: what the grammar alone decides (a required or
named call is a valid call whatever the weights), histories with tool calls and results rendered,
streamed tool_call_chunks, structured output through function calling."""

from __future__ import annotations

import json

import pytest
from langchain_core.messages import AIMessage, AIMessageChunk, HumanMessage, ToolMessage
from langchain_core.tools import tool
from pydantic import BaseModel, Field

from cachedrag.integrations.langchain import ChatCachedRAG, _messages

from .conftest import TINY


@tool
def search(query: str, k: int = 2) -> str:
    """Search the docs for a query."""
    return f"results for {query}"


class Verdict(BaseModel):
    """A verdict on a claim."""

    ok: bool
    score: int = Field(ge=0, le=9)


@pytest.fixture
def chat(tiny_engine):
    return ChatCachedRAG(model=TINY, max_tokens=120, temperature=1.0, seed=3)


def test_required_and_named_calls_are_valid(chat):
    for choice in ("any", "search", "required"):
        msg = chat.bind_tools([search, Verdict], tool_choice=choice, parallel_tool_calls=False).invoke("Look it up.")
        assert len(msg.tool_calls) == 1 and msg.content == ""
        call = msg.tool_calls[0]
        assert call["id"].startswith("call_") and call["type"] == "tool_call"
        if choice == "search" or call["name"] == "search":
            assert call["name"] == "search" and isinstance(call["args"]["query"], str)
        else:
            Verdict.model_validate(call["args"])


def test_none_gives_text_and_no_call(chat):
    msg = chat.bind_tools([search], tool_choice="none").invoke("hi")
    assert msg.tool_calls == [] and isinstance(msg.content, str)


def test_bad_tool_choice_fails_at_bind(chat):
    with pytest.raises(ValueError, match="not among the tools"):
        chat.bind_tools([search], tool_choice="nope")


def test_streamed_tool_call_chunks_add_up_to_the_call(chat):
    bound = chat.bind_tools([search], tool_choice="search")
    chunks = list(bound.stream("Look it up."))
    calls = [c for c in chunks if c.tool_call_chunks]
    assert calls[0].tool_call_chunks[0]["name"] == "search" and calls[0].tool_call_chunks[0]["args"] == ""
    whole = chunks[0]
    for c in chunks[1:]:
        whole = whole + c
    assert isinstance(whole, AIMessageChunk) and whole.tool_calls[0]["name"] == "search"
    invoked = bound.invoke("Look it up.")  # the same seed: the same call
    assert whole.tool_calls[0]["args"] == invoked.tool_calls[0]["args"]
    assert whole.usage_metadata["input_tokens"] == invoked.usage_metadata["input_tokens"]


def test_history_with_calls_and_results_is_rendered(chat):
    history = [HumanMessage("What is heapq?"),
               AIMessage("", tool_calls=[{"name": "search", "args": {"query": "heapq"}, "id": "call_7"}]),
               ToolMessage("The heapq module provides a heap queue.", tool_call_id="call_7", name="search")]
    msgs = _messages(history)
    assert msgs[1].tool_calls[0].id == "call_7" and msgs[2].tool_call_id == "call_7"
    text = chat._generator.render_messages(msgs, [_spec()]).text
    assert '{"tool_calls":[{"name":"search","arguments":{"query":"heapq"}}]}' in text  # compact, as generated
    assert "The heapq module provides a heap queue." in text and '"name": "search"' in text
    msg = chat.bind_tools([search], tool_choice="none").invoke(history)
    assert msg.usage_metadata["input_tokens"] == len(chat.engine.runner.tokenizer.encode(
        chat._generator.render_messages(msgs, [_spec()]).text, add_special_tokens=False))


def _spec():
    from langchain_core.utils.function_calling import convert_to_openai_tool

    from cachedrag.prompt.tools import ToolSpec

    return ToolSpec.from_openai(convert_to_openai_tool(search))


@pytest.mark.parametrize("method", ["function_calling", "json_schema"])
def test_structured_output_methods(chat, method):
    got = chat.with_structured_output(Verdict, method=method, strict=True).invoke("Is a heap a tree?")
    assert isinstance(got, Verdict) and 0 <= got.score <= 9
    raw = chat.with_structured_output(Verdict.model_json_schema(), method=method, include_raw=True).invoke("Again.")
    assert raw["parsing_error"] is None and set(raw["parsed"]) == {"ok", "score"}
    if method == "function_calling":
        assert raw["raw"].tool_calls[0]["name"] == "Verdict"


def test_usage_reports_cache_reads_of_an_agent_step(chat):
    """A step's prompt (question, call, JSON tool result) is cached like any other: asked again,
    its prefix is read from the cache. (Reusing the previous step's prompt and answer as an exact
    prefix of the next step is the engine's part of issue 57.)"""
    bound = chat.bind_tools([search], tool_choice="search")
    first = bound.invoke("A question long enough to be worth caching as a prefix of the next step?")
    call = first.tool_calls[0]
    step = [HumanMessage("A question long enough to be worth caching as a prefix of the next step?"), first,
            ToolMessage(json.dumps({"hits": ["heapq is a heap"]}), tool_call_id=call["id"], name="search")]
    bound.invoke(step)
    again = bound.invoke(step)
    assert again.tool_calls[0]["name"] == "search"
    assert again.usage_metadata["input_token_details"]["cache_read"] > 0
