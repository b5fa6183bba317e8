"""The tie guard during decoding (``CacheConfig.tie_guard_decode``): an answer decoding on an
approximate prefill's KV that meets a near tie goes on from an exact prefill of the prompt and the
answer so far, so the rest of it is full prefill's.

The plant: a four-layer tiny model (seed 1) whose chunks were cached behind another system prompt
and are reused with no recompute. Its approximate greedy answer keeps full prefill's first tokens
and leaves full prefill's answer at token ``DIVERGES``. The guard's threshold is planted around
the approximate decode's own top-2 gaps (read teacher-forced on the same approximate prefill).
"""

from __future__ import annotations

import math

import pytest
import torch

from cachedrag.config import EngineConfig
from cachedrag.engine import CachedEngine, top2_gap
from cachedrag.errors import ConfigError
from cachedrag.kvcache.config import CacheConfig
from cachedrag.model.generation import SamplingParams
from cachedrag.model.lookup import LookupConfig
from cachedrag.model.runner import ModelRunner
from cachedrag.model.textgen import TextGenerator
from cachedrag.server.config import SchedulerConfig
from cachedrag.server.loop import EngineLoop, Failed, Finished, ServeRequest
from cachedrag.testing import byte_tokenizer, tiny_model
from tests.test_engine import CHUNKS, SYSTEM
from tests.test_engine_repeats import SEQ

QUESTION = "which module memoizes?"
TOKENS = 12


@pytest.fixture(scope="module")
def runner():
    tok = byte_tokenizer()
    model = tiny_model("qwen2", seed=1, vocab_size=len(tok), num_hidden_layers=4, layer_types=["full_attention"] * 4)
    model.generation_config.eos_token_id = tok.eos_token_id
    return ModelRunner(model, tok)


def _engine(runner, decode: float = 0.0, draft: int = 0) -> CachedEngine:
    cache = CacheConfig(recompute_ratio=0.0, exact_repeats=0, tie_guard_decode=decode)
    engine = CachedEngine(runner, config=EngineConfig(cache=cache, lookup=LookupConfig(max_draft=draft)))
    # every chunk of SEQ cached as a variant behind another system prompt: nothing on SEQ's tree path
    engine.generate([CHUNKS[2], CHUNKS[1], CHUNKS[0]], "warm", "another system prompt", max_new_tokens=1)
    return engine


def _full(runner, ids: list[int], tokens: int) -> list[int]:
    """Full prefill's greedy answer after the token ids ``ids`` (the plain generator)."""
    return TextGenerator(runner).generate(ids, SamplingParams(max_new_tokens=tokens)).token_ids


@pytest.fixture(scope="module")
def plant(runner):
    """The approximate answer (guard off), full prefill's, where they part, and the approximate
    decode's top-2 gap before each answer token."""
    engine = _engine(runner)
    approximate = engine.generate(SEQ, QUESTION, SYSTEM, max_new_tokens=TOKENS)
    assert "chunk_reuse" in approximate.approximations and approximate.tie_guard_switch is None
    segs = engine.prompts.chat(SEQ, QUESTION, SYSTEM)
    full = _full(runner, [t for s in segs for t in s.ids], TOKENS)
    diverges = next(i for i, (a, b) in enumerate(zip(approximate.token_ids, full)) if a != b)
    assert diverges >= 2  # the plant: the answers agree at first and part later
    rows = _engine(runner).generate_segments(segs, SamplingParams(max_new_tokens=TOKENS),
                                             teacher=approximate.token_ids).teacher_logits  # [A, V]
    gaps = [top2_gap(row) for row in rows]
    return approximate.token_ids, full, diverges, gaps


@pytest.mark.parametrize("draft", [0, 4], ids=["plain", "prompt-lookup"])
def test_a_near_tie_before_the_parting_token_makes_the_answer_full_prefills(runner, plant, draft):
    approximate, full, diverges, gaps = plant
    threshold = gaps[diverges] * 1.01 + 1e-6  # the parting token's logits are a near tie at this threshold
    engine = _engine(runner, threshold, draft)
    r = engine.generate(SEQ, QUESTION, SYSTEM, max_new_tokens=TOKENS)
    at = next(j for j in range(1, TOKENS) if gaps[j] < threshold)  # the first near tie the decode meets
    assert r.tie_guard_switch == at <= diverges
    assert r.tie_guard_switch_gap == pytest.approx(gaps[at], abs=1e-4)
    assert r.tie_guard_agreed == at and r.tie_guard_switch_s > 0  # every token before it was full prefill's
    assert r.token_ids == full != approximate
    assert "chunk_reuse" in r.approximations  # the prefill (and the answer's first tokens) were approximate
    # the exact prefill stored SEQ's tree path: the next sighting is an exact prefix hit
    again = engine.generate(SEQ, "what wraps text?", SYSTEM, max_new_tokens=4)
    assert again.approximations == [] and again.tie_guard_switch is None
    assert again.prefix_hit_tokens == again.prompt_tokens - again.question_tokens
    assert engine.manager.check() == []


def test_below_every_gap_the_approximate_answer_stands(runner, plant):
    approximate, _, _, gaps = plant
    r = _engine(runner, min(gaps[1:]) * 0.99).generate(SEQ, QUESTION, SYSTEM, max_new_tokens=TOKENS)
    assert r.tie_guard_switch is None and r.tie_guard_agreed is None
    assert r.token_ids == approximate


def test_a_switch_after_the_first_token_continues_full_prefill_of_that_prefix(runner, plant):
    approximate, full, _, _ = plant
    engine = _engine(runner, math.inf)  # every gap is below: the switch comes before token 1
    r = engine.generate(SEQ, QUESTION, SYSTEM, max_new_tokens=TOKENS)
    assert r.tie_guard_switch == 1 and r.tie_guard_agreed == 1
    segs = engine.prompts.chat(SEQ, QUESTION, SYSTEM)
    ids = [t for s in segs for t in s.ids]
    assert r.token_ids == [approximate[0], *_full(runner, ids + approximate[:1], TOKENS - 1)] == full


def test_the_exact_continuation_equals_full_prefill_and_counts_agreed_tokens(runner, plant):
    approximate, full, diverges, _ = plant
    engine = _engine(runner)
    segs = engine.prompts.chat(SEQ, QUESTION, SYSTEM)
    ids = [t for s in segs for t in s.ids]
    answer = approximate[:diverges + 2]  # full prefill's first tokens, then the approximation's
    exact = engine.prefill_exact_continuation(segs, answer, TOKENS)
    assert exact.info["answer_agreed"] == diverges and exact.info["approximations"] == []
    assert exact.kv.length == len(ids) + len(answer)
    reference = runner.prefill(torch.tensor(ids + answer), kv=runner.new_kv(len(ids) + len(answer)))  # [V]
    torch.testing.assert_close(exact.logits, reference.float(), atol=1e-4, rtol=0)
    assert engine.prefill_exact_continuation(segs, full[:3], TOKENS).info["answer_agreed"] == 3
    with pytest.raises(ConfigError):
        engine.prefill_exact_continuation(segs, [], TOKENS)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_switch_writes_the_answer_rows_as_decoding_full_prefills_answer_did(plant, dtype):
    """After a switch the answer goes on from the KV a full prefill's answer would have: the prompt
    prefilled, then each answer token by a decode step (what the server's batch and generate write),
    bit for bit. Appending the answer to the prefill instead rounds apart in bfloat16, and bench serve
    saw switched answers part from full prefill's there."""
    approximate, _, diverges, _ = plant
    tok = byte_tokenizer()
    model = tiny_model("qwen2", seed=1, vocab_size=len(tok), num_hidden_layers=4, layer_types=["full_attention"] * 4)
    low = ModelRunner(model, tok, dtype=dtype)
    engine = _engine(low)
    segs = engine.prompts.chat(SEQ, QUESTION, SYSTEM)
    answer = approximate[:diverges + 2]
    exact = engine.prefill_exact_continuation(segs, answer, TOKENS)
    full = _engine(low).prefill(segs, TOKENS, mode="full")
    start = full.kv.length
    rows = [low.decode_step(t, start + j, full.kv) for j, t in enumerate(answer)]  # [V] each
    assert torch.equal(exact.logits, rows[-1].float())
    assert exact.kv.length == full.kv.length == start + len(answer)
    for layer in range(low.n_layers):
        assert torch.equal(exact.kv.k[layer][:, :full.kv.length], full.kv.k[layer][:, :full.kv.length])
        assert torch.equal(exact.kv.v[layer][:, :full.kv.length], full.kv.v[layer][:, :full.kv.length])


def test_teacher_forced_rows_follow_the_switch(runner, plant):
    approximate, full, _, gaps = plant
    segs = _engine(runner).prompts.chat(SEQ, QUESTION, SYSTEM)
    params = SamplingParams(max_new_tokens=TOKENS)
    plain = _engine(runner).generate_segments(segs, params, teacher=full).teacher_logits  # [A, V]
    guarded = _engine(runner, 1e9).generate_segments(segs, params, teacher=full).teacher_logits
    exact = _engine(runner).generate_segments(segs, params, teacher=full, mode="full").teacher_logits
    torch.testing.assert_close(guarded[0], plain[0])  # the first token's row is the approximate prefill's
    torch.testing.assert_close(guarded[1:], exact[1:], atol=1e-4, rtol=0)  # then full prefill's
    assert not torch.allclose(plain[1:], exact[1:], atol=1e-4)


def test_no_guard_on_exact_prefills_or_other_modes(runner):
    engine = _engine(runner, 1e9)
    full = engine.generate(SEQ, QUESTION, SYSTEM, max_new_tokens=6, mode="full")
    prefix = engine.generate(SEQ, QUESTION, SYSTEM, max_new_tokens=6, mode="prefix")
    assert full.tie_guard_switch is None and prefix.tie_guard_switch is None
    for bad in (-0.1, math.nan, "0.2"):
        with pytest.raises(ConfigError):
            CacheConfig(tie_guard_decode=bad)


def test_a_failed_exact_prefill_keeps_the_approximate_answer(runner, plant, monkeypatch, caplog):
    approximate, _, _, _ = plant
    engine = _engine(runner, 1e9)

    def broken(*args, **kwargs):
        raise RuntimeError("planted failure")

    monkeypatch.setattr(engine, "prefill_exact_continuation", broken)
    r = engine.generate(SEQ, QUESTION, SYSTEM, max_new_tokens=TOKENS)
    assert r.token_ids == approximate and r.tie_guard_switch is None
    assert any("planted failure" in n for n in r.notes)
    assert "exact prefill during decoding failed" in caplog.text


def _serve(engine, prompts: list[tuple[list[str], str]], **config) -> list[Finished]:
    loop = EngineLoop(engine, SchedulerConfig(order="fifo", **config))
    done: dict[int, object] = {}
    for i, (chunks, question) in enumerate(prompts):
        segs = engine.prompts.chat(chunks, question, SYSTEM)

        def emit(event, i=i):
            if isinstance(event, (Finished, Failed)):
                done[i] = event

        loop.submit(ServeRequest(segments=segs, params=SamplingParams(max_new_tokens=TOKENS), emit=emit))
    while len(done) < len(prompts):
        loop.step()
    events = [done[i] for i in range(len(prompts))]
    assert all(isinstance(e, Finished) for e in events), events
    assert loop.running == 0 and loop.waiting == 0
    return events


@pytest.mark.parametrize("chunk", [0, 64], ids=["whole-prefill", "chunked-prefill"])
def test_the_server_loop_switches_as_generate_does(runner, plant, chunk):
    approximate, full, diverges, gaps = plant
    threshold = gaps[diverges] * 1.01 + 1e-6
    expected = _engine(runner, threshold).generate(SEQ, QUESTION, SYSTEM, max_new_tokens=TOKENS)
    engine = _engine(runner, threshold)
    # a second request decodes beside it (its chunks are all fresh: exact, so never guarded)
    other = (["A cold passage nobody cached before.", "And another one."], "what is cold?")
    guarded, beside = _serve(engine, [(SEQ, QUESTION), other], max_batch=2, prefill_chunk_tokens=chunk)
    assert guarded.token_ids == expected.token_ids == full
    assert guarded.stats["tie_guard_switch"] == expected.tie_guard_switch
    assert guarded.stats["tie_guard_agreed"] == expected.tie_guard_agreed
    assert beside.stats.get("tie_guard_switch") is None
    assert beside.token_ids == _engine(runner).generate(*other, SYSTEM, max_new_tokens=TOKENS).token_ids
    assert engine.manager.check() == []
