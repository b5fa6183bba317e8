"""Question-driven token choice, budget by need, teacher forcing, order-aware reuse, fidelity knob.

Planted-outlier tests on the tiny random model (2 layers): a cached K planted along the
question's own query direction at a question layer must be recomputed by the ``question``
choice and ignored by ``deviation`` (which looks at V); a V outlier the other way round.
"""

from __future__ import annotations

import math

import pytest
import torch

from cachedrag.config import FIDELITY_PRESETS, EngineConfig
from cachedrag.engine import CachedEngine, top2_gap
from cachedrag.errors import ConfigError
from cachedrag.kvcache.config import CacheConfig
from cachedrag.model.generation import SamplingParams
from cachedrag.testing import tiny_runner

from tests.test_engine import CHUNKS, SYSTEM  # the shared tiny-model excerpts

ORDER = [CHUNKS[2], CHUNKS[1], CHUNKS[0]]  # every chunk cached (from CHUNKS[:3]), none in prefix order
QUESTION = "which module memoizes?"


@pytest.fixture
def runner():
    return tiny_runner("qwen2", seed=3)


def _engine(runner, **kw):
    cache = kw.pop("cache", {})
    kw.setdefault("early_termination", False)
    return CachedEngine(runner, config=EngineConfig(cache=CacheConfig(**cache), **kw))


def _warm(engine):
    engine.generate(CHUNKS[:3], "warm", SYSTEM, max_new_tokens=1)


def _variant_entry(engine, chunk_index: int):
    key = engine.prompts.chat(CHUNKS[:3], "q", SYSTEM)[1 + chunk_index].key
    (variant,) = engine.manager.index.variants(key)
    return engine.manager.store.peek(variant.handle)


def _plant_question_key(engine, runner, token: int, layer: int = 1):
    """Make the cached raw K of ``token`` of CHUNKS[1] (served at prompt slot 1) point along the
    question's mean query at ``layer``, so the question attends to it far more than to any other."""
    recorded = {}
    original = runner.segment_attention_mass

    def spy(i, q, positions, kv, kv_len, bounds, **kwargs):
        if i == layer and "q" not in recorded:
            recorded["q"] = q.detach().clone()  # [H_q, Tq, D] rotated question queries
        return original(i, q, positions, kv, kv_len, bounds, **kwargs)

    recorder = engine
    if engine.config.cache.token_choice != "question":  # record the queries through a question engine
        recorder = CachedEngine(runner, config=EngineConfig(early_termination=False, cache=CacheConfig(
            recompute_ratio=0.01, token_choice="question")), manager=engine.manager)
    runner.segment_attention_mass = spy
    try:
        first = recorder.generate(ORDER, QUESTION, SYSTEM, max_new_tokens=1)
    finally:
        runner.segment_attention_mass = original
    assert first.chunks_hit == 3
    segs = engine.prompts.chat(ORDER, QUESTION, SYSTEM)
    pos = len(segs[0]) + len(segs[1]) + token  # absolute position of the planted token
    q = recorded["q"].mean(1)  # [H_q, D]
    group = runner.n_heads // runner.n_kv_heads
    k_rot = q.view(runner.n_kv_heads, group, -1).mean(1)  # [H_kv, D]
    k_rot = 50.0 * k_rot / k_rot.norm(dim=-1, keepdim=True)
    raw = runner.rotary.apply(k_rot[:, None, :], torch.tensor([-pos]))[:, 0]  # [H_kv, D] un-rotated
    with torch.inference_mode():
        _variant_entry(engine, 1).tensors["k"][layer, :, token] = raw
    return first


@pytest.mark.parametrize("token", [5, 30])
def test_question_choice_recomputes_the_token_the_question_attends_to(runner, token):
    engine = _engine(runner, cache={"recompute_ratio": 0.01, "token_choice": "question"})
    _warm(engine)
    first = _plant_question_key(engine, runner, token)
    assert token not in first.chunk_recompute[1]  # not chosen before the plant
    r = engine.generate(ORDER, QUESTION, SYSTEM, max_new_tokens=1)
    assert r.chunks_hit == 3 and 0 < len(r.chunk_recompute[1]) <= 2
    assert token in r.chunk_recompute[1]
    assert r.token_choice == "question" and "partial_recompute:question" in r.approximations
    # no probe of reused tokens: only recompute + question tokens are computed
    assert r.computed_tokens == r.recomputed_tokens + r.question_tokens and r.checked_tokens == 0


def test_deviation_choice_ignores_a_question_key_plant(runner):
    engine = _engine(runner, cache={"recompute_ratio": 0.01, "token_choice": "deviation"})
    _warm(engine)
    _plant_question_key(engine, runner, 30)
    assert 30 not in engine.generate(ORDER, QUESTION, SYSTEM, max_new_tokens=1).chunk_recompute[1]


def test_question_choice_ignores_a_value_outlier(runner):
    """V at the question layer cannot change the question's attention there."""
    engine = _engine(runner, cache={"recompute_ratio": 0.01, "token_choice": "question"})
    _warm(engine)
    before = engine.generate(ORDER, QUESTION, SYSTEM, max_new_tokens=1).chunk_recompute
    with torch.inference_mode():
        _variant_entry(engine, 1).tensors["v"][1, :, 40] += 100.0
    after = engine.generate(ORDER, QUESTION, SYSTEM, max_new_tokens=1).chunk_recompute
    assert after == before and 40 not in after[1]


def test_weighted_rank_spans_question_and_deviation(runner):
    picks = {}
    for name, cache in {"question": {"token_choice": "question"}, "deviation": {"token_choice": "deviation"},
                        "w1": {"token_choice": "question+deviation", "question_weight": 1.0},
                        "w0": {"token_choice": "question+deviation", "question_weight": 0.0},
                        "half": {"token_choice": "question+deviation"}}.items():
        engine = _engine(runner, cache={"recompute_ratio": 0.2, **cache})
        _warm(engine)
        picks[name] = engine.generate(ORDER, QUESTION, SYSTEM, max_new_tokens=1).chunk_recompute
    assert picks["w1"] == picks["question"] and picks["w0"] == picks["deviation"]
    assert picks["question"] != picks["deviation"]  # the two rankings differ on this request
    assert [len(c) for c in picks["half"]] == [len(c) for c in picks["deviation"]]


def test_question_choice_at_full_recompute_equals_full_prefill(runner):
    engine = _engine(runner, cache={"recompute_ratio": 1.0, "token_choice": "question",
                                    "precision": {"recompute": "float32", "fresh": "float32"}})
    _warm(engine)
    segs = engine.prompts.chat(ORDER, QUESTION, SYSTEM)
    torch.testing.assert_close(engine.prefill_logits(segs), engine.prefill_logits(segs, mode="full"),
                               atol=1e-4, rtol=0)


def test_teacher_forced_logits_reproduce_greedy_and_exact_reuse(runner):
    engine = _engine(runner)
    params = SamplingParams(max_new_tokens=6)
    segs = engine.prompts.chat(CHUNKS[:3], QUESTION, SYSTEM)
    full = engine.generate_segments(segs, params, mode="full")
    tf = engine.generate_segments(segs, params, mode="full", teacher=full.token_ids)
    assert tf.teacher_logits.shape == (len(full.token_ids), full_logits_width(engine, segs))
    assert tf.teacher_logits.argmax(-1).tolist() == full.token_ids
    engine.generate(CHUNKS[:3], "warm", SYSTEM, max_new_tokens=1)
    exact = engine.generate_segments(segs, params, mode="prefix", teacher=full.token_ids)
    assert exact.prefix_hit_tokens > 0 and exact.approximations == []
    torch.testing.assert_close(exact.teacher_logits, tf.teacher_logits, atol=1e-4, rtol=0)
    with pytest.raises(ConfigError):
        engine.generate_segments(segs, params, teacher=list(range(7)))


def test_order_aware_reuse_serves_the_cached_order_exactly(runner):
    on = _engine(runner, order_aware=True)
    off = _engine(runner)
    for e in (on, off):
        e.generate(CHUNKS[:3], "warm", SYSTEM, max_new_tokens=1)
    r_on = on.generate(ORDER, QUESTION, SYSTEM, max_new_tokens=1)
    r_off = off.generate(ORDER, QUESTION, SYSTEM, max_new_tokens=1)
    assert r_on.chunk_order == [2, 1, 0] and r_on.approximations == ["reordered"]
    assert r_on.prefix_hit_tokens == r_on.prompt_tokens - r_on.question_tokens
    assert r_off.chunk_order is None and "chunk_reuse" in r_off.approximations
    cached_order = on.prompts.chat(CHUNKS[:3], QUESTION, SYSTEM)
    torch.testing.assert_close(on.prefill_logits(on.prompts.chat(ORDER, QUESTION, SYSTEM)),
                               on.prefill_logits(cached_order, mode="full"), atol=1e-5, rtol=0)
    # a retrieved set with a chunk the path lacks: the cached part leads, the new chunk follows
    r = on.generate([CHUNKS[3][:40], CHUNKS[1], CHUNKS[0]], QUESTION, SYSTEM, max_new_tokens=1)
    assert r.chunk_order == [2, 1, 0] and r.approximations == ["reordered"] and r.chunks_missed == 1
    assert on.generate(ORDER, QUESTION, SYSTEM, max_new_tokens=1, mode="full").chunk_order is None


@pytest.mark.parametrize("level", ["exact", "faithful", "guarded", "balanced", "fast"])
def test_fidelity_levels_set_mode_policy_and_order(level):
    cfg = EngineConfig(fidelity=level, cache={"alpha": 2.0})
    preset = FIDELITY_PRESETS[level]
    assert cfg.mode == preset["mode"] and cfg.order_aware == preset["order_aware"]
    assert cfg.early_termination is preset["early_termination"] is False  # it costs fidelity (docs/fidelity.md)
    assert cfg.cache.alpha == 2.0  # fields the preset does not own are kept
    for name, value in preset["cache"].items():
        if isinstance(value, dict):  # a settings group: the fields the preset names
            assert {f: getattr(getattr(cfg.cache, name), f) for f in value} == value
        else:
            assert getattr(cfg.cache, name) == value


def test_guarded_is_balanced_with_the_gap_tie_guard(runner):
    """'guarded': the balanced policy, plus the tie guard at 0.25 nats."""
    guarded, balanced = EngineConfig(fidelity="guarded"), EngineConfig(fidelity="balanced")
    assert guarded.cache.exact.tie_guard == 0.25
    assert guarded.cache.replace(exact={"tie_guard": 0.0}) == balanced.cache
    assert guarded.mode == balanced.mode and guarded.order_aware == balanced.order_aware
    engines = {}
    for level in ("balanced", "guarded"):
        engines[level] = CachedEngine(runner, config=EngineConfig(fidelity=level, cache={"exact": {"repeats": 0}}))
        engines[level].generate(CHUNKS[:3], "warm", SYSTEM, max_new_tokens=1)
    segs = engines["balanced"].prompts.chat(ORDER, QUESTION, SYSTEM)
    gap = top2_gap(engines["balanced"].prefill_logits(segs))  # the approximate prefill's first-token gap
    r = engines["guarded"].generate(ORDER, QUESTION, SYSTEM, max_new_tokens=4)
    assert (r.tie_guard is not None) == (gap < 0.25), gap
    if r.tie_guard is not None:  # a near tie (0.024 nats on this tiny model): prefilled again, exactly
        full = engines["guarded"].generate(ORDER, QUESTION, SYSTEM, max_new_tokens=4, mode="full")
        assert r.tie_guard == pytest.approx(gap, abs=1e-5) and r.approximations == [] and r.token_ids == full.token_ids
    else:
        assert "chunk_reuse" in r.approximations


def test_faithful_is_guarded_with_the_guard_during_decoding():
    """'faithful': the guarded level, plus the tie guard during decoding at every token (round 22) and the
    missed chunks before the first reused one on the bfloat16 copies (round 26: only the first token reads them)."""
    faithful, guarded = EngineConfig(fidelity="faithful"), EngineConfig(fidelity="guarded")
    assert faithful.cache.exact.tie_guard_decode == math.inf and guarded.cache.exact.tie_guard_decode == 0.0
    assert faithful.cache.precision.leading_fresh == "bfloat16" and guarded.cache.precision.leading_fresh == "float32"
    assert faithful.cache.replace(exact={"tie_guard_decode": 0.0}, precision={"leading_fresh": "float32"}) == guarded.cache
    assert faithful.mode == guarded.mode and faithful.order_aware == guarded.order_aware


def test_default_settings_are_the_balanced_level():
    """The default engine is what the measured frontier picks (docs/fidelity.md): the 'balanced' level."""
    default, balanced = EngineConfig(), EngineConfig(fidelity="balanced")
    assert default.fidelity is None and balanced.fidelity == "balanced"
    assert default.model_dump(exclude={"fidelity"}) == balanced.model_dump(exclude={"fidelity"})
    assert default.cache.token_choice == "question+inter" and default.cache.recompute_ratio == 0.27
    assert default.early_termination is False and default.mode == "cachedrag" and default.order_aware is False


def test_default_engine_reports_its_approximations(runner):
    engine = CachedEngine(runner)
    engine.generate(CHUNKS[:3], "warm", SYSTEM, max_new_tokens=1)
    r = engine.generate(ORDER, QUESTION, SYSTEM, max_new_tokens=1)
    assert r.chunks_hit == 3 and r.token_choice == "question+inter"
    assert r.approximations == ["chunk_reuse", "partial_recompute:question+inter", "recompute_bfloat16"]
    assert r.focus_layer is None and r.checked_tokens == 0  # no early termination, no probe of reused tokens
    sizes = [len(s.ids) for s in engine.prompts.chat(ORDER, QUESTION, SYSTEM)[1:4]]
    assert [len(c) for c in r.chunk_recompute] == [math.ceil(0.27 * n) for n in sizes]  # 27% of each reused chunk


def test_unknown_fidelity_level_is_refused():
    with pytest.raises(ValueError, match="fidelity"):
        EngineConfig(fidelity="perfect")


def test_exact_fidelity_answers_equal_full_prefill(runner):
    engine = CachedEngine(runner, config=EngineConfig(fidelity="exact"))
    engine.generate(CHUNKS[:3], "warm", SYSTEM, max_new_tokens=1)
    r = engine.generate(ORDER, QUESTION, SYSTEM, max_new_tokens=6)
    assert r.approximations == [] and r.token_ids == engine.generate(ORDER, QUESTION, SYSTEM, max_new_tokens=6,
                                                                      mode="full").token_ids


def full_logits_width(engine, segs) -> int:
    return engine.prefill_logits(segs, mode="full").shape[-1]


def test_score_equals_teacher_forced_generation(runner):
    engine = _engine(runner)
    segs = engine.prompts.chat(CHUNKS[:2], QUESTION, SYSTEM)
    full = engine.generate_segments(segs, SamplingParams(max_new_tokens=5), mode="full", teacher=None)
    tf = engine.generate_segments(segs, SamplingParams(max_new_tokens=5), mode="full", teacher=full.token_ids)
    torch.testing.assert_close(engine.score(segs, full.token_ids, mode="full"), tf.teacher_logits, atol=1e-5, rtol=0)
    with pytest.raises(ConfigError):
        engine.score(segs, [])


def test_question_inter_fuses_the_question_ranking_with_token_inter(runner):
    picks = {}
    for name, cache in {"question": {"token_choice": "question"}, "inter": {"token_choice": "inter"},
                        "w1": {"token_choice": "question+inter", "question_weight": 1.0},
                        "w0": {"token_choice": "question+inter", "question_weight": 0.0},
                        "half": {"token_choice": "question+inter"}}.items():
        engine = _engine(runner, cache={"recompute_ratio": 0.2, **cache})
        engine.generate([CHUNKS[1], CHUNKS[0], CHUNKS[2]], "warm", SYSTEM, max_new_tokens=1)  # behind others
        r = engine.generate(ORDER, QUESTION, SYSTEM, max_new_tokens=1)
        assert r.chunks_hit == 3
        picks[name] = r.chunk_recompute
    assert picks["w1"] == picks["question"] and picks["w0"] == picks["inter"]
    assert picks["question"] != picks["inter"]  # the two rankings differ on this request
    assert [len(c) for c in picks["half"]] == [len(c) for c in picks["inter"]]
    assert r.token_choice == "question+inter" and r.checked_tokens == 0  # free: no probe of reused tokens


@pytest.mark.parametrize("count, expected", [
    (2, [3, 1]),  # top scores
    (9, [3, 1, 2, 0]),  # count capped by the length
])
def test_pick_top_scores(count, expected):
    from cachedrag.engine.selection import _pick

    assert _pick(torch.tensor([0.0, 5.0, 1.0, 9.0]), count) == expected


def test_pick_each_equals_pick_per_chunk():
    from cachedrag.engine.selection import _pick, _pick_each

    gen = torch.Generator().manual_seed(0)
    scores = [torch.randint(0, 5, (n,), generator=gen).float() for n in (7, 1, 12, 30)]  # ties on purpose
    counts = [3, 1, 12, 0]
    assert _pick_each(scores, counts) == [_pick(x, c) for x, c in zip(scores, counts)]
    assert _pick_each([], []) == []


def test_segment_ranks_equal_the_per_segment_ranks_ties_included():
    from cachedrag.engine.selection import _rank01, _rank01_segments

    gen = torch.Generator().manual_seed(1)
    lengths = [5, 1, 17, 2, 40]
    x = torch.randint(0, 4, (sum(lengths),), generator=gen).float()  # many ties: the position order decides
    want = torch.cat([_rank01(part) for part in x.split(lengths)])
    assert torch.equal(_rank01_segments(x, lengths), want)


def test_device_tensor_is_torch_tensor_on_the_cpu():
    from cachedrag.model.transfer import device_tensor

    got = device_tensor([3, 1, 2], "cpu")
    assert got.dtype == torch.long and got.tolist() == [3, 1, 2]
    assert device_tensor([0.5, 2.0], "cpu", torch.float32).tolist() == [0.5, 2.0]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_device_tensor_on_cuda_queues_without_waiting():
    from cachedrag.model.transfer import device_tensor

    torch.cuda.set_sync_debug_mode("error")  # a synchronising copy raises
    try:
        got = device_tensor(list(range(5000)), "cuda")
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert got.device.type == "cuda" and got.sum().item() == sum(range(5000))
