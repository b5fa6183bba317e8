"""Tool calling end to end through the official ``openai`` client against a live tiny server: an
agent step's round trip (call -> tool result -> answer), ``auto`` (no ``tool_choice``), streamed
calls in OpenAI's delta shape, ``parallel_tool_calls``, ``n`` choices with tools, ids that round-trip."""

from __future__ import annotations

import json

import pytest

openai = pytest.importorskip("openai")

SEARCH = {"type": "function", "function": {
    "name": "search", "description": "Search the library manual",
    "parameters": {"type": "object", "properties": {"q": {"type": "string", "enum": ["heapq", "bisect"]}},
                   "required": ["q"]}}}
ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9},
                                     "b": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["a", "b"]}}}  # enums and bounded integers: a random-weight model would write to max_tokens
ASK = [{"role": "system", "content": "Use the tools."}, {"role": "user", "content": "What does heapq do?"}]


def _client(server):
    return openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0)


def _recording(server):
    """Wrap the server's prompt planner: record the messages and tools each chat request rendered."""
    planner, seen = server.app.state.planner, []
    chat = planner.chat

    def record(messages, chunks=None, tools=None):
        seen.append((list(messages), list(tools or [])))
        return chat(messages, chunks, tools=tools)

    planner.chat = record
    return seen


def test_agent_round_trip_call_then_tool_result_then_answer(live_server, long_engine):
    s = live_server(long_engine)
    seen = _recording(s)
    client = _client(s)
    step = client.chat.completions.create(model="tiny", messages=ASK, tools=[SEARCH], tool_choice="required",
                                          parallel_tool_calls=False, max_tokens=80, temperature=0)
    (call,) = step.choices[0].message.tool_calls
    assert step.choices[0].finish_reason == "tool_calls" and call.function.name == "search"
    assert json.loads(call.function.arguments)["q"] in ("heapq", "bisect")
    result = "The heapq module provides an implementation of the heap queue algorithm."
    history = [*ASK, step.choices[0].message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.id, "content": result}]
    answer = client.chat.completions.create(model="tiny", messages=history, tools=[SEARCH], max_tokens=6,
                                            temperature=0)  # no tool_choice: auto, as agents send it
    message = answer.choices[0].message
    assert answer.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert message.content or message.tool_calls
    rendered, tools = seen[-1]
    assert [t.name for t in tools] == ["search"]
    assistant, tool = rendered[-2], rendered[-1]
    assert [(c.id, c.name, c.args) for c in assistant.tool_calls] == [(call.id, "search",
                                                                       json.loads(call.function.arguments))]
    assert tool.role == "tool" and tool.tool_call_id == call.id and tool.content == result
    prompt = s.engine.runner.tokenizer.decode([t for seg in s.app.state.planner.chat(
        rendered, tools=tools).segments for t in seg.ids])
    assert result in prompt and call.function.name in prompt  # the call and its result are in the prompt
    assert step.usage.prompt_tokens < answer.usage.prompt_tokens


def test_auto_is_served_as_text_or_calls(live_server, long_engine):
    client = _client(live_server(long_engine))
    for seed in range(4):
        r = client.chat.completions.create(model="tiny", messages=ASK, tools=[SEARCH, ADD], max_tokens=60,
                                           temperature=1.0, seed=seed)
        choice = r.choices[0]
        if choice.message.tool_calls:
            assert choice.finish_reason == "tool_calls"
            for call in choice.message.tool_calls:
                assert call.id.startswith("call_") and call.function.name in ("search", "add")
                json.loads(call.function.arguments)
        else:
            assert choice.finish_reason in ("stop", "length") and choice.message.content is not None
    auto = client.chat.completions.create(model="tiny", messages=ASK, tools=[SEARCH], tool_choice="auto",
                                          max_tokens=4, temperature=0)
    assert auto.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_streamed_tool_call_in_openai_delta_shape(live_server, long_engine):
    client = _client(live_server(long_engine))
    kw = dict(model="tiny", messages=ASK, tools=[SEARCH, ADD], tool_choice="required", parallel_tool_calls=False,
              max_tokens=80, temperature=0)
    whole = client.chat.completions.create(**kw)
    deltas, reasons = [], []
    for chunk in client.chat.completions.create(**kw, stream=True):
        for choice in chunk.choices:
            deltas += choice.delta.tool_calls or []
            reasons.append(choice.finish_reason)
    first, rest = deltas[0], deltas[1:]
    assert first.index == 0 and first.id.startswith("call_") and first.type == "function"
    assert first.function.name == whole.choices[0].message.tool_calls[0].function.name
    assert first.function.arguments == "" and rest  # the name first, then the arguments in pieces
    assert all(d.index == 0 and d.id is None and d.function.name is None for d in rest)
    assert "".join(d.function.arguments for d in rest) == whole.choices[0].message.tool_calls[0].function.arguments
    assert reasons[-1] == "tool_calls"


def test_parallel_tool_calls_and_n_choices(live_server, long_engine):
    client = _client(live_server(long_engine))
    kw = dict(model="tiny", messages=ASK, tools=[SEARCH, ADD], tool_choice="required", max_tokens=150)
    for seed in range(3):
        one = client.chat.completions.create(**kw, parallel_tool_calls=False, temperature=1.0, seed=seed)
        if one.choices[0].finish_reason == "tool_calls":
            assert len(one.choices[0].message.tool_calls) == 1
    many = client.chat.completions.create(**kw, parallel_tool_calls=False, temperature=1.0, seed=1, n=3)
    assert [c.index for c in many.choices] == [0, 1, 2]
    ids = [call.id for c in many.choices for call in c.message.tool_calls or []]
    assert len(ids) == len(set(ids))  # every call its own id
    for c in many.choices:
        if c.finish_reason == "tool_calls":
            (call,) = c.message.tool_calls
            json.loads(call.function.arguments)


def test_a_forced_call_cut_short_is_a_call_with_closed_arguments(live_server, long_engine):
    """As OpenAI reports a call that ``max_tokens`` cut: in ``tool_calls``, finish reason ``length``;
    its arguments closed to valid JSON, the same in the whole answer and the stream's deltas (and
    as the in-process chat models parse the same text)."""
    client = _client(live_server(long_engine))
    kw = dict(model="tiny", messages=ASK, tools=[SEARCH], tool_choice="required", parallel_tool_calls=False,
              temperature=0)
    whole = client.chat.completions.create(**kw, max_tokens=80)
    assert whole.choices[0].finish_reason == "tool_calls"
    cut = client.chat.completions.create(**kw, max_tokens=whole.usage.completion_tokens - 6)  # inside the query
    choice = cut.choices[0]
    (call,) = choice.message.tool_calls
    assert choice.finish_reason == "length" and call.function.name == "search"
    assert set(json.loads(call.function.arguments)) <= {"q"}
    deltas = [d for chunk in client.chat.completions.create(**kw, max_tokens=whole.usage.completion_tokens - 6,
                                                             stream=True)
              for c in chunk.choices for d in c.delta.tool_calls or []]
    assert deltas[0].function.name == "search"
    assert "".join(d.function.arguments or "" for d in deltas) == call.function.arguments


def test_a_call_whose_name_was_cut_is_dropped():
    from cachedrag.prompt import toolformat as F
    from cachedrag.prompt.toolparse import parser_for
    from cachedrag.server.loop import Finished
    from cachedrag.server.requests import Delta
    from cachedrag.server.stream import Choice
    from cachedrag.server.structured import FormatParser

    choice = Choice(0, FormatParser(parser_for(F.ENVELOPE), {"search"}))
    choice.push(Delta('{"tool_calls":[{"name":"sear'))
    choice.finish(Finished("length", 10, 8, 0, 0.1, 0.2, "", []))
    assert choice.reason == "length" and choice.message() == {"role": "assistant", "content": ""}
