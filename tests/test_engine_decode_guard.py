"""The tie guard during decoding (``CacheConfig.exact.tie_guard_decode``): an answer decoding on an
approximate prefill's KV that meets a near tie goes on from an exact prefill of the prompt and the
answer so far, so the rest of it is full prefill's.

The plant: a four-layer tiny model (seed 1) whose chunks were cached behind another system prompt
and are reused with no recompute. Its approximate greedy answer keeps full prefill's first tokens
and leaves full prefill's answer at token ``DIVERGES``. The guard's threshold is planted around
the approximate decode's own top-2 gaps (read teacher-forced on the same approximate prefill).
"""

from __future__ import annotations

import math
import time

import pytest
import torch

from cachedrag.config import EngineConfig
from cachedrag.engine import CachedEngine, DecodeTieGuard, top2_gap
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
    cache = CacheConfig(recompute_ratio=0.0, exact={"repeats": 0, "tie_guard_decode": decode})
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


@pytest.fixture
def late_switch(plant, monkeypatch):
    """The guard switches only after the parting token (past it every token decoded on approximate KV
    is no longer full prefill's): what a first-token flip the first-token guard missed looks like."""
    _, _, diverges, _ = plant
    late = diverges + 2
    original = DecodeTieGuard.due

    def due(self, logits, n_tokens):
        return original(self, logits, n_tokens) if n_tokens == late else False

    monkeypatch.setattr(DecodeTieGuard, "due", due)
    return late


@pytest.mark.parametrize("draft", [0, 4], ids=["plain", "prompt-lookup"])
def test_a_whole_answer_rewinds_to_the_tokens_the_exact_prefill_agrees_with(runner, plant, late_switch, draft):
    """Not streamed, the answer goes back to the tokens the exact prefill agrees with and on from there:
    full prefill's answer although its own tokens had parted before the switch. Streamed, the tokens
    shown stand (``tie_guard_agreed`` says how many were full prefill's)."""
    approximate, full, diverges, _ = plant
    engine = _engine(runner, math.inf, draft)
    r = engine.generate(SEQ, QUESTION, SYSTEM, max_new_tokens=TOKENS)
    assert r.tie_guard_switch == late_switch and r.tie_guard_agreed == diverges
    assert r.tie_guard_rewound == late_switch - diverges
    assert r.token_ids == full != approximate and r.text == runner.tokenizer.decode(full)
    assert r.finish_reason == "length" and len(r.token_logprobs) == len(full)
    streamed = _engine(runner, math.inf, draft).generate(SEQ, QUESTION, SYSTEM, max_new_tokens=TOKENS, stream=True)
    text = "".join(streamed)
    s = streamed.result
    assert s.tie_guard_switch == late_switch and s.tie_guard_agreed == diverges and s.tie_guard_rewound is None
    assert s.token_ids[:late_switch] == approximate[:late_switch] != full[:late_switch] and text == s.text


def test_a_rewind_back_to_no_token_replaces_the_first(runner, plant):
    """``stream_tokens`` under a hook that rewinds to no token (a first token the exact prefill would not
    have chosen): the answer is the one decoded from the hook's KV, and TTFT is when its first token was
    chosen."""
    from cachedrag.model.generation import Rewind
    from cachedrag.model.textgen import stream_tokens

    approximate, full, _, _ = plant
    engine = _engine(runner)
    segs = engine.prompts.chat(SEQ, QUESTION, SYSTEM)
    pre = engine.prefill(segs, TOKENS)  # approximate: its answer is ``approximate``
    exact = _engine(runner).prefill(segs, TOKENS, mode="full")
    calls, rewound_at = [], []

    def hook(logits, answer):
        calls.append(list(answer))
        if len(calls) == 1:
            rewound_at.append(time.perf_counter())
            raise Rewind(exact.kv, exact.logits, 0)

    class Owner:
        last_result = None

    t0 = time.perf_counter()
    for _ in stream_tokens(runner, pre.kv, pre.logits, pre.info["prompt_tokens"], SamplingParams(max_new_tokens=TOKENS),
                           engine.eos_ids, t0, Owner, switch=hook):
        pass
    result = Owner.last_result
    assert calls[0] == approximate[:1]  # the hook saw the approximate first token
    assert result.token_ids == full and result.text == runner.tokenizer.decode(full)
    assert len(result.token_logprobs) == TOKENS
    assert rewound_at[0] - t0 <= result.ttft_s <= result.total_s  # the kept answer's first token came after


@pytest.fixture
def flipped_first(runner, plant, monkeypatch):
    """The approximate prefill's first-token logits with their top two swapped: a planted first-token
    flip (the first-token guard is off in ``_engine``). Returns the flipped token."""
    original = CachedEngine._prefill

    def _prefill(self, segments, mode, max_new_tokens, *args, **kwargs):
        pre = original(self, segments, mode, max_new_tokens, *args, **kwargs)
        if not kwargs.get("exact_plan") and pre.info["approximations"]:
            logits = pre.logits.clone()  # [V] or [N, V]
            row = logits.view(-1, logits.shape[-1])[-1]  # [V]
            top = row.topk(2).indices  # [2]
            row[top] = row[top.flip(0)]
            pre.logits = logits
        return pre

    monkeypatch.setattr(CachedEngine, "_prefill", _prefill)
    engine = _engine(runner)
    r = engine.generate(SEQ, QUESTION, SYSTEM, max_new_tokens=1)
    assert r.token_ids[0] != plant[1][0]  # the plant: the approximate first token is not full prefill's
    return r.token_ids[0]


def test_a_rewind_past_a_flipped_first_token_reports_the_token_decoded(runner, plant, flipped_first):
    """A first token the first-token guard missed: asked whole, the answer is rewound to full prefill's,
    and ``decoded_first_token`` keeps the token decoded first (what a stream would have shown), which the
    benchmarks' first-token figures read; streamed, that token stands."""
    full = plant[1]
    r = _engine(runner, math.inf).generate(SEQ, QUESTION, SYSTEM, max_new_tokens=TOKENS)
    assert r.tie_guard_switch == 1 and r.tie_guard_agreed == 0 and r.tie_guard_rewound == 1
    assert r.token_ids == full and r.decoded_first_token == flipped_first != full[0]
    streamed = _engine(runner, math.inf).generate(SEQ, QUESTION, SYSTEM, max_new_tokens=TOKENS, stream=True)
    "".join(streamed)
    s = streamed.result
    assert s.tie_guard_rewound is None and s.token_ids[0] == s.decoded_first_token == flipped_first
    assert s.token_ids[1:] == _full(runner, [t for seg in _engine(runner).prompts.chat(SEQ, QUESTION, SYSTEM)
                                             for t in seg.ids] + [flipped_first], TOKENS - 1)
    unguarded = _engine(runner).generate(SEQ, QUESTION, SYSTEM, max_new_tokens=TOKENS)
    assert unguarded.decoded_first_token == unguarded.token_ids[0] == flipped_first


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
            CacheConfig(exact={"tie_guard_decode": bad})


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


def _serve(engine, prompts: list[tuple[list[str], str]], whole_answer: bool = False, deltas: dict | None = None,
           **config) -> list[Finished]:
    loop = EngineLoop(engine, SchedulerConfig(order="fifo", **config))
    done: dict[int, object] = {}
    for i, (chunks, question) in enumerate(prompts):
        segs = engine.prompts.chat(chunks, question, SYSTEM)

        def emit(event, i=i):
            if isinstance(event, (Finished, Failed)):
                done[i] = event
            elif deltas is not None:
                deltas.setdefault(i, []).append(event.text)

        loop.submit(ServeRequest(segments=segs, params=SamplingParams(max_new_tokens=TOKENS), emit=emit,
                                 whole_answer=whole_answer))
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


@pytest.mark.parametrize("chunk", [0, 64], ids=["whole-prefill", "chunked-prefill"])
def test_the_server_loop_rewinds_a_whole_answer_and_sends_it_once(runner, plant, late_switch, chunk):
    """A non-streaming request (``whole_answer``) is rewound as ``generate`` rewinds it: full prefill's
    answer, sent as one text when it finishes; a streamed one keeps the tokens it has sent."""
    approximate, full, diverges, _ = plant
    other = (["A cold passage nobody cached before.", "And another one."], "what is cold?")
    deltas: dict = {}
    # exact_when_waiting=0: the other request waits at the first one's admission, which would otherwise be exact
    whole, beside = _serve(_engine(runner, math.inf), [(SEQ, QUESTION), other], whole_answer=True, deltas=deltas,
                           max_batch=2, prefill_chunk_tokens=chunk, exact_when_waiting=0, exact_whole_answers=False)
    assert whole.token_ids == full and whole.text == runner.tokenizer.decode(full)
    assert whole.stats["tie_guard_switch"] == late_switch and whole.stats["tie_guard_agreed"] == diverges
    assert whole.stats["tie_guard_rewound"] == late_switch - diverges
    assert deltas[0] == [whole.text]  # held until whole: nothing of the parted tokens went out
    assert beside.token_ids == _engine(runner).generate(*other, SYSTEM, max_new_tokens=TOKENS).token_ids
    streamed, _ = _serve(_engine(runner, math.inf), [(SEQ, QUESTION), other], max_batch=2,
                         prefill_chunk_tokens=chunk, exact_when_waiting=0)
    assert streamed.token_ids[:late_switch] == approximate[:late_switch] and streamed.token_ids != full
    assert streamed.stats["tie_guard_rewound"] is None


@pytest.mark.parametrize("waiting", [1, 0], ids=["exact-when-waiting", "never"])
def test_under_a_queue_a_faithful_server_admits_requests_exactly(runner, plant, waiting):
    """With the guard at every token (``faithful``), a request admitted while another waits is prefilled
    exactly (prefix caching's plan): it would move onto exact KV before its second token anyway.
    ``exact_when_waiting=0`` keeps the approximate prefill and the switch."""
    _, full, _, _ = plant
    engine = _engine(runner, math.inf)
    keys = [s.key for s in engine.prompts.chat(SEQ, QUESTION, SYSTEM) if s.kind == "chunk"]
    assert [len(engine.manager.index.variants(k)) for k in keys] == [1, 1, 1]  # behind the other system prompt
    other = (["A cold passage nobody cached before.", "And another one."], "what is cold?")
    first, _ = _serve(engine, [(SEQ, QUESTION), other], max_batch=1, exact_when_waiting=waiting)
    assert first.token_ids == full  # either way full prefill's answer
    # either way the exact prefill's chunks are stored as variants too (reusable at other positions)
    assert [len(engine.manager.index.variants(k)) for k in keys] == [2, 2, 2]
    if waiting:
        assert first.stats["approximations"] == [] and first.stats.get("tie_guard_switch") is None
    else:
        assert "chunk_reuse" in first.stats["approximations"] and first.stats["tie_guard_switch"] == 1


def test_a_switch_keeps_the_chunks_it_computed_reusable(runner):
    """A chunk the approximate prefill computed fresh behind a reused one is stored as a variant;
    the switch's exact prefill computes the same path exactly and replaces that entry. The exact
    entry takes the variant's place (with its attention metadata), so a later request reusing the
    chunk elsewhere still finds it instead of computing it again."""
    engine = _engine(runner, math.inf)  # every chunk but CHUNKS[3] cached as a variant
    r = engine.generate([CHUNKS[1], CHUNKS[3]], QUESTION, SYSTEM, max_new_tokens=4)
    assert r.segment_actions[1:] == ["reuse", "fresh"] and r.tie_guard_switch == 1
    key = engine.prompts.chat([CHUNKS[3]], QUESTION, SYSTEM)[1].key
    (variant,) = engine.manager.index.variants(key)
    assert variant.meta is not None and variant.handle in engine.manager._exact  # the exact entry, reusable
    later = engine.generate([CHUNKS[3], CHUNKS[0]], QUESTION, SYSTEM, max_new_tokens=1)
    assert later.segment_actions[1:] == ["reuse", "reuse"]
    assert engine.manager.check() == []


@pytest.mark.parametrize("whole", [True, False], ids=["whole", "streamed"])
def test_a_faithful_server_admits_whole_answers_exactly(runner, plant, whole):
    """With the guard at every token, a non-streaming request (``whole_answer``) is prefilled exactly: nobody
    sees its first token early and it would move onto exact KV before its second token anyway. A streamed
    one gets the approximate prefill (its first token sooner) and switches."""
    _, full, _, _ = plant
    engine = _engine(runner, math.inf)
    loop_config = dict(max_batch=1, exact_when_waiting=0)
    (r,) = _serve(engine, [(SEQ, QUESTION)], whole_answer=whole, **loop_config)
    assert r.token_ids == full
    if whole:
        assert r.stats["approximations"] == [] and r.stats.get("tie_guard_switch") is None
    else:
        assert "chunk_reuse" in r.stats["approximations"] and r.stats["tie_guard_switch"] == 1
    (kept,) = _serve(_engine(runner, math.inf), [(SEQ, QUESTION)], whole_answer=whole, exact_whole_answers=False,
                     **loop_config)
    assert "chunk_reuse" in kept.stats["approximations"] and kept.token_ids == full  # the setting off: rewinds
