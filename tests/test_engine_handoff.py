"""The store hand-off of a miss: what the engine stores equals a reference computed inline, and a
generation hands it off only after its first token (the miss path's TTFT equals ``full``'s)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from cachedrag.config import EngineConfig
from cachedrag.engine import CachedEngine
from cachedrag.engine.selection import _rows
from cachedrag.kvcache.keys import path_key
from cachedrag.testing import tiny_runner

CHUNKS = [
    "The heapq module provides an implementation of the heap queue algorithm. " * 2,
    "bisect.insort inserts an item into a sorted list keeping it sorted. " * 2,
    "functools.lru_cache memoizes a function with a bounded cache. " * 2,
]
SYSTEM = "Answer from the excerpts."


@pytest.fixture
def runner():
    return tiny_runner("llama", seed=5)


def _engine(runner):
    return CachedEngine(runner, config=EngineConfig(mode="cachedrag"))


def _stored(engine, segments) -> dict:
    """Per context segment: the stored entry's tensors and meta, and its variant metadata."""
    keys = [s.key for s in segments[:-1]]
    out = {}
    for i in range(len(keys)):
        handle = path_key(keys[: i + 1])
        entry = engine.manager.store.get(handle)
        variant = {v.handle: v for v in engine.manager.index.variants(keys[i])}.get(handle)
        out[i] = (None if entry is None else ({n: t.clone() for n, t in entry.tensors.items()}, dict(entry.meta)),
                  None if variant is None else variant.meta)
    return out


def _reference(runner, engine, segments):
    """Raw K ``[L, H_kv, Tc, D]``, V and summed segment masses ``[Tc, S]`` of the context rows,
    measured inline while a plain full prefill runs layer by layer (blockwise-softmax reference)."""
    ids = torch.tensor([t for s in segments for t in s.ids])  # [T]
    bounds = [0]
    for s in segments:
        bounds.append(bounds[-1] + len(s))
    total, ctx = bounds[-1], bounds[-2]
    pos = torch.arange(total)  # [T]
    kv = runner.new_kv(total)
    hidden = runner.embed(ids)  # [T, Dm]
    raw_k, mass = [], None
    with torch.inference_mode():
        for layer in range(runner.n_layers):
            raw: dict = {}
            hidden = runner.forward_layer(layer, hidden, pos, kv, total, raw_out=raw)
            raw_k.append(raw["k"][:, :ctx].clone())  # [H_kv, Tc, D]
            if layer in engine.metadata_layers:
                m = runner.segment_attention_mass(layer, raw["q"][:, :ctx], pos[:ctx], kv, total, bounds,
                                                  reference=True)  # [Tc, S]
                mass = m if mass is None else mass + m
    return torch.stack(raw_k), kv.v[:, :, :ctx].clone(), mass, bounds


def test_miss_stores_what_an_inline_reference_measures(runner):
    engine = _engine(runner)
    segments = engine.prompts.chat(CHUNKS, "which module memoizes?", SYSTEM)
    r = engine.generate(CHUNKS, "which module memoizes?", SYSTEM, max_new_tokens=3)
    assert r.chunks_missed == 3
    raw_k, v, mass, bounds = _reference(runner, engine, segments)
    stored = _stored(engine, segments)
    chunk_seg = [i for i, s in enumerate(segments[:-1]) if s.kind == "chunk"]
    assert chunk_seg and len(stored) == len(segments) - 1
    for i, (entry, meta) in stored.items():
        assert entry is not None, f"segment {i} not stored"
        rows = slice(bounds[i], bounds[i + 1])
        assert torch.equal(entry[0]["k"], raw_k[:, :, rows])  # pre-RoPE K of exactly these rows
        assert torch.equal(entry[0]["v"], v[:, :, rows])
        if i not in chunk_seg:
            assert meta is None
            continue
        prior = [j for j in chunk_seg if j < i]
        intra = mass[rows, i]  # [T_i]
        inter = mass[rows][:, prior].sum(-1) if prior else torch.zeros_like(intra)  # [T_i]
        expected = inter / (inter + intra).clamp_min(1e-12)
        torch.testing.assert_close(torch.tensor(meta.token_inter), expected, atol=1e-5, rtol=0)
        torch.testing.assert_close(meta.intra, float(intra.mean()), atol=1e-5, rtol=0)


def test_deferred_hand_off_stores_the_same_as_an_inline_one(runner):
    """``generate`` hands off after the first token, ``prefill`` before returning: same entries."""
    a, b = _engine(runner), _engine(runner)
    segments = a.prompts.chat(CHUNKS, "q", SYSTEM)
    a.generate(CHUNKS, "q", SYSTEM, max_new_tokens=4)
    b.prefill(segments, 4)
    got, want = _stored(a, segments), _stored(b, segments)
    assert got.keys() == want.keys()
    for i in got:
        (ta, ma), va = got[i]
        (tb, mb), vb = want[i]
        assert ta.keys() == tb.keys() and ma == mb and (va is None) == (vb is None)
        if va is not None:  # AttentionMetadata compares by identity: compare its fields
            assert (va.prefix_keys, dict(va.inter), va.intra, list(va.token_inter)) == (
                vb.prefix_keys, dict(vb.inter), vb.intra, list(vb.token_inter))
        for name in ta:
            assert torch.equal(ta[name], tb[name]), (i, name)
    assert a.manager.check() == [] and b.manager.check() == []


def test_hand_off_runs_after_the_first_token(runner, monkeypatch):
    engine = _engine(runner)
    original = engine._hand_off

    def slow(*args):
        time.sleep(0.3)
        original(*args)

    monkeypatch.setattr(engine, "_hand_off", slow)
    r = engine.generate(CHUNKS[:2], "q", SYSTEM, max_new_tokens=2)
    assert r.total_s - r.ttft_s >= 0.3  # the hand-off ran after TTFT was taken...
    assert len(engine.manager.handles()) == 3  # system prompt + 2 chunks
    again = engine.generate(CHUNKS[:2], "q2", SYSTEM, max_new_tokens=1)
    assert again.chunks_hit == 2  # ...and before generate returned: the next request hits


def test_closed_stream_still_hands_off(runner):
    engine = _engine(runner)
    stream = engine.generate(CHUNKS[:2], "q", SYSTEM, max_new_tokens=32, stream=True)
    deltas = iter(stream)
    assert engine.manager.handles() == []  # lazy: nothing ran yet
    next(deltas)
    deltas.close()  # the consumer stops after the first delta
    assert len(engine.manager.handles()) == 3  # system prompt + 2 chunks
    assert engine.generate(CHUNKS[:2], "q2", SYSTEM, max_new_tokens=1).chunks_hit == 2


def test_concurrent_misses_keep_the_manager_consistent(runner):
    engine = _engine(runner)
    expected = CachedEngine(runner, config=EngineConfig(mode="full")).generate(
        CHUNKS, "q", SYSTEM, max_new_tokens=3).token_ids
    got = []

    def work():
        got.append(engine.generate(CHUNKS, "q", SYSTEM, max_new_tokens=3))

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert engine.manager.check() == []
    assert len(got) == 4 and len(engine.manager.handles()) == 4  # system prompt + 3 chunks, each stored once
    misses = [r for r in got if r.chunks_hit == 0 and r.prefix_hit_tokens == 0]
    assert misses and all(r.token_ids == expected for r in misses)  # a miss computes what full computes


@pytest.mark.parametrize("positions,wanted,expect", [
    ([0, 1, 2, 3, 4], [0, 1, 2], slice(0, 3)),
    ([2, 5, 6, 7, 9], [5, 6, 7], slice(1, 4)),
    ([0, 1, 2, 3, 4], [0, 2, 3], [0, 2, 3]),
    ([1, 3, 8], [], []),
])
def test_rows_is_a_slice_exactly_when_the_rows_are_consecutive(positions, wanted, expect):
    rows = _rows(torch.tensor(positions), torch.tensor(wanted, dtype=torch.long))
    if isinstance(expect, slice):
        assert rows == expect
    else:
        assert isinstance(rows, torch.Tensor) and rows.tolist() == expect
    x = torch.arange(len(positions)) * 10  # [Tc]
    assert x[rows].tolist() == [10 * positions.index(p) for p in wanted]  # same rows either way


def test_prefill_can_defer_its_hand_off(runner):
    """``prefill(defer_store=True)`` (the server's seam) stores nothing until ``hand_off()``
    runs, after which it stored what an inline ``prefill`` stores."""
    a, b = _engine(runner), _engine(runner)
    segments = a.prompts.chat(CHUNKS, "q", SYSTEM)
    pre = a.prefill(segments, 4, defer_store=True)
    assert pre.hand_off is not None and a.manager.handles() == []
    a.runner.decode_step(int(pre.logits.argmax()), pre.info["prompt_tokens"], pre.kv)  # decode may run first
    pre.hand_off()
    inline = b.prefill(segments, 4)
    assert inline.hand_off is None
    got, want = _stored(a, segments), _stored(b, segments)
    assert got.keys() == want.keys() and all(got[i][0] is not None for i in got)
    for i in got:
        (ta, ma), va = got[i]
        (tb, mb), vb = want[i]
        assert ma == mb and (va is None) == (vb is None)
        if va is not None:
            assert (va.prefix_keys, list(va.token_inter)) == (vb.prefix_keys, list(vb.token_inter))
        for name in ta:
            assert torch.equal(ta[name], tb[name]), (i, name)
    assert a.prefill(segments, 1, defer_store=True).hand_off is None  # all cached: nothing to hand off
