"""Chunk fingerprints of request bodies (what the router hashes)."""

from __future__ import annotations

from cachedrag.cluster.fingerprints import digest, request_fingerprints

LONG_A = "Alpha " * 50
LONG_B = "Bravo " * 50


def test_explicit_chunks_win_and_are_deduplicated():
    body = {"messages": [{"role": "user", "content": f"{LONG_A}\n\n{LONG_B}\n\nWhat?"}],
            "cachedrag": {"chunks": [LONG_B, " " + LONG_B + "\n", "short"]}}
    fp = request_fingerprints(body)
    assert fp.source == "explicit"
    assert fp.digests == [digest(LONG_B), digest("short")]
    assert fp.weights == [len(LONG_B.strip()), 5.0]


def test_automatic_paragraphs_skip_the_question_and_short_text():
    body = {"messages": [{"role": "system", "content": "You answer questions."},
                         {"role": "user", "content": f"{LONG_A}\n-----\n{LONG_B}\n\n{'Why ' * 60}"}]}
    fp = request_fingerprints(body)
    assert fp.source == "auto"
    assert fp.digests == [digest(LONG_A), digest(LONG_B)]  # the long last paragraph is the question


def test_same_passages_in_another_order_or_position_give_the_same_fingerprints():
    one = {"messages": [{"role": "user", "content": f"{LONG_A}\n\n{LONG_B}\n\nq1?"}]}
    two = {"messages": [{"role": "system", "content": "sys"},
                        {"role": "user", "content": f"Context:\n\n{LONG_B}\n\n{LONG_A}\n\nanother question?"}]}
    assert set(request_fingerprints(one).digests) == set(request_fingerprints(two).digests)


def test_completion_prompts_and_content_parts():
    assert request_fingerprints({"prompt": f"{LONG_A}\n\nq?"}).digests == [digest(LONG_A)]
    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": LONG_A},
                                                        {"type": "text", "text": "question?"}]}]}
    assert request_fingerprints(parts).digests == [digest(LONG_A)]


def test_malformed_bodies_give_no_fingerprints():
    for body in (None, [], {}, {"messages": "x"}, {"prompt": 3}, {"cachedrag": {"chunks": "x"}, "prompt": "hi"}):
        fp = request_fingerprints(body)
        assert len(fp) == 0 and fp.source == "none"



def test_tool_results_are_fingerprinted_as_the_server_detects_them():
    import json

    from cachedrag.cluster.fingerprints import digest, request_fingerprints

    doc = "A passage a retriever tool returned, long enough to count as one passage. " * 3
    body = {"messages": [{"role": "user", "content": "Why?"}, {"role": "assistant", "content": None},
                         {"role": "tool", "content": json.dumps([{"page_content": doc.strip()}])}]}
    fp = request_fingerprints(body, min_chars=100)
    assert fp.source == "auto" and fp.digests == [digest(doc)]
