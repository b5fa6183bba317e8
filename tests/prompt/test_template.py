"""Rendering messages through the chat template, the prefix boundary, and fallbacks."""

from __future__ import annotations

import pytest

from cachedrag.prompt.template import Message, render_completion, render_messages, template_role, template_split
from cachedrag.testing import byte_tokenizer


@pytest.fixture(scope="module")
def tok():
    return byte_tokenizer()


def test_chatml_rendering_and_prefix_end(tok):
    msgs = [Message("system", "be brief"), Message("human", "hi"), Message("ai", "hello"),
            Message("user", "how are you?")]
    r = render_messages(tok, msgs)
    assert r.text == ("<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
                      "<|im_start|>assistant\nhello<|im_end|>\n<|im_start|>user\nhow are you?<|im_end|>\n"
                      "<|im_start|>assistant\n")
    assert r.text[r.prefix_end:].startswith("how are you?")
    assert r.notes == ()


def test_completion_is_the_user_turn(tok):
    r = render_completion(tok, "2+2?", system_prompt="math")
    assert r.text == "<|im_start|>system\nmath<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n"
    assert r.text[r.prefix_end:].startswith("2+2?")


def test_template_that_rewrites_content_has_no_prefix(tok):
    tok2 = byte_tokenizer()
    tok2.chat_template = ("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] | trim }}\n{% endfor %}"
                          "{% if add_generation_prompt %}[assistant] {% endif %}")
    assert render_messages(tok2, [Message("user", "  padded  ")]).prefix_end is None
    r = render_messages(tok2, [Message("user", "plain")])
    assert r.text[r.prefix_end:] == "plain\n[assistant] "


def test_strict_template_gets_merged_messages(tok):
    strict = byte_tokenizer()
    strict.chat_template = (
        "{% for m in messages %}{% if loop.index0 > 0 and m['role'] == messages[loop.index0 - 1]['role'] %}"
        "{{ raise_exception('roles must alternate') }}{% endif %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}")
    r = render_messages(strict, [Message("user", "a"), Message("user", "b")])
    assert r.text == "<user>a\n\nb<assistant>"
    assert r.notes and "merged" in r.notes[0]


def test_no_template_fallback():
    tok = byte_tokenizer()
    tok.chat_template = None
    r = render_messages(tok, [Message("system", "s"), Message("user", "q")])
    assert r.text == "system: s\nuser: q\nassistant:"
    assert r.text[r.prefix_end:] == "q\nassistant:"


@pytest.mark.parametrize("role, expected", [("human", "user"), ("AI", "assistant"), ("developer", "system"),
                                            ("function", "tool"), ("critic", "critic")])
def test_roles(role, expected):
    assert template_role(role) == expected


def test_empty_messages(tok):
    with pytest.raises(ValueError):
        render_messages(tok, [])


@pytest.mark.parametrize("system", [None, "be brief"])
def test_template_split_is_the_rendering_around_the_user_content(system):
    """The engine's chat layout puts its chunks and question between the two halves: together with
    the content they are the rendering of the same messages."""
    chatml, plain = byte_tokenizer(), byte_tokenizer()
    plain.chat_template = None
    for tok in (chatml, plain):
        before, after = template_split(tok, system)
        messages = ([Message("system", system)] if system else []) + [Message("user", "Q?")]
        assert before + "Q?" + after == render_messages(tok, messages).text
    sys_line = "system: be brief\n" if system else ""
    assert template_split(plain, system) == (sys_line + "user: ", "\nassistant:")
    assert template_split(chatml, system)[1] == "<|im_end|>\n<|im_start|>assistant\n"
