"""Exact repeats (``CacheConfig.exact.repeats``): a recurring chunk sequence gets its exact tree path.

A request served from reuse stores no exact path; once its sequence has been served from reuse
``exact_repeats`` times, the exact path is computed (after the response, or inline) and later
sightings are exact prefix hits equal to prefix caching and full prefill. Approximate KV is never
stored as an exact path, and a damaged promoted entry is a miss.
"""

from __future__ import annotations

import pytest
import torch

from cachedrag.config import EngineConfig
from cachedrag.engine import CachedEngine
from cachedrag.errors import ConfigError
from cachedrag.kvcache.config import CacheConfig
from cachedrag.kvcache.keys import path_key
from cachedrag.model.runner import ModelRunner
from cachedrag.testing import byte_tokenizer, tiny_model

from tests.test_engine import CHUNKS, SYSTEM  # the shared tiny-model excerpts

SEQ = [CHUNKS[0], CHUNKS[1], CHUNKS[2]]


@pytest.fixture(scope="module")
def runner():
    """Four layers: in a two-layer model a chunk computed fresh behind reused chunks has exact KV
    (layer 0's K/V depend only on token and position), so the approximation to plant needs three+."""
    tok = byte_tokenizer()
    model = tiny_model("qwen2", seed=3, vocab_size=len(tok), num_hidden_layers=4, layer_types=["full_attention"] * 4)
    model.generation_config.eos_token_id = tok.eos_token_id
    return ModelRunner(model, tok)


def _engine(runner, mode="cachedrag", store=None, **exact):
    """``exact``: ``ExactFallback`` fields."""
    cache = CacheConfig(recompute_ratio=0.3, exact=exact)
    return CachedEngine(runner, config=EngineConfig(mode=mode, cache=cache), store=store)


def _warm(engine):
    """Every chunk of SEQ cached as a variant, none on a tree path in SEQ's order."""
    engine.generate([CHUNKS[2], CHUNKS[1], CHUNKS[0]], "warm", SYSTEM, max_new_tokens=1)


def _keys(engine, chunks):
    segs = engine.prompts.chat(chunks, "q", SYSTEM)
    return [s.key for s in segs[:-1]]  # system + chunks


def test_repeat_after_promotion_equals_prefix_caching_and_full_prefill(runner):
    engine = _engine(runner)
    _warm(engine)
    first = engine.generate(SEQ, "which module memoizes?", SYSTEM, max_new_tokens=4)
    assert first.chunks_hit == 3 and "chunk_reuse" in first.approximations and first.exact_repeat is None
    second = engine.generate(SEQ, "what does bisect do?", SYSTEM, max_new_tokens=4)
    assert "chunk_reuse" in second.approximations  # still served from reuse: its TTFT pays nothing
    assert second.exact_repeat == "promoted" and second.promotion_s > 0
    third = engine.generate(SEQ, "what wraps text?", SYSTEM, max_new_tokens=6)
    assert third.approximations == [] and third.exact_repeat is None
    assert third.prefix_hit_tokens == third.prompt_tokens - third.question_tokens
    assert third.computed_tokens == third.question_tokens

    prefix = _engine(runner, mode="prefix")
    prefix.generate(SEQ, "first", SYSTEM, max_new_tokens=1)
    p = prefix.generate(SEQ, "what wraps text?", SYSTEM, max_new_tokens=6)
    assert p.prefix_hit_tokens == third.prefix_hit_tokens
    full = engine.generate(SEQ, "what wraps text?", SYSTEM, max_new_tokens=6, mode="full")
    assert third.token_ids == p.token_ids == full.token_ids
    segs = engine.prompts.chat(SEQ, "what wraps text?", SYSTEM)
    got = engine.prefill_logits(segs)
    torch.testing.assert_close(got, prefix.prefill_logits(segs), atol=1e-5, rtol=0)
    torch.testing.assert_close(got, engine.prefill_logits(segs, mode="full"), atol=1e-5, rtol=0)
    assert engine.manager.check() == []


def test_reference_behaviour_off_keeps_approximating(runner):
    engine = _engine(runner, repeats=0)
    _warm(engine)
    rs = [engine.generate(SEQ, f"question {i}", SYSTEM, max_new_tokens=1) for i in range(4)]
    assert all("chunk_reuse" in r.approximations and r.exact_repeat is None and r.promotion_s == 0 for r in rs)
    assert engine.manager.tree.find(_keys(engine, SEQ)) is None


def test_inline_promotion_serves_the_recurring_request_exactly(runner):
    engine = _engine(runner, repeats_when="inline")
    _warm(engine)
    first = engine.generate(SEQ, "q", SYSTEM, max_new_tokens=1)
    assert "chunk_reuse" in first.approximations
    second = engine.generate(SEQ, "which module memoizes?", SYSTEM, max_new_tokens=5)
    assert second.exact_repeat == "inline" and second.approximations == [] and second.chunks_hit == 0
    full = engine.generate(SEQ, "which module memoizes?", SYSTEM, max_new_tokens=5, mode="full")
    assert second.token_ids == full.token_ids
    third = engine.generate(SEQ, "q3", SYSTEM, max_new_tokens=1)
    assert third.approximations == [] and third.computed_tokens == third.question_tokens


def test_threshold_counts_reuse_served_sightings_only(runner):
    engine = _engine(runner, repeats=3)
    _warm(engine)
    rs = [engine.generate(SEQ, f"q{i}", SYSTEM, max_new_tokens=1) for i in range(4)]
    assert [r.exact_repeat for r in rs] == [None, None, "promoted", None]
    assert rs[3].approximations == []
    # an exact hit is no reuse-served sighting: nothing counted for it
    assert engine.manager._repeats.count(path_key(_keys(engine, SEQ))) == 3


def test_prefill_hands_the_promotion_to_the_caller(runner):
    engine = _engine(runner)
    _warm(engine)
    segs = engine.prompts.chat(SEQ, "q", SYSTEM)
    assert engine.prefill(segs, 1).promote is None
    pre = engine.prefill(segs, 1)
    assert pre.info["exact_repeat"] == "promote" and pre.promote is not None
    assert engine.manager.tree.find(_keys(engine, SEQ)) is None  # nothing computed until the caller runs it
    assert pre.promote() > 0
    assert engine.manager.tree.find(_keys(engine, SEQ)) is not None
    again = engine.prefill(segs, 1)
    assert again.info["approximations"] == [] and again.promote is None


def test_an_overdue_promotion_goes_inline_at_the_next_sighting(runner):
    """``after_response_else_inline`` (the server's timing): the caller never runs the handed-over
    promotion (a loaded server has no idle time), so the next reuse-served sighting is prefilled
    exactly, stores the path, and the one after is an exact hit equal to full prefill; the plain
    ``after_response`` timing keeps handing the promotion over."""
    for when, fourth in (("after_response_else_inline", "inline"), ("after_response", "promote")):
        engine = _engine(runner, repeats_when=when)
        _warm(engine)
        segs = engine.prompts.chat(SEQ, "q", SYSTEM)
        kinds = [engine.prefill(segs, 1).info["exact_repeat"] for _ in range(3)]  # no promote() ever called
        assert kinds == [None, "promote", fourth]
        last = engine.prefill(segs, 1)
        if when == "after_response":
            assert last.info["exact_repeat"] == "promote" and engine.manager.tree.find(_keys(engine, SEQ)) is None
            continue
        assert last.info["approximations"] == [] and last.info["exact_repeat"] is None and last.promote is None
        got = engine.generate(SEQ, "which module?", SYSTEM, max_new_tokens=4)
        full = engine.generate(SEQ, "which module?", SYSTEM, max_new_tokens=4, mode="full")
        assert got.approximations == [] and got.token_ids == full.token_ids


def test_approximate_kv_is_never_stored_as_an_exact_path(runner):
    """The planted collision: SEQ's third chunk is computed fresh behind two reused chunks, so its
    approximate KV is stored under the very handle (= path) its exact tree node gets later."""
    engine = _engine(runner)
    engine.generate([CHUNKS[1], CHUNKS[0]], "warm", SYSTEM, max_new_tokens=1)
    first = engine.generate(SEQ, "q", SYSTEM, max_new_tokens=1)
    assert first.chunks_hit == 2 and first.chunks_missed == 1
    keys = _keys(engine, SEQ)
    handle = path_key(keys)
    m = engine.manager
    assert m.tree.find(keys) is None and handle in m.handles() and handle not in m._exact  # a variant only
    approx = m.store.get(handle)
    second = engine.generate(SEQ, "q", SYSTEM, max_new_tokens=1)
    assert second.exact_repeat == "promoted"
    node = m.tree.find(keys)
    assert node is not None and node.handle == handle and handle in m._exact
    assert m.counters["replaced_approximate"] == 1 and m.check() == []
    exact = m.store.get(handle)
    prefix = _engine(runner, mode="prefix")
    prefix.generate(SEQ, "q", SYSTEM, max_new_tokens=1)
    reference = prefix.manager.store.get(handle)
    torch.testing.assert_close(exact.k, reference.k, atol=1e-5, rtol=0)
    torch.testing.assert_close(exact.v, reference.v, atol=1e-5, rtol=0)
    assert (approx.v - reference.v).abs().max() > 1e-3  # the planted approximation was real, and is gone


@pytest.mark.parametrize("when", ["after_response", "inline"])
def test_damaged_promoted_entry_is_a_miss_not_a_wrong_answer(runner, tmp_path, when):
    from cachedrag.store.config import StoreConfig
    from cachedrag.store.tiered import TieredStore

    probe = CachedEngine(runner)
    store = TieredStore.from_config(StoreConfig(namespace=probe.model_namespace.digest, disk_dir=str(tmp_path),
                                                disk_bytes=64 << 20))
    engine = CachedEngine(runner, store=store, config=EngineConfig(
        break_even_factor=1e6, cache=CacheConfig(recompute_ratio=0.3, exact={"repeats_when": when})))
    _warm(engine)
    for i in range(2):
        engine.generate(SEQ, f"q{i}", SYSTEM, max_new_tokens=1)
    assert engine.manager.tree.find(_keys(engine, SEQ)) is not None
    for path in sorted(p for p in tmp_path.rglob("*") if p.is_file() and p.stat().st_size > 4096):
        data = bytearray(path.read_bytes())  # flip a byte inside every entry's last layers
        data[-100] ^= 0xFF
        path.write_bytes(bytes(data))
    r = engine.generate(SEQ, "what wraps text?", SYSTEM, max_new_tokens=5)
    full = engine.generate(SEQ, "what wraps text?", SYSTEM, max_new_tokens=5, mode="full")
    assert any("computed fresh" in n for n in r.notes)
    assert r.approximations == [] and r.token_ids == full.token_ids


@pytest.mark.parametrize("field, value", [("repeats", -1), ("repeats", 1.5),
                                          ("repeats_when", "idle"), ("repeat_memory", 0)])
def test_bad_settings_are_refused(field, value):
    with pytest.raises(ConfigError, match=f"exact.{field}"):
        CacheConfig(exact={field: value})
