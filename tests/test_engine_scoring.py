"""The question pre-pass on bfloat16 copies of the weights (``CacheConfig.precision.question``,
``model/scoring.py``) against its reference, the runner's own float32 projections: the scores
agree to bfloat16 rounding and the choices nearly so (near ties may swap), and given the same
choice the prefill (logits, buffer) equals the reference bit for bit, since it overwrites every
row the pre-pass wrote. Requests whose fresh chunks lead every reused one keep float32 (their
rows are shared with the prefill, ``engine._Lead``)."""

from __future__ import annotations

import pytest
import torch

from cachedrag.config import EngineConfig
from cachedrag.engine import CachedEngine
from cachedrag.errors import ConfigError
from cachedrag.kvcache.config import CacheConfig, RowPrecision
from cachedrag.model.scoring import ScoringLayer, scoring_layers
from cachedrag.testing import tiny_runner

CHUNKS = [f"Chunk {i}: the quick brown fox jumps over the lazy dog; {i} pack my box." for i in range(5)]
SYSTEM = "sys"


@pytest.fixture
def runner():
    return tiny_runner("llama", seed=5)


def _engine(runner, dtype: str, precision: dict | None = None, **cache):
    """``dtype``: the question pre-pass's; ``precision``: the other row groups' (float32 unless named)."""
    rows = {"question": dtype, "recompute": "float32", "fresh": "float32", **(precision or {})}
    cache = {"recompute_ratio": 0.27, "token_choice": "question+inter", **cache}
    return CachedEngine(runner, config=EngineConfig(cache=CacheConfig(precision=RowPrecision(**rows), **cache)))


def _prefill(engine, order, question="which chunk?", scores_from=None):
    """Prefill ``order`` after a warm-up; returns (prefill, pre-pass scores, weights per layer call).
    ``scores_from``: run the pre-pass as usual but hand the choice these scores instead (pins the choice)."""
    engine.generate([CHUNKS[i] for i in (2, 1, 0)], "warm up", SYSTEM, max_new_tokens=1)  # chunks 0-2 cached
    scores, weights = [], []
    original_scores = engine._question_scores
    original_layer = engine.runner.forward_layer

    def spy_scores(*a, **k):
        s = original_scores(*a, **k)
        scores.append(s.clone())
        return s if scores_from is None else scores_from[len(scores) - 1].clone()

    def spy_layer(*a, **k):
        weights.append(k.get("weights"))
        return original_layer(*a, **k)

    engine._question_scores = spy_scores
    engine.runner.forward_layer = spy_layer
    try:
        pre = engine.prefill(engine.prompts.chat([CHUNKS[i] for i in order], question, SYSTEM), 2)
    finally:
        engine.runner.forward_layer = original_layer
    return pre, scores, weights


def test_scoring_layer_matches_the_float32_projections_to_bf16_rounding(runner):
    layer = ScoringLayer(runner.layers[0])
    lw = runner.fast_layers[0]
    x = torch.randn(7, runner.model.config.hidden_size)  # [T, Dm]
    for name in ("qkv", "o", "mlp"):
        xin = x if name != "o" else torch.randn(7, lw.o.in_features)
        want = getattr(lw, name)(xin)
        got = getattr(layer, name)(xin)
        assert got.dtype == want.dtype == torch.float32 and got.shape == want.shape
        torch.testing.assert_close(got, want, atol=0.05 * float(want.abs().max()), rtol=0.02)
        assert not torch.equal(got, want)  # really computed in bfloat16


def test_scoring_layers_are_built_once_and_only_where_they_help(runner):
    first = scoring_layers(runner, 1)
    assert first is not None and len(first) == 1
    both = scoring_layers(runner, 5)  # capped at the model's layers, extending the same list
    assert len(both) == runner.n_layers and both[0] is first[0]
    assert scoring_layers(tiny_runner("llama", seed=5, fast=False), 1) is None  # reference runner: own precision
    assert scoring_layers(tiny_runner("llama", seed=5, dtype="bfloat16"), 1) is None  # already bfloat16


@pytest.mark.parametrize("order", [[0, 2, 1], [1, 0, 2, 3]])  # every chunk reused / a fresh chunk after reused ones
def test_bf16_pre_pass_scores_like_the_reference_and_leaves_no_trace_in_the_prefill(runner, order):
    got, got_scores, got_weights = _prefill(_engine(runner, "bfloat16"), order)
    want, want_scores, want_weights = _prefill(_engine(runner, "float32"), order)
    assert len(got_scores) == len(want_scores) == 1
    assert any(isinstance(w, ScoringLayer) for w in got_weights)  # the pre-pass ran on the bf16 copies
    assert all(w is None for w in want_weights)
    s, r = got_scores[0], want_scores[0]
    torch.testing.assert_close(s, r, atol=0.05 * float(r.max()), rtol=0.05)
    assert not torch.equal(s, r)
    chosen = [set(c) for c in got.info["chunk_recompute"]]
    ref = [set(c) for c in want.info["chunk_recompute"]]
    assert sum(len(a & b) for a, b in zip(chosen, ref)) >= 0.8 * sum(len(b) for b in ref)  # near ties may swap
    # the same choice (the bf16 scores handed to the reference pass): every row the bf16 pass wrote
    # was written again by the prefill, so logits and buffer equal the bf16 run's bit for bit
    pinned, _, _ = _prefill(_engine(runner, "float32"), order, scores_from=got_scores)
    assert pinned.info["chunk_recompute"] == got.info["chunk_recompute"]
    assert torch.equal(pinned.logits, got.logits)
    n = got.info["prompt_tokens"]
    assert torch.equal(pinned.kv.k[:, :, :n], got.kv.k[:, :, :n])
    assert torch.equal(pinned.kv.v[:, :, :n], got.kv.v[:, :, :n])


@pytest.mark.parametrize("share", [True, False])
def test_leading_fresh_rows_keep_the_runner_precision(runner, share):
    """A fresh chunk before every reused one: its rows are the prefill's own (shared, ``_Lead``), so
    the pass stays float32 whether or not they are shared, and equals the float32 setting exactly."""
    engines = [_engine(runner, "bfloat16"), _engine(runner, "float32")]
    for engine in engines:
        engine.share_lead_rows = share
    (got, got_scores, got_weights), (want, want_scores, _) = (_prefill(e, [3, 0, 2, 1]) for e in engines)
    assert all(w is None for w in got_weights)
    assert torch.equal(got_scores[0], want_scores[0]) and torch.equal(got.logits, want.logits)


def test_question_dtype_is_validated():
    with pytest.raises(ConfigError, match="precision.question"):
        CacheConfig(precision=RowPrecision(question="float16"))


def test_engine_builds_the_bf16_copies_at_construction_not_on_the_first_reuse():
    """The copies cost ~130 ms on the default model: an engine that will run the question pre-pass
    builds them when it is made, so the first reuse-served request does not pay them; one that
    will not (another default mode, or the float32 reference pass) leaves the memory alone."""
    from cachedrag.model import scoring

    def built(r):
        return len(scoring._BUILT.get(r, []))

    prefix = tiny_runner("llama", seed=6)
    CachedEngine(prefix, config=EngineConfig(mode="prefix"))
    assert built(prefix) == 0
    reference = tiny_runner("llama", seed=6)
    _engine(reference, "float32")
    assert built(reference) == 0
    fast = tiny_runner("llama", seed=6)
    engine = _engine(fast, "bfloat16")
    assert built(fast) == max(engine._question_layers()) + 1


# --- the recomputed rows of reused chunks on the bfloat16 copies (CacheConfig.precision.recompute) ---


def test_row_split_layer_computes_each_row_on_its_own_weights(runner):
    """``RowSplitLayer``: the masked rows are the bf16 copy's matmul over those rows, the others the
    runner's float32 one over theirs, bit for bit; an all-true / all-false mask is one weight set."""
    from cachedrag.model.scoring import RowSplitLayer

    low_w, w = ScoringLayer(runner.layers[0]), runner.fast_layers[0]
    low = torch.tensor([True, False, True, True, False, False, True])  # [T]
    x = torch.randn(7, runner.model.config.hidden_size)  # [T, Dm]
    xo = torch.randn(7, w.o.in_features)  # [T, H_q*D]
    split = RowSplitLayer(w, low_w, low)
    for name, xin in (("qkv", x), ("o", xo), ("mlp", x)):
        got = getattr(split, name)(xin)
        assert torch.equal(got[low], getattr(low_w, name)(xin[low]))
        assert torch.equal(got[~low], getattr(w, name)(xin[~low]))
    assert torch.equal(RowSplitLayer(w, low_w, torch.ones(7, dtype=torch.bool)).qkv(x), low_w.qkv(x))
    assert torch.equal(RowSplitLayer(w, low_w, torch.zeros(7, dtype=torch.bool)).qkv(x), w.qkv(x))
    last = RowSplitLayer(w, low_w, low, low[-1:])  # the last layer: qkv over every row, o / mlp over the last
    assert torch.equal(last.mlp(x[-1:]), low_w.mlp(x[-1:])) and torch.equal(last.qkv(x)[~low], w.qkv(x[~low]))


@pytest.mark.parametrize("order", [[0, 2, 1], [1, 0, 2, 3]])  # every chunk reused / a fresh chunk after reused ones
def test_bf16_recompute_runs_exactly_the_reused_rows_on_the_copies(runner, order):
    """With ``precision.recompute="bfloat16"`` every prefill layer splits its rows: the reused chunks'
    recomputed rows (all of them, nothing else) on the bf16 copies, question and fresh rows on the
    float32 weights. Same choice as the float32 setting (the pre-pass runs before), logits close
    to it but not equal (the path really ran), and the response names the approximation."""
    from cachedrag.model.scoring import RowSplitLayer

    got, _, got_weights = _prefill(_engine(runner, "bfloat16", precision={"recompute": "bfloat16"}), order)
    want, _, want_weights = _prefill(_engine(runner, "bfloat16"), order)
    assert got.info["chunk_recompute"] == want.info["chunk_recompute"]
    prefill_layers = [w for w in got_weights if isinstance(w, RowSplitLayer)]
    assert len(prefill_layers) == runner.n_layers
    n_recomputed = sum(len(c) for c in got.info["chunk_recompute"] if c)
    assert n_recomputed > 0
    for w in prefill_layers:
        assert int(w._low.sum()) == n_recomputed  # the reused chunks' rows, every layer
        assert not bool(w._low[-1])  # the question's last row (the logits' row) stays float32
    assert not any(isinstance(w, RowSplitLayer) for w in want_weights)
    assert "recompute_bfloat16" in got.info["approximations"]
    assert "recompute_bfloat16" not in want.info["approximations"]
    g, r = got.logits, want.logits
    assert not torch.equal(g, r)
    assert (g - r).abs().max() < 0.05 * float(r.max() - r.min())


def _setting_changes_nothing(runner, field: str, approximation: str, prefill) -> None:
    """``prefill(engine)`` with the ``RowPrecision`` ``field`` at bfloat16 and at float32: neither names
    ``approximation``, and the logits are equal bit for bit."""
    logits = {}
    for dt in ("bfloat16", "float32"):
        pre = prefill(_engine(runner, "bfloat16", precision={field: dt}))
        assert approximation not in pre.info["approximations"]
        logits[dt] = pre.logits
    assert torch.equal(logits["bfloat16"], logits["float32"])


def test_bf16_recompute_leaves_a_request_without_reuse_unchanged(runner):
    """A cold request (every chunk fresh) has no reused rows: the setting changes nothing."""
    prompts = [CHUNKS[i] for i in (2, 1, 0)]
    _setting_changes_nothing(runner, "recompute", "recompute_bfloat16",
                             lambda engine: engine.prefill(engine.prompts.chat(prompts, "which chunk?", SYSTEM), 2))


def test_recompute_dtype_is_validated_and_builds_every_layer_at_construction():
    from cachedrag.model import scoring

    with pytest.raises(ConfigError, match="precision.recompute"):
        CacheConfig(precision=RowPrecision(recompute="float16"))
    r = tiny_runner("llama", seed=6)
    _engine(r, "bfloat16", precision={"recompute": "bfloat16"})
    assert len(scoring._BUILT.get(r, [])) == r.n_layers


# --- the fresh rows after a reused chunk on the bfloat16 copies (CacheConfig.precision.fresh) ---


@pytest.mark.parametrize("recompute_dtype", ["float32", "bfloat16"])
def test_bf16_fresh_rows_are_exactly_the_fresh_rows_after_the_first_reused_chunk(runner, recompute_dtype):
    """``precision.fresh="bfloat16"``: order [1, 0, 3, 2, 4] has chunk 3 and 4 fresh behind reused chunk 1
    (chunk 3's rows and chunk 4's go to the copies; with ``precision.recompute="bfloat16"`` the recomputed
    rows too), the question's rows stay float32; the logits move but stay close, the response names
    ``fresh_bfloat16``, and the choice of recomputed tokens is the float32 setting's."""
    from cachedrag.model.scoring import RowSplitLayer

    order = [1, 0, 3, 2, 4]
    got, _, got_weights = _prefill(_engine(runner, "bfloat16", precision={"recompute": recompute_dtype,
                                                                          "fresh": "bfloat16"}), order)
    want, _, want_weights = _prefill(_engine(runner, "bfloat16", precision={"recompute": recompute_dtype}), order)
    assert got.info["chunk_recompute"] == want.info["chunk_recompute"]
    assert got.info["chunks_missed"] == 2 and got.info["fresh_tokens"] > 0
    n_recomputed = sum(len(c) for c in got.info["chunk_recompute"] if c)
    expect = got.info["fresh_tokens"] + (n_recomputed if recompute_dtype == "bfloat16" else 0)
    prefill_layers = [w for w in got_weights if isinstance(w, RowSplitLayer)]
    assert len(prefill_layers) == runner.n_layers
    for w in prefill_layers:
        assert int(w._low.sum()) == expect
        assert not bool(w._low[-1])  # the logits' row stays float32
    assert "fresh_bfloat16" in got.info["approximations"]
    assert "fresh_bfloat16" not in want.info["approximations"]
    assert ("recompute_bfloat16" in got.info["approximations"]) == (recompute_dtype == "bfloat16")
    g, r = got.logits, want.logits
    assert not torch.equal(g, r)
    assert (g - r).abs().max() < 0.05 * float(r.max() - r.min())


def test_bf16_fresh_rows_leave_leading_fresh_chunks_and_cold_requests_exact(runner):
    """Fresh chunks before every reused one see only exact rows: they keep float32 (order [3, 0, 1]:
    chunk 3 leads, 0 and 1 reused), as does a cold request; with ``precision.recompute="float32"`` the
    setting then changes nothing, bit for bit."""
    for order in ([3, 0, 1], [4, 3]):
        _setting_changes_nothing(runner, "fresh", "fresh_bfloat16", lambda engine: _prefill(engine, order)[0])


def test_fresh_dtype_is_validated():
    with pytest.raises(ConfigError, match="precision.fresh"):
        CacheConfig(precision=RowPrecision(fresh="float16"))


# --- the fresh chunks before the first reused one on the bfloat16 copies (CacheConfig.precision.leading_fresh) ---


def _tree_keys(engine, segs) -> int:
    """How many leading segments of ``segs`` (the question left out) are a tree path."""
    return len(engine.manager.tree.match_prefix([s.key for s in segs[:-1]]))


@pytest.mark.parametrize("share", [True, False])
def test_bf16_leading_fresh_rows_run_on_the_copies_and_stay_out_of_the_tree(runner, share):
    """``precision.leading_fresh="bfloat16"``: order [3, 0, 1] has chunk 3 fresh before reused chunks 0 and 1.
    Its rows go to the copies in both passes (the pre-pass's every layer, the prefill's rows split: exactly
    the fresh rows), shared with the prefill or not; the logits move but stay close; the response names
    ``fresh_bfloat16``; and chunk 3 is stored as a variant, not as a tree node (its KV is approximate now),
    where the float32 setting makes it the tree path's next node."""
    from cachedrag.model.scoring import RowSplitLayer, ScoringLayer

    order = [3, 0, 1]
    engines = {dt: _engine(runner, "bfloat16", precision={"leading_fresh": dt}) for dt in ("bfloat16", "float32")}
    for engine in engines.values():
        engine.share_lead_rows = share
    (got, _, got_weights), (want, _, want_weights) = (_prefill(engines[dt], order) for dt in ("bfloat16", "float32"))
    assert got.info["segment_actions"] == want.info["segment_actions"] == ["tree", "fresh", "reuse", "reuse"]
    pre_pass = [w for w in got_weights if isinstance(w, ScoringLayer)]
    assert len(pre_pass) == max(engines["bfloat16"]._question_layers()) > 0  # the pass's layers before its last
    assert not any(isinstance(w, ScoringLayer) for w in want_weights)  # float32: the pass keeps the runner's
    prefill_layers = [w for w in got_weights if isinstance(w, RowSplitLayer)]
    assert prefill_layers and not any(isinstance(w, RowSplitLayer) for w in want_weights)
    for w in prefill_layers:
        assert int(w._low.sum()) == got.info["fresh_tokens"] > 0  # the leading chunk's rows that this layer runs
        assert not bool(w._low[-1])  # the logits' row stays float32
    assert "fresh_bfloat16" in got.info["approximations"]
    assert "fresh_bfloat16" not in want.info["approximations"]
    g, r = got.logits, want.logits
    assert not torch.equal(g, r)
    assert (g - r).abs().max() < 0.05 * float(r.max() - r.min())
    segs = engines["float32"].prompts.chat([CHUNKS[i] for i in order], "which chunk?", SYSTEM)
    assert _tree_keys(engines["float32"], segs) == 2  # system, chunk 3: exact, a tree path
    assert _tree_keys(engines["bfloat16"], segs) == 1  # the system prompt only
    handle = engines["bfloat16"].manager.index.variants(segs[1].key)
    assert handle and all(v.handle not in engines["bfloat16"].manager._exact for v in handle)


def test_bf16_leading_fresh_rows_leave_cold_requests_and_fresh_system_prompts_exact(runner):
    """No reused chunk (order [4, 3]: the warm-up caches chunks 0-2 only): nothing is approximate, so the
    setting changes nothing, bit for bit; nor where the system prompt is fresh too (a non-chunk segment
    leads: the leading rows keep the runner's precision)."""
    _setting_changes_nothing(runner, "leading_fresh", "fresh_bfloat16",
                             lambda engine: _prefill(engine, [4, 3])[0])

    def fresh_system(engine):
        engine.generate([CHUNKS[i] for i in (2, 1, 0)], "warm up", SYSTEM, max_new_tokens=1)
        pre = engine.prefill(engine.prompts.chat([CHUNKS[i] for i in (3, 0, 1)], "which chunk?", "another system"), 2)
        assert pre.info["segment_actions"][:3] == ["fresh", "fresh", "reuse"]
        return pre
    _setting_changes_nothing(runner, "leading_fresh", "fresh_bfloat16", fresh_system)


def test_tie_guard_exact_prefill_recomputes_bf16_leading_rows(runner):
    """The tie guard's exact prefill takes float32 leading chunks from the tree (stored just before it, round
    21); bfloat16 ones are not exact, so it computes them again: its logits equal an exact prefill's to float32
    rounding, and the tree path it stores holds chunk 3 as an exact node."""
    order = [3, 0, 1]
    engine = _engine(runner, "bfloat16", exact={"tie_guard": 1e6},  # every first token guarded
                     precision={"leading_fresh": "bfloat16"})
    pre, _, _ = _prefill(engine, order)
    assert pre.info["tie_guard"] is not None and pre.info["approximations"] == []
    assert pre.info["tie_guard_actions"] == ["tree", "fresh", "reuse", "reuse"]
    reference = _engine(runner, "bfloat16")
    segs = reference.prompts.chat([CHUNKS[i] for i in order], "which chunk?", SYSTEM)
    exact = reference.prefill(segs, 2, mode="full")
    torch.testing.assert_close(pre.logits, exact.logits, atol=1e-4, rtol=0)
    assert _tree_keys(engine, segs) == len(segs) - 1  # the exact prefill stored the whole path
    handle = engine.manager.tree.match_prefix([s.key for s in segs[:2]])[-1].handle
    assert handle in engine.manager._exact


def test_leading_fresh_dtype_is_validated():
    with pytest.raises(ConfigError, match="precision.leading_fresh"):
        CacheConfig(precision=RowPrecision(leading_fresh="float16"))
