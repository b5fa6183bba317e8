"""Prompt splitting: parts preserve the prompt, chunks become cache segments, layout rules hold."""

from __future__ import annotations

import pytest

from cachedrag.prompt.registry import ChunkRegistry
from cachedrag.prompt.splitter import split_prompt
from cachedrag.prompt.template import RenderedPrompt

A = "The heapq module provides an implementation of the heap queue algorithm."
B = "The json module encodes and decodes JSON documents; pass indent to pretty-print."


@pytest.fixture
def reg():
    r = ChunkRegistry()
    r.register([A, B])
    return r


def test_parts_in_order_and_lossless(reg):
    prompt = f"sys\nuser: Context:\n{B}\n\n{A}\nQ: what?\nassistant:"
    split = split_prompt(prompt, reg)
    assert split.text == prompt
    assert split.parts == [("text", "sys\nuser: Context:\n"), ("chunk", B), ("text", "\n\n"), ("chunk", A),
                           ("text", "\nQ: what?\nassistant:")]
    assert split.n_chunks == 2 and split.chunk_chars == len(A) + len(B)


def test_no_registered_chunks_is_one_text_part(reg):
    split = split_prompt("nothing known here", reg)
    assert split.parts == [("text", "nothing known here")] and split.n_chunks == 0


@pytest.mark.parametrize("prompt, parts", [
    (A, [("text", A)]),
    ("ctx " + A, [("text", "ctx " + A)]),
    (B + "\n" + A, [("chunk", B), ("text", "\n" + A)]),
])
def test_a_trailing_chunk_is_demoted_to_text(reg, prompt, parts):
    assert split_prompt(prompt, reg).parts == parts


def test_prefix_cut_at_the_last_message_when_no_chunk_precedes(reg):
    before = "<s>system: be brief</s><s>user: "
    text = before + "Question first, then context:\n" + A + "\nok</s>"
    split = split_prompt(RenderedPrompt(text, prefix_end=len(before)), reg)
    assert split.parts == [("text", before), ("text", "Question first, then context:\n"), ("chunk", A),
                           ("text", "\nok</s>")]


def test_prefix_cut_without_chunks(reg):
    text = "system prompt | user: hello there | assistant:"
    split = split_prompt(RenderedPrompt(text, prefix_end=text.index("hello")), reg)
    assert split.parts == [("text", "system prompt | user: "), ("text", "hello there | assistant:")]


@pytest.mark.parametrize("where", ["chunk_first", "at_edge"])
def test_no_prefix_cut_when_a_chunk_precedes_or_at_an_edge(reg, where):
    if where == "chunk_first":
        text = "user: " + A + "\nassistant: ok\nuser: more?"
        prefix_end = text.index("more?")
    else:
        text = "user: " + A + "\nQ?"
        prefix_end = len("user: ")
    split = split_prompt(RenderedPrompt(text, prefix_end=prefix_end), reg)
    assert split.parts == split_prompt(text, reg).parts
