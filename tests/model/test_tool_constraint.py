"""Tool-call grammars on a random-weight model: whatever the weights, required / named answers are
calls valid for the tool's schema, auto is free text until its trigger and then a valid call, none
is free text."""

from __future__ import annotations

import json

import pytest

from cachedrag.errors import ConfigError
from cachedrag.model.constraint import GrammarConstraint, tool_constraint
from cachedrag.model.generation import SamplingParams, eos_token_ids
from cachedrag.model.textgen import TextGenerator, chat_ids, chat_messages
from cachedrag.prompt import toolformat as F
from cachedrag.prompt.toolparse import parse_tool_calls
from cachedrag.prompt.tools import ToolChoice, ToolSpec
from cachedrag.testing import tiny_runner

SEARCH = ToolSpec("search", "Search the docs.", {"type": "object", "properties": {
    "query": {"type": "string", "maxLength": 12}, "k": {"type": "integer", "minimum": 1, "maximum": 8}},
    "required": ["query", "k"]})
ADD = ToolSpec("add", "Add two numbers.", {"type": "object", "properties": {
    "a": {"type": "integer", "minimum": 0, "maximum": 99}, "b": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["a", "b"]})
TOOLS = [SEARCH, ADD]
CHECKS = {  # each tool's schema, as a predicate on its arguments
    "search": lambda a: set(a) == {"query", "k"} and isinstance(a["query"], str) and len(a["query"]) <= 12
    and type(a["k"]) is int and 1 <= a["k"] <= 8,
    "add": lambda a: set(a) == {"a", "b"} and all(type(a[x]) is int and 0 <= a[x] <= 99 for x in "ab"),
}


@pytest.fixture(scope="module")
def runner():
    return tiny_runner("llama", seed=5)


def _eos(runner):
    return eos_token_ids(runner.model, runner.tokenizer)


def _generate(runner, constraint, prompt="Call a tool.", **kw):
    ids = chat_ids(runner.tokenizer, chat_messages(prompt))
    params = SamplingParams(max_new_tokens=kw.pop("max_new_tokens", 160), constraint=constraint, **kw)
    return TextGenerator(runner).generate(ids, params)


def _valid(calls, names):
    assert calls, "no call parsed"
    for call in calls:
        assert call.name in names
        assert CHECKS[call.name](json.loads(call.arguments)), call


@pytest.mark.parametrize("fmt", [F.HERMES, F.LLAMA3_BARE, F.MISTRAL, F.ENVELOPE])
@pytest.mark.parametrize("temperature, seed", [(0.0, None), (1.0, 1), (1.0, 2)])
def test_required_is_always_a_valid_call(runner, fmt, temperature, seed):
    for parallel in (False, True):
        constraint = tool_constraint(runner.tokenizer, _eos(runner), TOOLS, ToolChoice("required", parallel=parallel),
                                     fmt)
        out = _generate(runner, constraint, temperature=temperature, seed=seed, max_new_tokens=300)
        content, calls = parse_tool_calls(out.text, fmt)
        if not constraint.complete:  # several calls ran past the cap, or a repeated call ended the answer
            # (RepeatWatch: ``done`` without ``complete``); the calls finished before are valid
            assert parallel and (out.finish_reason == "length" or (constraint.done and out.finish_reason == "stop"))
            calls = calls[:-1] or calls
        else:
            assert content.strip() == ""
        _valid(calls, {"search", "add"})
        if not parallel:
            assert len(calls) == 1 and constraint.done


@pytest.mark.parametrize("fmt", [F.HERMES, F.ENVELOPE])
def test_named_calls_that_tool(runner, fmt):
    constraint = tool_constraint(runner.tokenizer, _eos(runner), TOOLS, ToolChoice("named", "add", parallel=False), fmt)
    out = _generate(runner, constraint, temperature=1.0, seed=3)
    _, calls = parse_tool_calls(out.text, fmt)
    _valid(calls, {"add"})
    assert len(calls) == 1


def test_none_is_free_text(runner):
    assert tool_constraint(runner.tokenizer, _eos(runner), TOOLS, ToolChoice("none")) is None
    out = _generate(runner, None, max_new_tokens=40)
    assert parse_tool_calls(out.text, F.ENVELOPE)[1] == []


class _ForceTrigger:
    """Wraps a lazy constraint and forces the trigger's tokens after ``after`` free tokens (a model
    that decides to call a tool): the grammar must take over from there."""

    def __init__(self, inner: GrammarConstraint, trigger_ids, after=3):
        self.inner, self.trigger, self.after, self.n = inner, list(trigger_ids), after, 0

    def mask(self, logits):
        out = self.inner.mask(logits)
        k = self.n - self.after
        if 0 <= k < len(self.trigger):
            forced = out.clone().fill_(float("-inf"))
            forced[self.trigger[k]] = 0.0
            return forced
        return out

    def advance(self, token):
        self.n += 1
        self.inner.advance(token)

    @property
    def done(self):
        return self.inner.done

    @property
    def complete(self):
        return self.inner.complete


@pytest.mark.parametrize("fmt", [F.HERMES, F.ENVELOPE, F.MISTRAL])
def test_auto_is_free_until_the_trigger_then_a_valid_call(runner, fmt):
    tok = runner.tokenizer
    lazy = tool_constraint(tok, _eos(runner), TOOLS, ToolChoice("auto", parallel=False), fmt)
    assert lazy.lazy_trigger == fmt.trigger and lazy.complete  # plain text may end at once
    forced = _ForceTrigger(lazy, tok.encode(fmt.trigger, add_special_tokens=False))
    out = _generate(runner, forced, temperature=1.0, seed=4, max_new_tokens=300)
    assert lazy.triggered and lazy.done
    content, calls = parse_tool_calls(out.text, fmt)
    assert len(content) >= 1  # the free text before the trigger
    _valid(calls, {"search", "add"})


def test_auto_without_trigger_stays_free_text(runner):
    """Before the trigger the grammar only asks for well-formed text (the random model's stray
    bytes that make no UTF-8 character are masked); the answer may end there."""
    lazy = tool_constraint(runner.tokenizer, _eos(runner), TOOLS, ToolChoice("auto"), F.HERMES)
    free = _generate(runner, None, max_new_tokens=30)
    out = _generate(runner, lazy, max_new_tokens=30)
    assert "\ufffd" in free.text and "\ufffd" not in out.text and out.text[0] == free.text[0]
    assert not lazy.triggered and lazy.complete and parse_tool_calls(out.text, F.HERMES) == (out.text, [])


def test_special_token_trigger_and_bad_schema():
    from cachedrag.prompt.toolgrammar import tool_grammar

    with pytest.raises(ValueError, match="special token"):
        tool_grammar(F.LLAMA3_TAGGED, TOOLS, ToolChoice("auto"))
    grammar = tool_grammar(F.LLAMA3_TAGGED, TOOLS, ToolChoice("auto"), trigger_id=7)
    assert grammar.lazy_trigger is None and "<[7]>" in grammar.lark
    runner = tiny_runner("llama", seed=5)
    with pytest.raises(ConfigError):
        tool_constraint(runner.tokenizer, [0], [ToolSpec("f", "", {"type": "no-such-type"})], ToolChoice("required"))
