"""Tool calling's prompt side: the nouns, format detection, rendering with the model's template,
and the incremental parsers of each format.

transformers ships no chat templates offline, so the Qwen2.5 / Llama-3.1 / Mistral templates here
are minimal ones with the same tool markup as the real ones.
"""

from __future__ import annotations

import json

import pytest

from cachedrag.prompt import toolformat as F
from cachedrag.prompt.template import Message, render_messages
from cachedrag.prompt.toolparse import (ArgumentsDelta, CallEnded, CallStarted, TextDelta, close_partial_json,
                                        parse_tool_calls, parser_for)
from cachedrag.prompt.tools import ToolCall, ToolChoice, ToolSpec, as_tool_specs
from cachedrag.testing import byte_tokenizer

QWEN = (
    "{%- if tools %}<|im_start|>system\n{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}\n\n"
    "{% endif %}# Tools\n<tools>{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}\n</tools>\n"
    "For each function call, return a json object within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    "{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n"
    "{%- elif messages[0]['role'] == 'system' %}<|im_start|>system\n{{ messages[0]['content'] }}<|im_end|>\n"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'system' %}"
    "{%- elif message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant\n{{ message.content }}"
    "{%- for tc in message.tool_calls %}\n<tool_call>\n{\"name\": \"{{ tc.function.name }}\", \"arguments\": "
    "{{ tc.function.arguments | tojson }}}\n</tool_call>{%- endfor %}<|im_end|>\n"
    "{%- elif message.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ message.content }}\n"
    "</tool_response><|im_end|>\n"
    "{%- else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
)

LLAMA31 = (
    "<|begin_of_text|>{%- if tools %}<|start_header_id|>user<|end_header_id|>\n\nGiven the following functions, "
    "respond with a JSON for a function call with its proper arguments that best answers the given prompt.\n\n"
    "Respond in the format {\"name\": function name, \"parameters\": dictionary of argument name and its value}."
    "{% for t in tools %}\n{{ t | tojson }}{% endfor %}<|eot_id|>{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' and message.tool_calls %}<|start_header_id|>assistant<|end_header_id|>\n\n"
    "{%- for tc in message.tool_calls %}{\"name\": \"{{ tc.function.name }}\", \"parameters\": "
    "{{ tc.function.arguments | tojson }}}{% endfor %}<|eot_id|>"
    "{%- elif message.role in ['tool', 'ipython'] %}<|start_header_id|>ipython<|end_header_id|>\n\n"
    "{{ message.content }}<|eot_id|>"
    "{%- else %}<|start_header_id|>{{ message.role }}<|end_header_id|>\n\n{{ message.content }}<|eot_id|>"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{%- endif %}"
)

MISTRAL = (
    "{%- for message in messages %}"
    "{%- if message.role == 'user' %}{% if loop.last and tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}"
    "[/AVAILABLE_TOOLS]{% endif %}[INST]{{ message.content }}[/INST]"
    "{%- elif message.role == 'assistant' and message.tool_calls %}[TOOL_CALLS][{%- for tc in message.tool_calls %}"
    "{\"name\": \"{{ tc.function.name }}\", \"arguments\": {{ tc.function.arguments | tojson }}, \"id\": "
    "\"{{ tc.id }}\"}{% if not loop.last %}, {% endif %}{%- endfor %}]</s>"
    "{%- elif message.role == 'tool' %}[TOOL_RESULTS]{\"content\": {{ message.content | tojson }}, "
    "\"call_id\": \"{{ message.tool_call_id }}\"}[/TOOL_RESULTS]"
    "{%- else %}{{ message.content }}</s>{%- endif %}{%- endfor %}"
)

SEARCH = ToolSpec("search", "Search the docs.", {"type": "object", "properties": {"query": {"type": "string"}},
                                                 "required": ["query"]})


def _tok(template):
    tok = byte_tokenizer()
    tok.chat_template = template
    return tok


def _history():
    call = ToolCall("call_1", "search", '{"query": "heapq"}')
    return [Message("system", "Be brief."), Message("user", "What is heapq?"),
            Message("assistant", "", tool_calls=(call,)),
            Message("tool", "The heapq module provides a heap queue.", tool_call_id="call_1", name="search")]


def test_nouns_convert_from_and_to_openai():
    spec = ToolSpec.from_openai({"type": "function", "function": {"name": "f", "parameters": {"type": "object"},
                                                                  "strict": True}})
    assert spec.strict and spec.to_openai()["function"]["name"] == "f"
    call = ToolCall.from_openai({"id": "c", "function": {"name": "f", "arguments": '{"a": 1}'}})
    assert call.args == {"a": 1} and call.to_template()["function"]["arguments"] == {"a": 1}
    assert ToolCall.of("f", {"a": 1}).arguments == '{"a": 1}'
    assert ToolChoice.parse(None) == ToolChoice("auto")
    assert ToolChoice.parse("any", parallel=False) == ToolChoice("required", parallel=False)
    assert ToolChoice.parse({"type": "function", "function": {"name": "f"}}) == ToolChoice("named", "f")
    with pytest.raises(ValueError):
        ToolChoice.parse("g", tool_names=["f"])
    with pytest.raises(ValueError):
        as_tool_specs([spec, spec])
    assert Message("user", "hi") == Message("user", "hi")  # the two-field form still works


@pytest.mark.parametrize("template, fmt", [(QWEN, "hermes"), (LLAMA31, "llama3"), (MISTRAL, "mistral"),
                                           (byte_tokenizer().chat_template, "envelope")])
def test_format_detection(template, fmt):
    assert F.detect_format(_tok(template)).name == fmt


def test_native_template_renders_tools_calls_and_results():
    text = render_messages(_tok(QWEN), _history(), tools=[SEARCH]).text
    assert '"name": "search"' in text and "# Tools" in text
    assert '<tool_call>\n{"name": "search", "arguments": {"query": "heapq"}}\n</tool_call>' in text
    assert "<tool_response>\nThe heapq module provides a heap queue.\n</tool_response>" in text
    assert text.endswith("<|im_start|>assistant")
    llama = render_messages(_tok(LLAMA31), _history(), tools=[SEARCH]).text
    assert '{"name": "search", "parameters": {"query": "heapq"}}' in llama and "ipython" in llama
    mistral = render_messages(_tok(MISTRAL), _history()[1:], tools=[SEARCH]).text
    assert '[TOOL_CALLS][{"name": "search", "arguments": {"query": "heapq"}, "id": "call_1"}]' in mistral
    assert '"call_id": "call_1"' in mistral


def test_envelope_renders_a_system_section_and_calls_as_text():
    rendered = render_messages(byte_tokenizer(), _history(), tools=[SEARCH])
    text = rendered.text
    assert text.startswith("<|im_start|>system\nBe brief.\n\nYou can call the following tools.")
    assert '{"tool_calls":[{"name":"search","arguments":{"query":"heapq"}}]}' in text  # compact, as generated
    assert "<|im_start|>tool\nThe heapq module provides a heap queue.<|im_end|>" in text  # verbatim
    last = text.index("The heapq module provides")
    assert rendered.prefix_end == last  # the tool result is the newest content: the rest is a stable prefix
    plain = render_messages(byte_tokenizer(), [Message("user", "hi")])
    assert "tools" not in plain.text  # no tools: nothing added


def _events(fmt, text, step):
    parser = parser_for(fmt, iter(f"c{i}" for i in range(9)).__next__)
    events = []
    for i in range(0, len(text), step):
        events += parser.feed(text[i:i + step])
    return events + parser.finish(), parser.calls


@pytest.mark.parametrize("step", [1, 3, 1000])
@pytest.mark.parametrize("fmt, text", [
    (F.HERMES, 'Let me check. <tool_call>\n{"name": "search", "arguments": {"query": "a {b}"}}\n</tool_call>\n'
               '<tool_call>\n{"name":"add","arguments":{"a":1}}\n</tool_call>'),
    (F.LLAMA3_BARE, '{"name": "search", "parameters": {"query": "a {b}"}}; {"name": "add", "parameters": {"a": 1}}'),
    (F.LLAMA3_TAGGED, '<|python_tag|>{"name": "search", "parameters": {"query": "a {b}"}}; '
                      '{"name": "add", "parameters": {"a": 1}}'),
    (F.MISTRAL, '[TOOL_CALLS][{"name": "search", "arguments": {"query": "a {b}"}}, '
                '{"name": "add", "arguments": {"a": 1}}]'),
    (F.ENVELOPE, '{"tool_calls": [{"name": "search", "arguments": {"query": "a {b}"}}, '
                 '{"arguments": {"a": 1}, "name": "add"}]}'),
])
def test_parsers_stream_name_first_then_arguments(fmt, text, step):
    events, calls = _events(fmt, text, step)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("search", {"query": "a {b}"}), ("add", {"a": 1})]
    for index in (0, 1):
        mine = [e for e in events if getattr(e, "index", None) == index]
        assert isinstance(mine[0], CallStarted) and isinstance(mine[-1], CallEnded)
        args = "".join(e.text for e in mine if isinstance(e, ArgumentsDelta))
        assert json.loads(args) == json.loads(calls[index].arguments)
    assert [c.id for c in calls] == ["c0", "c1"]
    text_out = "".join(e.text for e in events if isinstance(e, TextDelta))
    assert text_out == ("Let me check. " if fmt is F.HERMES else "")


@pytest.mark.parametrize("step", [1, 4, 1000])
def test_a_repeated_call_never_reaches_the_stream(step):
    """Two calls named alike: the second streams once it ended, or never when it repeats the first
    (a small model looping on parallel calls), so a streamed message and the whole answer agree."""
    text = ('{"tool_calls": [{"name": "ping", "arguments": {}}, {"name": "ping", "arguments": {}}, '
            '{"name": "search", "arguments": {"query": "x"}}, {"name": "search", "arguments": {"query": "y"}}]}')
    events, calls = _events(F.ENVELOPE, text, step)
    assert [(c.name, c.args) for c in calls] == [("ping", {}), ("search", {"query": "x"}), ("search", {"query": "y"})]
    started = [e for e in events if isinstance(e, CallStarted)]
    assert [(e.index, e.name) for e in started] == [(0, "ping"), (1, "search"), (2, "search")]
    last_search = [i for i, e in enumerate(events) if getattr(e, "index", None) == 2]
    assert last_search == list(range(last_search[0], len(events)))  # held, then passed on whole at its end
    assert isinstance(events[last_search[-1]], CallEnded)
    for index in (0, 1, 2):
        args = "".join(e.text for e in events if isinstance(e, ArgumentsDelta) and e.index == index)
        assert json.loads(args) == calls[index].args
    events, calls = _events(F.ENVELOPE, '{"tool_calls": [{"name": "ping", "arguments": {}}, {"name": "ping", "argu',
                            step)  # a repeat cut off by the token limit: dropped, never shown
    assert len(calls) == 1 and [e.index for e in events if isinstance(e, CallStarted)] == [0]


@pytest.mark.parametrize("fmt", [F.HERMES, F.ENVELOPE, F.LLAMA3_BARE, F.MISTRAL])
def test_text_without_calls_passes_through(fmt):
    text = "No call needed: <tool is a word, [TOOL and {\"x\": 1} too."
    events, calls = _events(fmt, text, 2)
    assert calls == [] and "".join(e.text for e in events if isinstance(e, TextDelta)) == text


def test_a_call_cut_off_is_closed_on_finish():
    content, calls = parse_tool_calls('<tool_call>\n{"name": "search", "arguments": {"query": "hea', F.HERMES)
    assert content == "" and calls[0].name == "search" and calls[0].args == {"query": "hea"}
    _, calls = parse_tool_calls('{"tool_calls":[{"name":"search","arguments":{"query":"x","n":', F.ENVELOPE)
    assert calls[0].args == {"query": "x"}
    _, calls = parse_tool_calls('{"tool_calls":[{"name":"sea', F.ENVELOPE)
    assert calls[0].name == "sea" and calls[0].args == {}


@pytest.mark.parametrize("partial, closed", [('{"a":"x', {"a": "x"}), ('{"a":1,', {"a": 1}),
                                             ('{"a":{"b":[1,2', {"a": {"b": [1, 2]}}), ('{"a":', {}),
                                             ('{"a":"x","b"', {"a": "x"}), ("{", {})])
def test_close_partial_json(partial, closed):
    assert json.loads(close_partial_json(partial)) == closed


def test_special_token_markers_may_be_missing_from_decoded_text():
    """Decoding with skip_special_tokens drops <|python_tag|> / [TOOL_CALLS]: the calls still parse."""
    _, calls = parse_tool_calls('{"name": "search", "parameters": {"query": "x"}}', F.LLAMA3_TAGGED)
    assert [c.name for c in calls] == ["search"]
    _, calls = parse_tool_calls('[{"name": "search", "arguments": {"query": "x"}}]', F.MISTRAL_TOKEN)
    assert [c.name for c in calls] == ["search"]
