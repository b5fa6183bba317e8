"""Sub-question parsing, sentence cuts and FLARE's confidence masks (pure Python)."""

from __future__ import annotations

import math

import pytest

from cachedrag.pipelines.parsing import first_sentence, low_confidence, masked_query, parse_subquestions

Q = "How do I read and write JSON files?"


@pytest.mark.parametrize("text, expected, how", [
    ('["How do I read JSON?", "How do I write JSON?"]', ["How do I read JSON?", "How do I write JSON?"], "json"),
    ('Sure! Here they are:\n["What is json.load?", "What is json.dump?"]\nHope it helps.',
     ["What is json.load?", "What is json.dump?"], "json"),
    ('[{"question": "What is json.load?"}, {"sub_question": "What is json.dump?"}]',
     ["What is json.load?", "What is json.dump?"], "json"),
    ('["What is json.load?", "What is json.du', ["What is json.load?"], "quoted"),  # cut by the token limit
    ("1. What is json.load?\n2) What is json.dump?\n3: How do files work?",
     ["What is json.load?", "What is json.dump?", "How do files work?"], "list"),
    ("- What is json.load?\n* What is json.dump?", ["What is json.load?", "What is json.dump?"], "list"),
    ("Some thoughts.\nWhat is json.load?\nWhat is json.dump?", ["What is json.load?", "What is json.dump?"], "lines"),
    ("I cannot split this.", [Q], "fallback"),
    ("", [Q], "fallback"),
    ("[1, 2, 3]", [Q], "fallback"),
    ('["a", "b"]', [Q], "fallback"),  # too short to be questions
])
def test_parse_subquestions(text, expected, how):
    assert parse_subquestions(text, Q) == (expected, how)


def test_parse_subquestions_caps_and_dedupes():
    text = '["Q one?", "q ONE?", "Q two?", "Q three?", "Q four?"]'
    subs, how = parse_subquestions(text, Q, max_n=3)
    assert subs == ["Q one?", "Q two?", "Q three?"] and how == "json"
    assert parse_subquestions(text, Q, max_n=1)[0] == ["Q one?"]


def _ids(text):
    return [ord(c) for c in text]


def _decode(ids):
    return "".join(chr(i) for i in ids)


@pytest.mark.parametrize("text, n, sentence, complete", [
    ("Use json.dumps. Then write it", 15, "Use json.dumps.", True),
    ("Is it? Yes", 6, "Is it?", True),
    ("Wow!\nNext", 4, "Wow!", True),
    ("no end here", 11, "no end here", False),
    ("ends at the end.", 16, "ends at the end.", False),  # no stop string: the tokens ran out or EOS
])
def test_first_sentence(text, n, sentence, complete):
    cut = first_sentence(_ids(text), _decode)
    assert (cut.n_tokens, cut.text, cut.complete) == (n, sentence, complete)


def test_first_sentence_multi_char_tokens():
    pieces = ["Use", " json", ".dumps", ".", " Then", " more"]
    vocab = {i: p for i, p in enumerate(pieces)}
    cut = first_sentence(list(vocab), lambda ids: "".join(vocab[i] for i in ids))
    assert (cut.n_tokens, cut.text) == (4, "Use json.dumps.")


@pytest.mark.parametrize("probs, threshold, low", [
    ([0.9, 0.8, 0.95], 0.5, []),
    ([0.9, 0.3, 0.95, 0.1], 0.5, [1, 3]),
    ([0.5, 0.49], 0.5, [1]),  # a probability equal to the threshold is confident
    ([], 0.5, []),
])
def test_low_confidence(probs, threshold, low):
    assert low_confidence([math.log(p) for p in probs], threshold) == low


def test_masked_query_drops_low_probability_tokens():
    tokens = ["heapq", " pushes", " a", " banana", " onto", " the", " heap"]
    probs = [0.9, 0.8, 0.7, 0.05, 0.6, 0.9, 0.2]
    vocab = dict(enumerate(tokens))
    query = masked_query(list(vocab), [math.log(p) for p in probs], 0.4, lambda ids: "".join(vocab[i] for i in ids))
    assert query == "heapq pushes a onto the"
    assert masked_query(list(vocab), [math.log(0.1)] * 7, 0.4, lambda ids: "".join(vocab[i] for i in ids)) == ""
