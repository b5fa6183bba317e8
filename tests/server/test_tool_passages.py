"""An agent's retrieval step: passages inside tool messages (plain or a JSON-dumped tool result)
are found by the automatic passage detection and served from the chunk cache."""

from __future__ import annotations

import json

import pytest

openai = pytest.importorskip("openai")

DOCS = ["The heapq module keeps a list as a binary heap: heappush and heappop run in logarithmic time each.",
        "A deque from collections appends and pops at both ends in constant time, unlike a list at its front.",
        "The bisect module finds insertion points in a sorted list by binary search, keeping it sorted."]


def _step(question: str, result: str) -> list[dict]:
    call = {"id": "call_0", "type": "function",
            "function": {"name": "search", "arguments": json.dumps({"q": question})}}
    return [{"role": "system", "content": "Answer from the tool results."},
            {"role": "user", "content": question},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_0", "content": result}]


@pytest.mark.parametrize("dump", [
    lambda docs: json.dumps([{"page_content": d, "metadata": {"i": i}} for i, d in enumerate(docs)]),
    lambda docs: json.dumps(docs),
    lambda docs: "\n\n".join(docs),
], ids=["documents", "strings", "plain"])
def test_a_tool_message_holding_passages_seen_before_yields_chunk_hits(live_server, dump):
    s = live_server(passages={"min_chars": 90})
    client = openai.OpenAI(base_url=s.base_url, api_key="none", max_retries=0)
    first = client.chat.completions.create(model="tiny", messages=_step("What is a heap?", dump(DOCS[:2])),
                                           max_tokens=2, temperature=0)
    served = first.model_extra["cachedrag"]
    assert served["chunks_hit"] == 0 and served["chunks_missed"] >= 2  # each passage its own chunk, cold
    later = client.chat.completions.create(model="tiny", messages=_step("And a queue?", dump(DOCS[:0:-1])),
                                           max_tokens=2, temperature=0)
    served = later.model_extra["cachedrag"]
    assert served["chunks_hit"] >= 1  # the passage seen in the earlier step, now at another position
    assert later.usage.prompt_tokens_details.cached_tokens > 0
