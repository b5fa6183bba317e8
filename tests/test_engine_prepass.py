"""The question pre-pass leaves fresh chunks after a reused one out (``CacheConfig.question_pass_fresh``
"leading"): their rows are masked from the question's attention instead of computed twice. Beside
the reference ("all": the pass computes them too): the pass computes no such row, its scores equal
a reference pass over a buffer without those rows (attention is position-free once K is rotated),
unwritten rows never leak into it (NaN-filled buffer), and given the same scores the prefill
(logits, buffer, stored entries) equals the reference's, since only the ranking differs."""

from __future__ import annotations

import math

import pytest
import torch

from cachedrag.config import EngineConfig
from cachedrag.engine import CachedEngine
from cachedrag.errors import ConfigError
from cachedrag.kvcache.config import CacheConfig
from cachedrag.kvcache.keys import path_key
from cachedrag.testing import tiny_runner

CHUNKS = [f"Chunk {i}: the quick brown fox jumps over the lazy dog; {i} pack my box." for i in range(5)]
SYSTEM = "sys"
ORDERS = [[0, 3, 1, 4, 2], [3, 0, 1, 2, 4], [4, 3, 0, 1, 2]]  # fresh after reuse / both / leading only


def _engine(fresh: str, choice: str = "question+inter", fill=None):
    runner = tiny_runner("llama", seed=5)
    cache = CacheConfig(recompute_ratio=0.27, token_choice=choice, precision={"question": "float32"},
                        question_pass_fresh=fresh)
    engine = CachedEngine(runner, config=EngineConfig(cache=cache))
    engine.buffer_fill = fill
    engine.generate([CHUNKS[i] for i in (2, 1, 0)], "warm up", SYSTEM, max_new_tokens=1)  # chunks 0-2 cached
    return engine


def _prefill(engine, order, scores_from=None):
    """Prefill ``order``; returns (prefill, [(scores, pass positions, hidden, kv snapshot)], stored entries).
    ``scores_from``: hand the choice these scores instead (pins the choice)."""
    calls = []
    original = engine._question_scores
    runner = engine.runner
    original_layer = runner.forward_layer

    def spy(ids, kv, total, fresh_pos, question_pos, plan, deferred, load_layer, lead=None, hidden=()):
        for layer in range(runner.n_layers):
            load_layer(layer)  # idempotent: everything loaded before the snapshot
        snapshot = (kv.k[:, :, :total].clone(), kv.v[:, :, :total].clone())
        rows = []
        runner.forward_layer = lambda i, h, pos, *a, **k: rows.append(pos.tolist()) or original_layer(i, h, pos, *a, **k)
        try:
            s = original(ids, kv, total, fresh_pos, question_pos, plan, deferred, load_layer, lead=lead, hidden=hidden)
        finally:
            runner.forward_layer = original_layer
        calls.append(dict(scores=s.clone(), rows=rows, hidden=list(hidden), kv=snapshot, ids=ids, total=total,
                          pos=sorted(set(fresh_pos) | set(question_pos)), n_question=len(question_pos),
                          deferred=[(plan.segments[i].start, plan.segments[i].end) for i in deferred]))
        return s if scores_from is None else scores_from[len(calls) - 1].clone()

    engine._question_scores = spy
    segs = engine.prompts.chat([CHUNKS[i] for i in order], "which chunk?", SYSTEM)
    pre = engine.prefill(segs, 2)  # hands off before returning
    keys = [s.key for s in segs[:-1]]
    stored = {}
    for i in range(len(keys)):
        entry = engine.manager.store.get(path_key(keys[: i + 1]))
        if entry is not None:
            stored[i] = {n: t.clone() for n, t in entry.tensors.items()}
    return pre, calls, stored


def _reference_scores(engine, call) -> torch.Tensor:
    """The pre-pass over a buffer holding only the rows not hidden (K as loaded, rotated at their
    absolute positions; the pass's rows rotated at theirs), masses scattered back: what the question
    would score if the hidden chunks were absent."""
    runner = engine.runner
    total, hidden = call["total"], set(call["hidden"])
    keep = torch.tensor([p for p in range(total) if p not in hidden])  # [T']
    kv = runner.new_kv(keep.shape[0])
    kv.k.copy_(call["kv"][0][:, :, keep])
    kv.v.copy_(call["kv"][1][:, :, keep])
    pos = torch.tensor(call["pos"])  # [Tp] absolute
    rows = torch.searchsorted(keep, pos)  # [Tp] compact rows
    rope = runner.rotary.cos_sin(pos, runner.dtype, runner.device)
    layers = engine._question_layers()
    x = runner.embed(call["ids"][pos])
    inside = torch.zeros(total, dtype=torch.bool)
    for s, e in call["deferred"]:
        inside[s:e] = True
    scores = torch.zeros(total)
    nq = call["n_question"]
    for layer in range(max(layers) + 1):
        raw = {}
        x = runner.forward_layer(layer, x, rows, kv, keep.shape[0], raw_out=raw, rope=rope)
        if layer in layers:
            mass = runner.segment_attention_mass(layer, raw["q"][:, -nq:], rows[-nq:], kv, keep.shape[0],
                                                 list(range(keep.shape[0] + 1)))  # [Tq, T']
            s = torch.zeros(total)
            s[keep] = mass.sum(0).float()
            scores += s / s[inside].sum()
    return scores


@pytest.mark.parametrize("order,n_after", zip(ORDERS, [2, 1, 0]))
def test_pass_leaves_fresh_after_reuse_out_and_scores_equal_rows_absent(order, n_after):
    engine = _engine("leading")
    pre, calls, _ = _prefill(engine, order)
    assert pre.info["chunks_hit"] == 3 and pre.info["chunks_missed"] == 2
    (call,) = calls
    first_reuse = min(s for s, _ in call["deferred"])
    chunk_len = len(engine.prompts.segment("chunk", CHUNKS[3] + "\n\n"))
    assert len(call["hidden"]) == n_after * chunk_len  # the fresh chunks after a reused one, whole
    assert all(p > first_reuse for p in call["hidden"])
    assert all(p not in call["hidden"] for rows in call["rows"] for p in rows)  # the pass computed none of them
    ref = _reference_scores(engine, call)
    torch.testing.assert_close(call["scores"], ref, atol=1e-5, rtol=1e-4)
    if call["hidden"]:
        assert float(call["scores"][call["hidden"]].abs().max()) == 0.0


@pytest.mark.parametrize("order", ORDERS[:2])
def test_unwritten_rows_never_reach_the_pass(order):
    """A NaN-filled buffer (every unwritten row NaN) gives the same scores and prefill as a zeroed one."""
    nan_pre, nan_calls, _ = _prefill(_engine("leading", fill=math.nan), order)
    zero_pre, zero_calls, _ = _prefill(_engine("leading", fill=0.0), order)
    assert torch.isfinite(nan_calls[0]["scores"]).all()
    torch.testing.assert_close(nan_calls[0]["scores"], zero_calls[0]["scores"], atol=0, rtol=0)
    torch.testing.assert_close(nan_pre.logits, zero_pre.logits, atol=0, rtol=0)


@pytest.mark.parametrize("choice", ["question+inter", "question"])
@pytest.mark.parametrize("order", ORDERS)
def test_same_choice_same_prefill_as_the_reference(order, choice):
    """Only the ranking differs: handed the reference's scores, "leading" prefills exactly as "all"
    (logits, buffer, stored entries and their metadata), and computes fewer pre-pass rows."""
    want, want_calls, want_stored = _prefill(_engine("all", choice), order)
    got, got_calls, got_stored = _prefill(_engine("leading", choice), order,
                                          scores_from=[c["scores"] for c in want_calls])
    assert want_calls[0]["hidden"] == []
    assert got.info["chunk_recompute"] == want.info["chunk_recompute"]
    torch.testing.assert_close(got.logits, want.logits, atol=0, rtol=0)
    n = got.info["prompt_tokens"]
    torch.testing.assert_close(got.kv.k[:, :, :n], want.kv.k[:, :, :n], atol=0, rtol=0)
    torch.testing.assert_close(got.kv.v[:, :, :n], want.kv.v[:, :, :n], atol=0, rtol=0)
    assert got_stored.keys() == want_stored.keys() and got_stored
    for i, tensors in got_stored.items():
        for name, t in tensors.items():
            torch.testing.assert_close(t, want_stored[i][name], atol=0, rtol=0)
    got_rows = sum(len(r) for r in got_calls[0]["rows"])
    want_rows = sum(len(r) for r in want_calls[0]["rows"])
    assert (got_rows < want_rows) == bool(got_calls[0]["hidden"])


def test_question_pass_fresh_is_validated():
    with pytest.raises(ConfigError, match="question_pass_fresh"):
        CacheConfig(question_pass_fresh="some")


def test_server_style_separators_are_computed_not_reused():
    """Server prompts keep the "\\n\\n" between chunks as segments of their own: shorter than
    ``min_reuse_tokens``, they are computed fresh, so an all-miss request is a plain prefill (no
    pre-pass) that stores its exact path, and its repeat is an exact tree hit."""
    from cachedrag.model.generation import SamplingParams

    runner = tiny_runner("llama", seed=5)
    engine = CachedEngine(runner, config=EngineConfig(cache=CacheConfig(exact={"repeats": 0})))
    calls = []
    original = engine._question_scores
    engine._question_scores = lambda *a, **k: calls.append(k.get("hidden")) or original(*a, **k)

    def parts(order):
        out = [("text", "system: answer from the texts.\n")]
        for j, i in enumerate(order):
            out += ([("text", "\n\n")] if j else []) + [("chunk", CHUNKS[i])]
        return out + [("text", "\n\nQuestion: which chunk?")]

    params = SamplingParams(max_new_tokens=1)
    cold = engine.generate_segments(engine.prompts.text_segments(parts([0, 1, 2])), params)
    assert calls == [] and cold.chunks_hit == 0 and cold.approximations == []
    again = engine.generate_segments(engine.prompts.text_segments(parts([0, 1, 2])), params)
    assert calls == [] and again.approximations == [] and again.computed_tokens == again.question_tokens
    new = engine.generate_segments(engine.prompts.text_segments(parts([3, 4])), params)  # new chunks, known separator
    assert calls == [] and new.approximations == [] and new.chunks_hit == 0
    mixed = engine.generate_segments(engine.prompts.text_segments(parts([1, 0, 2])), params)
    assert mixed.chunks_hit == 3 and mixed.chunks_missed == 2  # the chunks reused, the separators computed
    assert len(calls) == 1 and len(calls[0]) == 4  # the pre-pass hid the two separators after the first chunk
    # the reference (min_reuse_tokens=0): the known separator is reused, so new chunks after it are approximate
    off = CachedEngine(runner, config=EngineConfig(cache=CacheConfig(exact={"repeats": 0}, min_reuse_tokens=0)))
    off.generate_segments(off.prompts.text_segments(parts([0, 1, 2])), params)
    new_off = off.generate_segments(off.prompts.text_segments(parts([3, 4])), params)
    assert "chunk_reuse" in new_off.approximations and new_off.chunks_hit == 1
