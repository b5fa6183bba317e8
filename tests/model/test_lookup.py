"""Prompt-lookup drafts and speculative greedy decoding (equal to plain greedy decoding)."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from cachedrag.config import EngineConfig
from cachedrag.engine import CachedEngine
from cachedrag.model.generation import SamplingParams, decode_loop
from cachedrag.model.lookup import LookupConfig, PromptLookup
from cachedrag.model.textgen import TextGenerator
from cachedrag.testing import TINY_ARCHITECTURES, tiny_runner


def test_draft_copies_what_followed_the_latest_occurrence_of_the_suffix():
    lookup = PromptLookup(LookupConfig(max_draft=3, max_ngram=3, min_ngram=2), [1, 2, 3, 4, 5, 9, 2, 3, 7, 8])
    lookup.extend([2, 3])
    assert lookup.draft() == [7, 8, 2]  # the latest "2 3" (at 6) wins over the first one (at 1)
    assert lookup.draft(1) == [7]
    lookup.extend([4])
    assert lookup.draft() == [5, 9, 2]  # "2 3 4": only the first occurrence has it


def test_longest_ngram_is_tried_first_and_min_ngram_is_respected():
    cfg = LookupConfig(max_draft=2, max_ngram=3, min_ngram=2)
    lookup = PromptLookup(cfg, [5, 1, 2, 40, 41, 7, 1, 2, 50, 51, 5])
    lookup.extend([1, 2])
    assert lookup.draft() == [40, 41]  # "5 1 2" matched (3-gram) rather than the later "1 2"
    assert PromptLookup(cfg, [1, 2, 3]).draft() == []  # the suffix "2 3" occurs only once
    single = PromptLookup(cfg, [9, 8, 9])
    assert single.draft() == []  # a 1-gram match is below min_ngram
    assert PromptLookup(LookupConfig(min_ngram=1, max_ngram=1), [9, 8, 9]).draft() == [8, 9]


def test_lookup_config_is_validated():
    with pytest.raises(ValidationError):
        LookupConfig(min_ngram=4, max_ngram=2)
    with pytest.raises(ValidationError):
        LookupConfig(max_draft=-1)
    assert PromptLookup(LookupConfig(max_draft=0), [1, 2, 1, 2]).draft() == []


def _greedy(runner, prompt, max_new, lookup=None):
    kv = runner.new_kv(len(prompt) + max_new)
    logits = runner.prefill(torch.tensor(prompt), kv=kv)
    logprobs: list[float] = []
    params = SamplingParams(max_new_tokens=max_new)
    tokens = list(decode_loop(runner, kv, logits, len(prompt), params, set(), None, logprobs, lookup))
    return tokens, logprobs


@pytest.mark.parametrize("arch", TINY_ARCHITECTURES)
def test_speculative_greedy_equals_plain_greedy_with_right_and_wrong_drafts(arch):
    runner = tiny_runner(arch)
    prompt = [int(t) for t in torch.randint(0, 256, (30,), generator=torch.Generator().manual_seed(5))]
    plain, plain_lp = _greedy(runner, prompt, 24)
    # a context holding the greedy continuation proposes right drafts; the random prompt wrong ones
    cfg = LookupConfig(max_draft=4, min_ngram=1, max_ngram=3)
    for context in (prompt + plain, prompt):
        lookup = PromptLookup(cfg, context)
        got, got_lp = _greedy(runner, prompt, 24, lookup)
        assert got == plain
        torch.testing.assert_close(torch.tensor(got_lp), torch.tensor(plain_lp), atol=1e-4, rtol=0)
    right = PromptLookup(cfg, prompt + plain)
    _greedy(runner, prompt, 24, right)
    assert right.accepted >= 12 and right.passes < 24  # most tokens came from accepted drafts


def test_speculation_respects_max_new_tokens_and_eos():
    runner = tiny_runner("llama")
    prompt = list(range(40, 60))
    plain, _ = _greedy(runner, prompt, 12)
    lookup = PromptLookup(LookupConfig(max_draft=8, min_ngram=1), prompt + plain)
    got, _ = _greedy(runner, prompt, 5, lookup)
    assert got == plain[:5]
    eos = plain[3]
    kv = runner.new_kv(len(prompt) + 12)
    logits = runner.prefill(torch.tensor(prompt), kv=kv)
    lookup = PromptLookup(LookupConfig(max_draft=8, min_ngram=1), prompt + plain)
    got = list(decode_loop(runner, kv, logits, len(prompt), SamplingParams(max_new_tokens=12), {eos}, None, None,
                           lookup))
    assert got == plain[:plain.index(eos)]


def test_sampling_ignores_the_lookup():
    runner = tiny_runner("llama")
    prompt = list(range(40, 60))
    lookup = PromptLookup(LookupConfig(min_ngram=1), prompt * 2)
    kv = runner.new_kv(len(prompt) + 8)
    logits = runner.prefill(torch.tensor(prompt), kv=kv)
    params = SamplingParams(max_new_tokens=8, temperature=0.8, seed=3)
    list(decode_loop(runner, kv, logits, len(prompt), params, set(), None, None, lookup))
    assert lookup.passes == 0


def test_engine_and_text_generator_decode_the_same_with_and_without_lookup():
    runner = tiny_runner("qwen2")
    chunks = ["alpha beta gamma delta " * 6, "one two three four five " * 5]
    question = "alpha beta gamma"
    results = {}
    for draft in (0, 4):
        engine = CachedEngine(runner, config=EngineConfig(mode="full", lookup=LookupConfig(max_draft=draft, min_ngram=1)))
        results[draft] = engine.generate(chunks, question, max_new_tokens=20)
    assert results[4].token_ids == results[0].token_ids
    assert results[0].draft_passes == 0 and results[4].draft_passes > 0
    assert 0 <= results[4].draft_accepted <= results[4].draft_tokens
    prompt = [int(t) for t in torch.randint(0, 256, (25,), generator=torch.Generator().manual_seed(2))] * 2
    plain = TextGenerator(runner).generate(prompt, SamplingParams(max_new_tokens=16))
    spec = TextGenerator(runner, lookup=LookupConfig(min_ngram=1)).generate(prompt, SamplingParams(max_new_tokens=16))
    assert spec.token_ids == plain.token_ids and spec.text == plain.text


def test_the_index_is_built_at_the_first_draft_and_equals_one_built_token_by_token():
    from cachedrag.model.lookup import LookupConfig, PromptLookup

    config = LookupConfig(max_draft=3, max_ngram=3, min_ngram=1)
    ids = [5, 6, 7, 8, 5, 6, 9, 5, 6]
    lazy = PromptLookup(config, ids)
    assert lazy._indexed == 0  # nothing indexed before a draft is asked for
    step = PromptLookup(config)
    for t in ids:
        step.extend([t])
        step.draft()  # indexes each token as it comes
    assert lazy.draft() == step.draft() == [9, 5, 6]
    lazy.extend([7]); step.extend([7])
    assert lazy.draft() == step.draft() and lazy._after == step._after
