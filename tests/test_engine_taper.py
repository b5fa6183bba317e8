"""Gradual filtering (``CacheConfig.layer_taper``) on a 4-layer tiny model: the reference
equivalence (a schedule that keeps every row equals today's path bit for bit), which rows each
layer computes, what a dropped row's K/V hold, and planted outliers for both rankings."""

from __future__ import annotations

import pytest
import torch

from cachedrag.config import EngineConfig
from cachedrag.engine import CachedEngine
from cachedrag.errors import ConfigError
from cachedrag.kvcache.config import CacheConfig
from cachedrag.kvcache.planner import taper_counts
from cachedrag.model.runner import ModelRunner
from cachedrag.testing import byte_tokenizer, tiny_model

from tests.test_engine import CHUNKS, SYSTEM

ORDER = [CHUNKS[2], CHUNKS[1], CHUNKS[0]]  # every chunk cached (from CHUNKS[:3]), none in prefix order
QUESTION = "which module memoizes?"
LAYERS = 4


@pytest.fixture(scope="module")
def runner():
    tok = byte_tokenizer()
    model = tiny_model("qwen2", seed=3, vocab_size=len(tok), num_hidden_layers=LAYERS,
                       layer_types=["full_attention"] * LAYERS)
    return ModelRunner(model, tok)


def _engine(runner, **cache):
    cache.setdefault("recompute_ratio", 0.3)
    cache.setdefault("fresh_dtype", "float32")
    cache.setdefault("recompute_dtype", "float32")  # the rows' own precision: what the taper changes is their depth
    engine = CachedEngine(runner, config=EngineConfig(early_termination=False, cache=CacheConfig(**cache)))
    engine.generate(CHUNKS[:3], "warm", SYSTEM, max_new_tokens=1)  # caches every chunk after the system prompt
    return engine


def _computed_rows(runner, engine) -> tuple[dict[int, list[int]], object, list]:
    """Positions each layer of the prefill proper computes (the pre-pass runs no full layer > 0
    over reused rows; the prefill's calls are the last ``LAYERS``), the ``Prefilled`` and segments."""
    calls: list[tuple[int, list[int]]] = []
    original = runner.forward_layer

    def spy(i, hidden, positions, *args, **kwargs):
        calls.append((i, positions.tolist()))
        return original(i, hidden, positions, *args, **kwargs)

    segs = engine.prompts.chat(ORDER, QUESTION, SYSTEM)
    runner.forward_layer = spy
    try:
        pre = engine.prefill(segs, max_new_tokens=1)
    finally:
        del runner.forward_layer
    return {i: p for i, p in calls[-LAYERS:]}, pre, segs


def test_a_schedule_that_keeps_every_row_is_the_reference_bit_for_bit(runner):
    ref = _engine(runner)
    kept = _engine(runner, layer_taper=((1, 1.0), (3, 1.0)))
    segs = ref.prompts.chat(ORDER, QUESTION, SYSTEM)
    a, b = ref.prefill(segs, max_new_tokens=1), kept.prefill(segs, max_new_tokens=1)
    assert torch.equal(a.logits, b.logits)
    assert torch.equal(a.kv.k[:, :, :a.info["prompt_tokens"]], b.kv.k[:, :, :b.info["prompt_tokens"]])
    assert torch.equal(a.kv.v[:, :, :a.info["prompt_tokens"]], b.kv.v[:, :, :b.info["prompt_tokens"]])
    assert a.info["computed_fraction"] == b.info["computed_fraction"]
    assert a.info["approximations"] == b.info["approximations"] == ["chunk_reuse", "partial_recompute:question+inter"]
    ra = ref.generate(ORDER, QUESTION, SYSTEM, max_new_tokens=6)
    rb = kept.generate(ORDER, QUESTION, SYSTEM, max_new_tokens=6)
    assert ra.token_ids == rb.token_ids and ra.chunk_recompute == rb.chunk_recompute


@pytest.mark.parametrize("rank", ["choice", "deviation"])
def test_later_layers_compute_the_kept_share_of_each_chunk(runner, rank):
    ref = _engine(runner)
    tapered = _engine(runner, layer_taper=((2, 0.5),), taper_rank=rank)
    rows_ref, pre_ref, _ = _computed_rows(runner, ref)
    rows, pre, segs = _computed_rows(runner, tapered)
    assert rows[0] == rows[1] == rows_ref[0] == rows_ref[1]  # below the step: every chosen row
    assert rows_ref[0] == rows_ref[2] == rows_ref[3]  # the reference keeps them all
    starts = [sum(len(s) for s in segs[:k]) for k in range(len(segs) + 1)]
    for slot in (1, 2, 3):  # the three reused chunks
        chosen = [p for p in rows[1] if starts[slot] <= p < starts[slot + 1]]
        kept = [p for p in rows[2] if starts[slot] <= p < starts[slot + 1]]
        assert len(chosen) > 1 and len(kept) == -(-len(chosen) // 2) and set(kept) <= set(chosen)
    question = [p for p in rows[0] if p >= starts[4]]
    assert question and set(question) <= set(rows[2])  # question rows are never dropped
    dropped = len(rows[1]) - len(rows[2])
    assert pre.info["checked_tokens"] == dropped and pre.info["computed_tokens"] == pre_ref.info["computed_tokens"] - dropped
    assert pre.info["computed_fraction"] < pre_ref.info["computed_fraction"]
    assert pre.info["approximations"] == ["chunk_reuse", "partial_recompute:question+inter", "layer_taper"]
    assert not torch.equal(pre.logits, pre_ref.logits)


def test_a_dropped_row_keeps_its_recomputed_kv_below_the_step_and_the_cache_from_it_on(runner):
    engine = _engine(runner, layer_taper=((2, 0.0),))
    rows, pre, segs = _computed_rows(runner, engine)
    starts = [sum(len(s) for s in segs[:k]) for k in range(len(segs) + 1)]
    dropped = [p for p in rows[1] if starts[1] <= p < starts[4]]
    assert dropped and not set(dropped) & set(rows[2])
    # the cached rows as naive reuse (no recompute) loads them, from the same manager's entries
    naive = CachedEngine(runner, config=EngineConfig(early_termination=False), manager=engine.manager)
    cached = naive.prefill(segs, max_new_tokens=1, mode="naive")
    idx = torch.tensor(dropped)
    for buf in ("k", "v"):
        got, cache = getattr(pre.kv, buf)[:, :, idx], getattr(cached.kv, buf)[:, :, idx]  # [L, H_kv, Td, D]
        assert torch.equal(got[2:], cache[2:])  # from the step on: the loaded cache (K re-rotated)
        torch.testing.assert_close(got[0], cache[0], atol=1e-5, rtol=0)  # layer 0: the token and position only
        assert not torch.allclose(got[1], cache[1], atol=1e-6)  # layer 1: recomputed in the new context


def _plant_value(engine, slot: int, token: int, layer: int) -> None:
    key = engine.prompts.chat(CHUNKS[:3], "q", SYSTEM)[1 + [2, 1, 0][slot - 1]].key
    (variant,) = engine.manager.index.variants(key)
    with torch.inference_mode():
        engine.manager.store.peek(variant.handle).tensors["v"][layer, :, token] += 100.0


def test_deviation_rank_keeps_the_row_whose_cache_deviates_most(runner):
    """A V outlier planted in the cache of one chosen token at the step layer: its fresh V
    deviates from the cache far more than any other's, so the deviation ranking keeps it even
    when each chunk keeps a single row; the choice ranking ignores the plant."""
    kept = {}
    for rank in ("deviation", "choice"):
        engine = _engine(runner, layer_taper=((2, 0.0001),), taper_rank=rank)
        rows, _, segs = _computed_rows(runner, engine)
        start = sum(len(s) for s in segs[:2])
        chosen = [p - start for p in rows[1] if start <= p < start + len(segs[2])]
        token = chosen[len(chosen) // 2 + 1]  # a chosen token that is not the first ranked by position
        _plant_value(engine, 2, token, 2)
        rows, _, _ = _computed_rows(runner, engine)
        kept[rank] = [p - start for p in rows[2] if start <= p < start + len(segs[2])]
        assert len(kept[rank]) == 1
        kept[rank + ":token"] = token
    assert kept["deviation"] == [kept["deviation:token"]]
    assert kept["choice"] != [kept["choice:token"]]


@pytest.mark.parametrize("steps, counts, expected", [
    (((15, 0.5),), {2: 70, 3: 69}, [(15, {2: 35, 3: 35})]),
    (((10, 0.5), (20, 0.25)), {2: 8}, [(10, {2: 4}), (20, {2: 2})]),
    (((10, 1.0),), {2: 8}, []),
    (((10, 0.5), (40, 0.0)), {2: 8}, [(10, {2: 4})]),
    (((10, 0.5), (12, 0.5)), {2: 8}, [(10, {2: 4})]),
    (((5, 0.0),), {2: 8, 4: 0}, [(5, {2: 0, 4: 0})]),
])
def test_taper_counts(steps, counts, expected):
    assert taper_counts(counts, steps, 30) == expected


@pytest.mark.parametrize("bad, match", [
    ({"layer_taper": ((0, 0.5),)}, "layer_taper layer"),
    ({"layer_taper": ((3, 1.5),)}, "layer_taper keep"),
    ({"layer_taper": ((5, 0.5), (3, 0.2))}, "increasing layers"),
    ({"layer_taper": ((3, 0.2), (5, 0.5))}, "non-increasing"),
    ({"layer_taper": (3, 0.5)}, "pairs"),
    ({"taper_rank": "random"}, "taper_rank"),
])
def test_bad_taper_settings_are_refused(bad, match):
    with pytest.raises(ConfigError, match=match):
        CacheConfig(**bad)


def test_taper_settings_are_normalised():
    assert CacheConfig(layer_taper=[[15, 0.5]]).layer_taper == ((15, 0.5),)
    assert CacheConfig().layer_taper == () and CacheConfig().taper_rank == "deviation"  # off unless asked for


def test_round_9s_schedule_tapers_a_deep_model():
    """``((15, 0.5),)``, deviation-ranked (round 9's candidate) acts on models deeper than 15 layers:
    half of each reused chunk's recompute tokens stop at layer 15; the default keeps them all."""
    tok = byte_tokenizer()
    deep = ModelRunner(tiny_model("qwen2", seed=3, vocab_size=len(tok), num_hidden_layers=16,
                                  layer_types=["full_attention"] * 16), tok)
    out = {}
    for name, cache in {"default": {"layer_taper": ((15, 0.5),)}, "off": {}}.items():
        cache["recompute_dtype"] = cache["fresh_dtype"] = "float32"
        engine = CachedEngine(deep, config=EngineConfig(cache=CacheConfig(**cache)))
        engine.generate(CHUNKS[:3], "warm", SYSTEM, max_new_tokens=1)
        out[name] = engine.generate(ORDER, QUESTION, SYSTEM, max_new_tokens=1)
    default, off = out["default"], out["off"]
    assert off.approximations == ["chunk_reuse", "partial_recompute:question+inter"] and off.checked_tokens == 0
    assert default.approximations == off.approximations + ["layer_taper"]
    chosen = sum(len(c) for c in default.chunk_recompute)
    assert default.checked_tokens == chosen - sum(-(-len(c) // 2) for c in default.chunk_recompute)
    assert default.computed_fraction < off.computed_fraction
