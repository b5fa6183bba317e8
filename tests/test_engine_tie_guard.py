"""The tie guard (``CacheConfig.tie_guard``): an approximate prefill whose first token is a near
tie is prefilled again exactly, so the approximation never picks between near-tied first tokens.

The guard's threshold is planted around the approximate prefill's own top-2 gap (measured with
the guard off on an identical engine): just above it the request is re-prefilled exactly and
equals full prefill token for token; just below it the approximate answer stands.
"""

from __future__ import annotations

import pytest
import torch

from cachedrag.config import EngineConfig
from cachedrag.engine import CachedEngine, top2_gap
from cachedrag.errors import ConfigError
from cachedrag.kvcache.config import CacheConfig
from tests.test_engine import SYSTEM
from tests.test_engine_repeats import SEQ, _warm, runner  # noqa: F401 (the four-layer tiny model fixture)

QUESTION = "which module memoizes?"


def _engine(runner, tie_guard: float, mode: str = "cachedrag") -> CachedEngine:
    cache = CacheConfig(recompute_ratio=0.3, exact_repeats=0, tie_guard=tie_guard)
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
    return top2_gap(logits), again.token_ids


def test_top2_gap():
    assert top2_gap(torch.tensor([0.5, 3.0, 2.25, -1.0])) == pytest.approx(0.75)
    assert top2_gap(torch.tensor([1.0, 1.0, 0.0])) == 0.0


def test_a_near_tie_above_the_gap_is_prefilled_exactly(runner):
    gap, _ = _approximate_gap(runner)
    engine = _engine(runner, gap * 1.01 + 1e-6)
    r = engine.generate(SEQ, QUESTION, SYSTEM, max_new_tokens=6)
    assert r.tie_guard == pytest.approx(gap, abs=1e-5)
    assert r.approximations == [] and r.exact_repeat is None
    full = engine.generate(SEQ, QUESTION, SYSTEM, max_new_tokens=6, mode="full")
    assert r.token_ids == full.token_ids
    # the exact prefill stored its tree path: the next sighting is an exact prefix hit, no guard needed
    again = engine.generate(SEQ, "what wraps text?", SYSTEM, max_new_tokens=4)
    assert again.approximations == [] and again.tie_guard is None
    assert again.prefix_hit_tokens == again.prompt_tokens - again.question_tokens
    assert engine.manager.check() == []


def test_below_the_gap_the_approximate_answer_stands(runner):
    gap, approximate = _approximate_gap(runner)
    assert gap > 0
    r = _engine(runner, gap * 0.99).generate(SEQ, QUESTION, SYSTEM, max_new_tokens=6)
    assert r.tie_guard is None and "chunk_reuse" in r.approximations
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
    assert fresh.tie_guard is None and fresh.approximations == []


@pytest.mark.parametrize("bad", [-0.1, float("nan"), float("inf"), "0.3x"])
def test_tie_guard_is_validated(bad):
    with pytest.raises(ConfigError, match="tie_guard"):
        CacheConfig(tie_guard=bad)
