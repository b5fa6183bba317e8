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


def test_tool_results_hold_passages_plain_or_json_dumped():
    import json

    from cachedrag.prompt.passages import tool_passages

    a = "A retrieved passage about heaps, long enough to be one: " + "x" * 20
    b = 'Another one, with "quotes" and a\nline break inside it: ' + "y" * 20
    assert tool_passages(f"{a}\n\n{b}", 40) == [a, b]  # plain: every paragraph, the last too
    dumped = json.dumps([{"page_content": a, "metadata": {"source": "s"}}, {"page_content": b}])
    assert tool_passages(dumped, 40) == [a, json.dumps(b)[1:-1]]  # as the JSON text writes them
    assert tool_passages(json.dumps([a, "short"]), 40) == [a]
    assert tool_passages(json.dumps({"results": [{"text": b}]}, ensure_ascii=False), 40) == \
        [json.dumps(b, ensure_ascii=False)[1:-1]]
    assert context_passages(["Question?", dumped], 40, roles=["user", "tool"]) == [a, json.dumps(b)[1:-1]]
    assert context_passages([f"{a}\n\nQ: ?", f"{a}\n\n{b}"], 40, roles=["user", "tool"]) == [a, a, b]
