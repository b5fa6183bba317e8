"""Repeated parallel calls: a call that repeats an earlier one (name and arguments) ends the answer
(``RepeatWatch`` makes the constraint ``done``) and the parsers drop it."""

from __future__ import annotations

import pytest

from cachedrag.model.constraint import RepeatWatch
from cachedrag.prompt import toolformat as F
from cachedrag.prompt.toolparse import parse_tool_calls, parser_for
from cachedrag.testing import byte_tokenizer

CALL = '{"name":"search","arguments":{"query":"heapq","k":2}}'
OTHER = '{"name":"search","arguments":{"query":"bisect","k":2}}'
SAME_REORDERED = '{"name":"search","arguments":{"k":2,"query":"heapq"}}'


@pytest.mark.parametrize("second, calls", [(CALL, 1), (SAME_REORDERED, 1), (OTHER, 2)])
def test_parsers_drop_a_repeated_call(second, calls):
    text = '{"tool_calls":[' + CALL + "," + second + "]}"
    _, parsed = parse_tool_calls(text, F.ENVELOPE)
    assert len(parsed) == calls and parsed[0].args == {"query": "heapq", "k": 2}
    parser = parser_for(F.ENVELOPE)
    parser.feed(text)
    parser.finish()
    assert parser.repeats == 2 - calls


@pytest.mark.parametrize("second, repeated", [(CALL, True), (OTHER, False)])
def test_repeat_watch_sees_the_repeat_when_it_closes(second, repeated):
    tok = byte_tokenizer()
    watch = RepeatWatch(tok, F.ENVELOPE)
    head = '{"tool_calls":[' + CALL + ","
    for token in tok.encode(head + second[:-1], add_special_tokens=False):
        watch.add(token)
    assert not watch.repeated  # the second call is not closed yet
    for token in tok.encode(second[-1], add_special_tokens=False):
        watch.add(token)
    assert watch.repeated is repeated


def test_a_whole_answer_ended_by_a_repeated_call_holds_the_calls_before_it():
    """The server's choice of an answer that a repeated parallel call ended: finish reason
    ``tool_calls`` and the calls before the repeat (not the envelope's text)."""
    from types import SimpleNamespace

    from cachedrag.server.requests import Delta, Finished
    from cachedrag.server.stream import Choice
    from cachedrag.server.structured import FormatParser

    text = '{"tool_calls":[' + CALL + "," + OTHER + "," + CALL + ","
    constraint = SimpleNamespace(complete=False, watch=SimpleNamespace(repeated=True))
    choice = Choice(0, FormatParser(parser_for(F.ENVELOPE)), constraint=constraint)
    choice.push(Delta(text))
    choice.finish(Finished("stop", 10, 30, 0, 0.1, 0.2, text, []))
    message = choice.message()
    assert choice.reason == "tool_calls"
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["search", "search"]
    assert [c["function"]["arguments"] for c in message["tool_calls"]] == [
        '{"query":"heapq","k":2}', '{"query":"bisect","k":2}']
    not_repeated = Choice(0, FormatParser(parser_for(F.ENVELOPE)),
                          constraint=SimpleNamespace(complete=False, watch=SimpleNamespace(repeated=False)))
    not_repeated.push(Delta(text))
    not_repeated.finish(Finished("length", 10, 30, 0, 0.1, 0.2, text, []))
    assert not_repeated.reason == "length"  # cut short: its calls, with a finish reason saying so
    assert [c["function"]["arguments"] for c in not_repeated.message()["tool_calls"]] == [
        '{"query":"heapq","k":2}', '{"query":"bisect","k":2}']
