"""Content-defined passages: paragraphs at blank and separator lines, the question excepted."""

from __future__ import annotations

from cachedrag.prompt.passages import context_passages, last_paragraph, paragraphs


def test_paragraphs():
    assert paragraphs("a\n\nbb\n***\nccc", 2) == ["bb", "ccc"]
    assert paragraphs("", 1) == []


def test_passages_split_at_blank_and_separator_lines():
    text = "Context:\n-----\n" + "a" * 50 + "\nsecond line\n\n" + "b" * 30 + "\n\n" + "c" * 60 + "\n-----\nQ?"
    assert paragraphs(text, 40) == ["a" * 50 + "\nsecond line", "c" * 60]


def test_the_last_paragraph_of_the_last_message_is_the_question_never_a_passage():
    doc, other = "d" * 50, "e" * 50
    question = "q" * 50 + "?"
    assert last_paragraph(f"Context:\n\n{doc}\n\n{question}\n\n") == question
    assert last_paragraph("\n\n") is None
    # every message's long paragraphs are passages, but the last one of the last message
    assert context_passages([f"{other}\n\n{question}", f"{doc}\n\n{question}"], 40) == [other, question, doc]
    assert context_passages([f"{doc}\n\n{question}\n  "], 40) == [doc]  # trailing whitespace aside
    # a last message that ends in a short line: its last long paragraph is context
    assert context_passages([f"{doc}\n\nQ?"], 40) == [doc]
    assert context_passages([], 40) == []
