"""Conversations as prefix hits (``cachedrag.engine.continuation``): an agent's second step, whose
prompt is the first step's prompt, its answer and a new tool result cut into other segments,
computes only the new tokens (and the answer's last token, never fed back), and answers as full
prefill does; an approximate step is followed only by reuse modes."""

from __future__ import annotations

import pytest

from cachedrag.config import EngineConfig
from cachedrag.engine import CachedEngine
from cachedrag.kvcache.keys import chunk_key
from cachedrag.kvcache.tree import KnowledgeTree
from cachedrag.model.generation import SamplingParams
from cachedrag.prompt import Segment
from cachedrag.model.runner import ModelRunner
from cachedrag.testing import byte_tokenizer, tiny_model

SYSTEM = "<|im_start|>system\nYou answer with the search tool.<|im_end|>\n<|im_start|>user\n"
QUESTION = "How do I keep a list sorted?<|im_end|>\n<|im_start|>assistant\n"
PASSAGES = [
    "bisect.insort inserts an item into a sorted list keeping it sorted, in logarithmic search time. " * 2,
    "The heapq module provides an implementation of the heap queue algorithm, a priority queue. " * 2,
]
HEADER = "<|im_end|>\n<|im_start|>tool\n"
TAIL = "<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture
def engine():
    tok = byte_tokenizer()
    model = tiny_model("llama", seed=3, vocab_size=len(tok), max_position_embeddings=4096)
    model.generation_config.eos_token_id = tok.eos_token_id
    return CachedEngine(ModelRunner(model, tok), config=EngineConfig(mode="cachedrag"))


def _params(n: int = 10) -> SamplingParams:
    return SamplingParams(max_new_tokens=n)


def _text(engine, text: str) -> Segment:
    ids = engine.prompts.running_ids(text)
    return Segment("text", ids, chunk_key(ids, engine.namespace), text)


def _next_step(engine, prompt: list[Segment], answer: list[int], passages: list[str]) -> tuple[list[Segment], int]:
    """The next step's prompt cut as a server cuts it (everything up to the tool result's first
    passage one text segment, the passages chunks, the tail text) and its count of new tokens."""
    old = [t for s in prompt for t in s.ids] + list(answer)
    head = tuple(old) + engine.prompts.running_ids(HEADER)
    segments = [Segment("text", head, chunk_key(head, engine.namespace))]
    segments += [engine.prompts.chunk_segment(p) for p in passages]
    segments.append(_text(engine, TAIL))
    return segments, sum(len(s) for s in segments) - len(old)


def test_second_step_computes_only_its_new_tokens_and_answers_as_full_prefill(engine):
    step1 = [_text(engine, SYSTEM), _text(engine, QUESTION)]
    r1 = engine.generate_segments(step1, _params(), conversation=True)
    assert len(r1.token_ids) >= 2
    step2, new = _next_step(engine, step1, r1.token_ids, PASSAGES)
    r2 = engine.generate_segments(step2, _params(), conversation=True)
    full = engine.generate_segments(step2, _params(), mode="full")
    assert r2.computed_tokens == new + 1  # the answer's last token was never fed back: computed now
    assert r2.prefix_hit_tokens == r2.prompt_tokens - new - 1
    assert r2.approximations == []  # the passages were new: computed fresh, exactly
    assert r2.token_ids == full.token_ids
    # prefix caching takes the same path (it is exact)
    assert engine.generate_segments(step2, _params(), mode="prefix").token_ids == full.token_ids


def test_an_ordinary_request_stores_no_answer(engine):
    step1 = [_text(engine, SYSTEM), _text(engine, QUESTION)]
    r1 = engine.generate_segments(step1, _params())
    step2, new = _next_step(engine, step1, r1.token_ids, PASSAGES)
    r2 = engine.generate_segments(step2, _params())
    assert r2.computed_tokens > new + 1  # only the system segment was on the tree


def test_approximate_step_is_followed_by_reuse_modes_only(engine):
    for p in PASSAGES:  # the passages are cached variants: the agent's step reuses them
        engine.generate([p, PASSAGES[0] if p != PASSAGES[0] else PASSAGES[1]], "warm up", max_new_tokens=1)
    step1 = [_text(engine, SYSTEM), _text(engine, QUESTION)]
    r1 = engine.generate_segments(step1, _params(), conversation=True)
    step2, _ = _next_step(engine, step1, r1.token_ids, PASSAGES)
    r2 = engine.generate_segments(step2, _params(), conversation=True)
    assert r2.chunks_hit == len(PASSAGES) and "chunk_reuse" in r2.approximations
    step3, new = _next_step(engine, step2, r2.token_ids, PASSAGES[::-1])
    r3 = engine.generate_segments(step3, _params(), conversation=True)
    assert r3.computed_tokens <= new + 1 + sum(r3.chunk_recompute[i].__len__() for i in range(len(PASSAGES)))
    assert r3.prefix_hit_tokens == r3.prompt_tokens - new - 1
    assert "conversation_prefix" in r3.approximations
    # an exact lookup never meets the approximate path: prefix caching recomputes step 2's passages onward
    r3p = engine.generate_segments(step3, _params(), mode="prefix")
    assert r3p.prefix_hit_tokens < r3.prefix_hit_tokens
    assert engine.generate_segments(step3, _params(), mode="full").token_ids == r3p.token_ids


def test_match_tokens_finds_a_path_cut_elsewhere():
    tree = KnowledgeTree("lru")
    ids = list(range(20))
    key = lambda a, b: f"k{a}-{b}"  # noqa: E731 (a content key of the ids a..b)
    tree.insert([key(0, 5), key(5, 12)], ["h0", "h1"], [5, 7], [50, 70])
    tree.insert([key(0, 5), key(5, 9)], ["h0", "h2"], [5, 4], [50, 40])
    assert [n.handle for n in tree.match_tokens(len(ids), key)] == ["h0", "h1"]  # the longer child first
    assert [n.handle for n in tree.match_tokens(10, key)] == ["h0", "h2"]  # h1 would pass the prompt's end
    approx = tree.insert([key(0, 5), key(5, 12) + "~a"], ["h0", "h3"], [5, 7], [50, 70])
    assert approx.created == 1
    assert [n.handle for n in tree.match_tokens(len(ids), key, alternates=lambda k: (k + "~a",))][:2] == ["h0", "h1"]
