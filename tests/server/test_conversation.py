"""Served conversations as prefix hits: an agent's second request (the first one's messages, its
tool call and the tool's result) reports the first prompt and its answer as cached tokens, and
answers as the same engine does in process (``generate_segments(conversation=True)``) on the
same segments; an ordinary request (no tools, no earlier turns) stores no answer."""

from __future__ import annotations

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

SEARCH = {"type": "function", "function": {
    "name": "search", "description": "Search the library manual",
    "parameters": {"type": "object", "properties": {"q": {"type": "string", "enum": ["heapq", "bisect"]}},
                   "required": ["q"]}}}
ASK = [{"role": "system", "content": "Use the tools."}, {"role": "user", "content": "What does heapq do?"}]
RESULT = "The heapq module provides an implementation of the heap queue algorithm, also known as a priority queue."


def _recording(server):
    """Wrap the server's prompt planner: record each chat request's planned prompt."""
    planner, planned = server.app.state.planner, []
    chat = planner.chat

    def record(messages, chunks=None, tools=None):
        planned.append(chat(messages, chunks, tools=tools))
        return planned[-1]

    planner.chat = record
    return planned


def _in_process(engine, planned, max_tokens: int, tool_choice: str | None):
    """The same prompts generated in process on ``engine`` as conversation steps (the server's
    grammar for ``tool_choice``), greedy."""
    from cachedrag.model.constraint import tool_constraint
    from cachedrag.model.generation import SamplingParams
    from cachedrag.prompt.tools import ToolChoice, ToolSpec

    tools = [ToolSpec.from_openai(SEARCH)]
    constraint = None
    if tool_choice is not None:
        constraint = tool_constraint(engine.runner.tokenizer, engine.eos_ids, tools,
                                     ToolChoice.parse(tool_choice, False, ["search"]))
    return engine.generate_segments(planned.segments, SamplingParams(max_new_tokens=max_tokens, constraint=constraint),
                                    conversation=True)


def test_agent_step_reuses_the_previous_prompt_and_answer_as_in_process(live_server, new_long_engine):
    s = live_server(new_long_engine())
    planned = _recording(s)
    client = openai.OpenAI(base_url=s.base_url, api_key="none", max_retries=0)
    step = client.chat.completions.create(model="tiny", messages=ASK, tools=[SEARCH], tool_choice="required",
                                          parallel_tool_calls=False, max_tokens=80, temperature=0)
    (call,) = step.choices[0].message.tool_calls
    history = [*ASK, step.choices[0].message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.id, "content": RESULT}]
    answer = client.chat.completions.create(model="tiny", messages=history, tools=[SEARCH], tool_choice="none",
                                            max_tokens=12, temperature=0)
    first, second = step.usage, answer.usage
    assert s.loop.remembered_tokens >= first.completion_tokens - 1  # the first step's answer was stored
    metrics = httpx.get(s.url + "/metrics").text
    assert f"cachedrag_conversation_stored_tokens_total {float(s.loop.remembered_tokens)}" in metrics
    # the second step computed only what is new: the tool result's message (and the call's last token)
    assert second.prompt_tokens_details.cached_tokens >= first.prompt_tokens + first.completion_tokens - 1
    assert second.prompt_tokens_details.cached_tokens < second.prompt_tokens

    reference = new_long_engine()  # the same weights, in process, on the segments the server served
    r1 = _in_process(reference, planned[0], 80, "required")
    r2 = _in_process(reference, planned[1], 12, None)
    assert r1.prompt_tokens == first.prompt_tokens and len(r1.token_ids) == first.completion_tokens
    assert r2.prompt_tokens - r2.computed_tokens == second.prompt_tokens_details.cached_tokens
    assert r2.text == answer.choices[0].message.content


def test_an_ordinary_request_stores_no_answer(live_server, long_engine):
    s = live_server(long_engine)
    client = openai.OpenAI(base_url=s.base_url, api_key="none", max_retries=0)
    client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "What does heapq do?"}],
                                   max_tokens=8, temperature=0)
    assert s.loop.remembered_tokens == 0
