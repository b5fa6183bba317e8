"""Sampling, stop strings and streaming."""

from __future__ import annotations

import pytest
import torch

from cachedrag.errors import EmptyInputError
from cachedrag.model.generation import SamplingParams, TextStream, next_token
from cachedrag.model.textgen import TextGenerator, chat_ids, chat_messages
from cachedrag.testing import byte_tokenizer, tiny_runner


@pytest.mark.parametrize("stop,expected", [
    (("STOP",), "hello "),
    (("lo S", "xyz"), "hel"),
    (("absent",), "hello STOP world"),
])
def test_stream_cuts_at_stop_and_never_leaks_a_partial_stop(stop, expected):
    tok = byte_tokenizer()
    stream = TextStream(tok, stop)
    pieces = []
    for token in tok.encode("hello STOP world"):
        pieces.append(stream.push(token))
        assert not any(s in "".join(pieces) for s in stop)
        if stream.stopped:
            break
    pieces.append(stream.flush())
    assert "".join(pieces) == expected == stream.text


def test_stream_holds_back_half_a_utf8_character():
    tok = byte_tokenizer()
    stream = TextStream(tok)
    ids = tok.encode("é")  # two byte tokens
    assert len(ids) == 2
    assert stream.push(ids[0]) == ""
    assert stream.push(ids[1]) == "é"


def test_sampling_is_seeded_and_top_p_tiny_is_greedy():
    logits = torch.randn(50, generator=torch.Generator().manual_seed(0))
    p = SamplingParams(temperature=1.0, seed=7)
    from cachedrag.model.generation import make_generator

    a = [next_token(logits, p, make_generator(p)) for _ in range(3)]
    b = [next_token(logits, p, make_generator(p)) for _ in range(3)]
    assert a == b
    tiny_p = SamplingParams(temperature=1.0, top_p=1e-6, seed=1)
    assert next_token(logits, tiny_p, make_generator(tiny_p)) == int(logits.argmax())


def test_sampling_params_validation():
    with pytest.raises(ValueError):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError):
        SamplingParams(stop=[""])
    assert SamplingParams(stop="x").stop == ("x",)


def test_streaming_equals_generate_and_respects_max_tokens():
    runner = tiny_runner("llama")
    gen = TextGenerator(runner)
    ids = chat_ids(runner.tokenizer, chat_messages("hello there", "be brief"))
    params = SamplingParams(max_new_tokens=12)
    streamed = "".join(gen.stream(ids, params))
    result = gen.generate(ids, params)
    assert streamed == result.text
    assert len(result.token_ids) <= 12


def test_empty_question_is_refused():
    tok = byte_tokenizer()
    with pytest.raises(EmptyInputError):
        chat_ids(tok, chat_messages("   "))
