"""Sampling additions: top-k, repetition penalty, and JSON-schema-constrained decoding."""

from __future__ import annotations

import json

import pytest
import torch
from pydantic import BaseModel, Field

from cachedrag.errors import ConfigError
from cachedrag.model.constraint import JsonConstraint
from cachedrag.model.generation import SamplingParams, eos_token_ids, next_token, process_logits
from cachedrag.model.textgen import TextGenerator, chat_ids, chat_messages
from cachedrag.testing import tiny_runner


class Pick(BaseModel):
    ok: bool
    n: int = Field(ge=0, le=99)
    color: str = Field(json_schema_extra={"enum": ["red", "green"]})


@pytest.fixture(scope="module")
def runner():
    return tiny_runner("llama", seed=5)


def _generate(runner, params):
    ids = chat_ids(runner.tokenizer, chat_messages("Give me a pick as JSON."))
    return TextGenerator(runner).generate(ids, params)


@pytest.mark.parametrize("temperature, seed", [(0.0, None), (1.0, 1), (1.0, 2)])
def test_random_weights_still_give_schema_valid_json(runner, temperature, seed):
    """A random-weight model left alone writes bytes; constrained, every output validates."""
    free = _generate(runner, SamplingParams(max_new_tokens=40, temperature=temperature, seed=seed))
    with pytest.raises(ValueError):
        Pick.model_validate_json(free.text)
    constraint = JsonConstraint(Pick.model_json_schema(), runner.tokenizer, eos_token_ids(runner.model, runner.tokenizer))
    out = _generate(runner, SamplingParams(max_new_tokens=200, temperature=temperature, seed=seed,
                                           constraint=constraint))
    pick = Pick.model_validate_json(out.text)
    assert 0 <= pick.n <= 99 and pick.color in ("red", "green") and constraint.complete
    assert out.finish_reason == "stop"


def test_json_mode_gives_an_object(runner):
    constraint = JsonConstraint(None, runner.tokenizer, eos_token_ids(runner.model, runner.tokenizer))
    out = _generate(runner, SamplingParams(max_new_tokens=300, constraint=constraint))
    if constraint.complete:
        assert isinstance(json.loads(out.text), dict)
    else:  # an unbounded object may run past the token cap: what came out is a valid prefix
        assert out.text.startswith("{") and out.finish_reason == "length"


def test_bad_schema_is_a_config_error(runner):
    with pytest.raises(ConfigError, match="schema"):
        JsonConstraint({"type": "no-such-type"}, runner.tokenizer, [0])


def test_top_k_one_is_greedy_and_top_k_limits_choices():
    logits = torch.tensor([0.0, 3.0, 2.0, 1.0])
    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=5.0, top_k=1)
    assert {next_token(logits, params, gen) for _ in range(50)} == {1}
    params = SamplingParams(temperature=5.0, top_k=2)
    assert {next_token(logits, params, gen) for _ in range(200)} == {1, 2}


def test_repetition_penalty_follows_the_ctrl_rule():
    logits = torch.tensor([2.0, -2.0, 1.0, 0.5])
    got = process_logits(logits, SamplingParams(repetition_penalty=2.0), generated=[0, 1, 1])
    torch.testing.assert_close(got, torch.tensor([1.0, -4.0, 1.0, 0.5]))
    assert process_logits(logits, SamplingParams(), [0]) is logits  # nothing applies: untouched
    with pytest.raises(ValueError):
        SamplingParams(repetition_penalty=0.0)


def test_repetition_penalty_changes_greedy_output(runner):
    plain = _generate(runner, SamplingParams(max_new_tokens=30))
    penalised = _generate(runner, SamplingParams(max_new_tokens=30, repetition_penalty=5.0))
    assert len(set(penalised.token_ids)) > len(set(plain.token_ids))


def test_frequency_and_presence_penalties_follow_openai_rule():
    logits = torch.tensor([1.0, 2.0, 3.0, 4.0])
    params = SamplingParams(frequency_penalty=0.5, presence_penalty=0.25)
    out = process_logits(logits, params, [2, 2, 0])
    # token 2 generated twice: 3 - 2 * 0.5 - 0.25; token 0 once: 1 - 0.5 - 0.25; others untouched
    assert out.tolist() == [0.25, 2.0, 1.75, 4.0]
    assert logits.tolist() == [1.0, 2.0, 3.0, 4.0]  # the caller's tensor is not modified
    assert process_logits(logits, params, []) is logits  # nothing generated yet: nothing to penalise
    both = process_logits(logits, SamplingParams(repetition_penalty=2.0, presence_penalty=1.0), [3])
    assert both.tolist() == [1.0, 2.0, 3.0, 1.0]  # 4 / 2 - 1
    with pytest.raises(ValueError):
        SamplingParams(frequency_penalty=2.5)
