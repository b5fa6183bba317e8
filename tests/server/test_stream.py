"""Per-choice answer assembly (``cachedrag.server.stream``): OpenAI deltas of text and tool calls."""

from __future__ import annotations

import asyncio

from cachedrag.server.loop import Delta, Finished
from cachedrag.server.stream import Answer, Choice, ToolEvent, sse_events


class _Script:
    """A parser that reports scripted events per fed piece."""

    def __init__(self, script, tail=()):
        self.script, self.tail = list(script), list(tail)

    def feed(self, text):
        return self.script.pop(0)

    def close(self, complete):
        return self.tail if complete else [ToolEvent("content", "<cut>")]


def _finished(reason="stop", index=0, tokens=3):
    return Finished(reason, prompt_tokens=10, completion_tokens=tokens, cached_tokens=4, ttft_s=0.0, total_s=0.0,
                    text="", token_ids=[], index=index)


def test_tool_call_deltas_name_first_then_argument_pieces():
    parser = _Script([[ToolEvent("content", "Let me look. ")],
                      [ToolEvent("call", id="call_abc", name="search"), ToolEvent("arguments", '{"q": ')],
                      [ToolEvent("arguments", '"heaps"}')]])
    c = Choice(0, parser)
    assert c.push(Delta("a")) == [{"content": "Let me look. "}]
    assert c.push(Delta("b")) == [
        {"tool_calls": [{"index": 0, "id": "call_abc", "type": "function",
                         "function": {"name": "search", "arguments": ""}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": '{"q": '}}]}]
    assert c.push(Delta("c")) == [{"tool_calls": [{"index": 0, "function": {"arguments": '"heaps"}'}}]}]
    assert c.finish(_finished()) == [] and c.reason == "tool_calls"
    assert c.message() == {"role": "assistant", "content": "Let me look. ", "tool_calls": [
        {"id": "call_abc", "type": "function", "function": {"name": "search", "arguments": '{"q": "heaps"}'}}]}


def test_a_call_cut_short_keeps_its_finish_reason_and_ids_are_made_when_missing():
    c = Choice(0, _Script([[ToolEvent("call", name="f")]]))
    (start,) = c.push(Delta("x"))
    assert start["tool_calls"][0]["id"].startswith("call_") and len(start["tool_calls"][0]["id"]) == 29
    c.finish(_finished("length"))
    assert c.reason == "length"
    plain = Choice(1)
    plain.push(Delta("hello"))
    plain.finish(_finished())
    assert plain.reason == "stop" and plain.message() == {"role": "assistant", "content": "hello"}


def test_sse_events_of_two_choices_and_usage_summed():
    async def run():
        queue = asyncio.Queue()
        for e in (Delta("a", index=0), Delta("b", index=1), Delta("c", index=0), _finished(index=1, tokens=2),
                  _finished(index=0, tokens=5)):
            queue.put_nowait(e)
        answer = Answer("id", "m", True, True, lambda *a: None)
        choices = [Choice(0), Choice(1)]
        return [b async for b in sse_events(queue, choices, answer.chunk, answer.last, answer.closing)], choices

    bodies, choices = asyncio.run(run())
    deltas = [(b["choices"][0]["index"], b["choices"][0]["delta"].get("content"), b["choices"][0]["finish_reason"])
              for b in bodies if b["choices"]]
    assert deltas == [(0, "a", None), (1, "b", None), (0, "c", None), (1, None, "stop"), (0, None, "stop")]
    assert bodies[-1]["usage"]["completion_tokens"] == 7 and bodies[-1]["usage"]["prompt_tokens"] == 10
    assert [c.text for c in choices] == ["ac", "b"]
