"""The tie guard (``CacheConfig.exact.tie_guard``): an approximate prefill whose first token is a near
tie is prefilled again exactly, so the approximation never picks between near-tied first tokens.

The guard's threshold is planted around the approximate prefill's own top-2 gap (measured with
the guard off on an identical engine): just above it the request is re-prefilled exactly and
equals full prefill token for token; just below it the approximate answer stands.
"""

from __future__ import annotations

import pytest
import torch

from cachedrag.config import EngineConfig
from cachedrag.engine import CachedEngine, top2, top2_gap
from cachedrag.errors import ConfigError
from cachedrag.kvcache.config import CacheConfig
from cachedrag.kvcache.tie import rounding_unit
from cachedrag.model.runner import ModelRunner
from tests.test_engine import SYSTEM
from tests.test_engine_repeats import SEQ, _warm, runner  # noqa: F401 (the four-layer tiny model fixture)

QUESTION = "which module memoizes?"


def _engine(runner, tie_guard: float, mode: str = "cachedrag") -> CachedEngine:
    cache = CacheConfig(recompute_ratio=0.3, exact={"repeats": 0, "tie_guard": tie_guard})
    engine = CachedEngine(runner, config=EngineConfig(mode=mode, cache=cache))
    _warm(engine)  # every chunk of SEQ cached as a variant, no tree path in SEQ's order
    return engine


def _approximate_gap(runner) -> tuple[float, list[int]]:
    """The first-token top-2 gap of SEQ's approximate prefill, and its answer (guard off)."""
    engine = _engine(runner, 0.0)
    segs = engine.prompts.chat(SEQ, QUESTION, SYSTEM)
    logits = engine.prefill_logits(segs)  # [V]
    again = _engine(runner, 0.0).generate(SEQ, QUESTION, SYSTEM, max_new_tokens=6)
    assert "chunk_reuse" in again.approximations and again.tie_guard is None
    assert again.first_token_gap == pytest.approx(top2_gap(logits), abs=1e-5)  # reported with the guard off too
    return top2_gap(logits), again.token_ids


def test_top2_gap():
    assert top2_gap(torch.tensor([0.5, 3.0, 2.25, -1.0])) == pytest.approx(0.75)
    assert top2_gap(torch.tensor([1.0, 1.0, 0.0])) == 0.0


def test_a_near_tie_above_the_gap_is_prefilled_exactly(runner):
    gap, _ = _approximate_gap(runner)
    engine = _engine(runner, gap * 1.01 + 1e-6)
    r = engine.generate(SEQ, QUESTION, SYSTEM, max_new_tokens=6)
    assert r.tie_guard == pytest.approx(gap, abs=1e-5) and r.first_token_gap == r.tie_guard
    assert r.approximations == [] and r.exact_repeat is None
    full = engine.generate(SEQ, QUESTION, SYSTEM, max_new_tokens=6, mode="full")
    assert r.token_ids == full.token_ids
    # the exact prefill stored its tree path: the next sighting is an exact prefix hit, no guard needed
    again = engine.generate(SEQ, "what wraps text?", SYSTEM, max_new_tokens=4)
    assert again.approximations == [] and again.tie_guard is None and again.first_token_gap is None
    assert again.prefix_hit_tokens == again.prompt_tokens - again.question_tokens
    assert engine.manager.check() == []


def test_below_the_gap_the_approximate_answer_stands(runner):
    gap, approximate = _approximate_gap(runner)
    assert gap > 0
    r = _engine(runner, gap * 0.99).generate(SEQ, QUESTION, SYSTEM, max_new_tokens=6)
    assert r.tie_guard is None and "chunk_reuse" in r.approximations
    assert r.tie_guard_actions is None and r.segment_actions == ["tree", "reuse", "reuse", "reuse"]
    assert r.token_ids == approximate


def test_prefill_logits_and_the_server_prefill_are_guarded_too(runner):
    gap, _ = _approximate_gap(runner)
    engine = _engine(runner, gap + 1.0)
    segs = engine.prompts.chat(SEQ, QUESTION, SYSTEM)
    pre = engine.prefill(segs, 4, defer_store=True)
    assert pre.info["tie_guard"] == pytest.approx(gap, abs=1e-5) and pre.info["approximations"] == []
    pre.hand_off()  # both prefills' store work, after the first token as a server runs it
    exact = _engine(runner, 0.0, mode="full").prefill_logits(segs)
    torch.testing.assert_close(pre.logits, exact, atol=1e-5, rtol=0)
    assert engine.manager.check() == []


def test_exact_requests_and_ablation_modes_are_not_guarded(runner):
    engine = _engine(runner, 1e9)  # every approximate cachedrag prefill would be re-prefilled
    naive = engine.generate(SEQ, QUESTION, SYSTEM, max_new_tokens=2, mode="naive")
    assert naive.tie_guard is None and "chunk_reuse" in naive.approximations
    fresh = engine.generate(["a passage nobody cached before."], QUESTION, SYSTEM, max_new_tokens=2)
    assert fresh.tie_guard is None and fresh.approximations == [] and fresh.first_token_gap is None
    assert naive.first_token_gap is not None  # the ablation's approximate first token is reported, not guarded


MISSED = "zipfile reads ZIP files."  # no request has cached it


def test_the_exact_prefill_takes_the_first_prefills_leading_fresh_chunk_from_the_tree(runner):
    """A missed chunk before every reused one is computed exactly by the approximate prefill; when
    the guard fires it is stored first, so the exact prefill finds it on the tree and computes only
    from the first reused chunk on, and the logits are full prefill's."""
    engine = _engine(runner, 1e9)  # every approximate prefill is prefilled again
    chunks = [MISSED, *SEQ[:2]]  # the byte tokenizer: within the tiny model's 512 positions
    segs = engine.prompts.chat(chunks, QUESTION, SYSTEM)
    second_chunk = [i for i, s in enumerate(segs) if s.kind == "chunk"][1]
    lead = sum(len(s) for s in segs[:second_chunk])  # system, the missed chunk and what precedes SEQ
    pre = engine.prefill(segs, 4, defer_store=True)
    assert pre.info["tie_guard"] is not None and pre.info["approximations"] == []
    assert pre.info["prefix_hit_tokens"] == lead  # the missed chunk came from the tree, not computed again
    assert pre.info["computed_tokens"] == pre.info["prompt_tokens"] - lead
    # system, then the three chunks: what each prefill did with them
    assert pre.info["tie_guard_actions"] == ["tree", "fresh", "reuse", "reuse"]
    assert pre.info["segment_actions"] == ["tree", "tree", "fresh", "fresh"]
    pre.hand_off()
    exact = _engine(runner, 0.0, mode="full").prefill_logits(segs)
    torch.testing.assert_close(pre.logits, exact, atol=1e-5, rtol=0)
    assert engine.manager.check() == []
    # generation: the same answer as full prefill, and the whole order is now an exact tree path
    other = _engine(runner, 1e9)
    r = other.generate(chunks, QUESTION, SYSTEM, max_new_tokens=6)
    assert r.tie_guard is not None and r.prefix_hit_tokens == lead
    assert r.tie_guard_actions == ["tree", "fresh", "reuse", "reuse"] and r.segment_actions[:2] == ["tree", "tree"]
    assert r.token_ids == other.generate(chunks, QUESTION, SYSTEM, max_new_tokens=6, mode="full").token_ids
    again = other.generate(chunks, "what wraps text?", SYSTEM, max_new_tokens=2)
    assert again.approximations == [] and again.prefix_hit_tokens == again.prompt_tokens - again.question_tokens


def test_a_failing_store_before_the_exact_prefill_costs_only_the_reuse(runner, monkeypatch, caplog):
    """The early store fails: the exact prefill computes the missed chunk itself, logits unchanged."""
    engine = _engine(runner, 1e9)
    chunks = [MISSED, *SEQ[:2]]
    segs = engine.prompts.chat(chunks, QUESTION, SYSTEM)

    def broken(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(engine.manager, "admit", broken)
    pre = engine.prefill(segs, 4, defer_store=True)
    assert pre.info["approximations"] == [] and pre.info["prefix_hit_tokens"] == len(segs[0])  # the system only
    assert "store hand-off before the tie guard's exact prefill failed" in caplog.text
    assert pre.info["segment_actions"] == ["tree", "fresh", "fresh", "fresh"]
    exact = _engine(runner, 0.0, mode="full").prefill_logits(segs)
    torch.testing.assert_close(pre.logits, exact, atol=1e-5, rtol=0)


@pytest.mark.parametrize("bad", [-0.1, float("nan"), float("inf"), "0.3x"])
def test_tie_guard_is_validated(bad):
    with pytest.raises(ConfigError, match="tie_guard"):
        CacheConfig(exact={"tie_guard": bad})


def test_a_near_tie_allows_for_the_rounding_of_bfloat16_logits(runner):
    """bfloat16 logits near 20 come in steps of 1/8 nat: a gap read as 0.25 may be two steps of a
    smaller one, so at a 0.2 threshold it is a near tie there, and not in float32."""
    logits = torch.full((8,), -5.0)
    logits[3], logits[6] = 20.0, 19.75  # [V]: a gap of 0.25 at a top logit of 20
    low = ModelRunner(runner.model, runner.tokenizer, dtype="bfloat16")
    assert CachedEngine(low).near_tie(logits, 0.2) == (True, 0.25)
    assert CachedEngine(runner).near_tie(logits, 0.2) == (False, 0.25)
    assert CachedEngine(low).near_tie(logits, 0.1) == (False, 0.25)  # one unit of slack, not more


def test_the_guard_reads_bfloat16_gaps_with_their_rounding(runner):
    """End to end in bfloat16: a threshold half a rounding unit below the approximate first token's
    gap guards it (the gap may be a unit smaller than read); the answer is full prefill's."""
    low = ModelRunner(runner.model, runner.tokenizer, dtype="bfloat16")
    engine = _engine(low, 0.0)
    segs = engine.prompts.chat(SEQ, QUESTION, SYSTEM)
    top, gap = top2(engine.prefill_logits(segs))  # the approximate prefill's first token (guard off)
    threshold = gap - rounding_unit(top, 7) / 2
    assert threshold > 0
    r = _engine(low, threshold).generate(SEQ, QUESTION, SYSTEM, max_new_tokens=6)
    assert r.tie_guard == pytest.approx(gap) and r.approximations == []
    assert r.token_ids == _engine(low, 0.0).generate(SEQ, QUESTION, SYSTEM, max_new_tokens=6, mode="full").token_ids
