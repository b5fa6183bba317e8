"""``n`` choices from one prefill, and ``/v1/embeddings``, over a live tiny server."""

from __future__ import annotations

import base64

import httpx
import numpy as np
import pytest

from cachedrag.testing import TINY_DOCS

openai = pytest.importorskip("openai")

MESSAGES = [{"role": "system", "content": "Answer briefly."},
            {"role": "user", "content": f"Context:\n\n{TINY_DOCS[0].text}\n\nQuestion: what is it?"}]


def _client(server):
    return openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0)


def test_n_choices_share_one_prefill(live_server):
    s = live_server()
    client = _client(s)
    one = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=6, temperature=0)
    steps = s.loop.steps
    r = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=6, temperature=0, n=3)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert {c.message.content for c in r.choices} == {one.choices[0].message.content}  # greedy: all the same
    assert r.usage.prompt_tokens == one.usage.prompt_tokens  # the prompt counted once
    assert r.usage.completion_tokens == 3 * one.usage.completion_tokens
    assert s.loop.steps - steps <= one.usage.completion_tokens  # the 3 choices decode in the same steps
    sampled = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=8, temperature=1.0,
                                             seed=5, n=3)
    again = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=8, temperature=1.0,
                                           seed=5, n=3)
    texts = [c.message.content for c in sampled.choices]
    assert texts == [c.message.content for c in again.choices]  # seeded: reproducible per choice
    assert len(set(texts)) > 1  # each choice its own seed


def test_n_choices_prefill_once(live_server):
    s = live_server()
    calls = []
    prefill_task = s.engine.prefill_task

    def counting(*args, **kwargs):
        calls.append(1)
        return prefill_task(*args, **kwargs)

    s.engine.prefill_task = counting
    _client(s).chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4, temperature=0.7, n=4)
    assert len(calls) == 1


def test_n_choices_stream_per_choice_deltas(live_server):
    s = live_server()
    client = _client(s)
    whole = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=8, temperature=1.0, seed=2,
                                           n=2)
    stream = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=8, temperature=1.0, seed=2,
                                            n=2, stream=True, stream_options={"include_usage": True})
    texts, reasons, usage = {0: "", 1: ""}, {}, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            if c.finish_reason:
                reasons[c.index] = c.finish_reason
    assert texts == {c.index: c.message.content for c in whole.choices}
    assert set(reasons) == {0, 1}
    assert usage.completion_tokens == whole.usage.completion_tokens
    assert usage.prompt_tokens == whole.usage.prompt_tokens
    done = client.completions.create(model="tiny", prompt="Hello there, server.", max_tokens=4, temperature=0, n=2,
                                     logprobs=1)
    assert [c.index for c in done.choices] == [0, 1] and done.choices[0].text == done.choices[1].text
    assert len(done.choices[1].logprobs.tokens) == 4


class _StubEmbedder:
    """A deterministic 8-dimensional embedder (no model to load)."""

    name, dim = "stub/embedder", 8

    def encode(self, texts):
        rows = [np.frombuffer(t.encode().ljust(8, b"\0")[:8], dtype=np.uint8).astype(np.float32) + 1 for t in texts]
        out = np.stack(rows)  # [N, 8]
        return out / np.linalg.norm(out, axis=1, keepdims=True)

    def count_tokens(self, texts):
        return sum(len(t.split()) for t in texts)


def test_embeddings_in_the_openai_shape(live_server):
    s = live_server(embedder=_StubEmbedder())
    client = _client(s)
    r = client.embeddings.create(model="embedder", input=["hello world", "a b c"], encoding_format="float")
    expected = _StubEmbedder().encode(["hello world", "a b c"])
    assert [d.index for d in r.data] == [0, 1]
    assert np.allclose([d.embedding for d in r.data], expected)
    assert r.usage.prompt_tokens == 5 and r.usage.total_tokens == 5
    one = client.embeddings.create(model="default", input="hello world")  # the SDK asks for base64 by default
    assert np.allclose(one.data[0].embedding, expected[0], atol=1e-6)
    raw = httpx.post(s.base_url + "/embeddings", json={"model": "stub/embedder", "input": "hello world",
                                                       "encoding_format": "base64"}).json()
    vec = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), dtype="<f4")
    assert np.allclose(vec, expected[0])
    for body, status, param in [({"model": "other", "input": "x"}, 404, "model"),
                                ({"model": "default", "input": []}, 400, "input"),
                                ({"model": "default", "input": "x", "dimensions": 3}, 400, "dimensions")]:
        got = httpx.post(s.base_url + "/embeddings", json=body)
        assert got.status_code == status and got.json()["error"]["param"] == param


def test_embeddings_without_an_embedder_is_one_clear_error(live_server):
    s = live_server()
    r = httpx.post(s.base_url + "/embeddings", json={"model": "default", "input": "hello"})
    assert r.status_code == 404
    err = r.json()["error"]
    assert "no embedder" in err["message"] and err["code"] == "model_not_found"
