"""The engine's request buffer is left uninitialised (``CachedEngine.buffer_fill = None``): every row
is written before it is read. Filled with NaN, any row read before written would poison the
logits; every mode and token choice must give exactly the zero-filled reference's answers."""

from __future__ import annotations

import math

import pytest
import torch

from cachedrag.config import EngineConfig
from cachedrag.engine import CachedEngine
from cachedrag.kvcache.config import CacheConfig
from cachedrag.testing import tiny_runner

CHUNKS = [f"Chunk {i}: the quick brown fox jumps over the lazy dog; {i} pack my box." for i in range(5)]
SYSTEM = "sys"


def _run(fill, mode: str, cache: dict, early_termination: bool):
    runner = tiny_runner("llama", seed=7)
    engine = CachedEngine(runner, config=EngineConfig(mode=mode, early_termination=early_termination,
                                                      cache=CacheConfig(recompute_ratio=0.3, **cache)))
    engine.buffer_fill = fill
    out = [engine.generate(CHUNKS[:3], "warm up", SYSTEM, max_new_tokens=3)]  # chunks 0-2 cached
    for order in ([2, 0, 1], [3, 1, 4, 0], [0, 1, 2], [1, 3, 2]):  # reused, lead + mixed, exact, mixed
        segs = engine.prompts.chat([CHUNKS[i] for i in order], "which chunk?", SYSTEM)
        ref = engine.generate_segments(segs, _params(4))
        out.append(engine.generate_segments(segs, _params(4), teacher=ref.token_ids))
    return out


def _params(n: int):
    from cachedrag.model.generation import SamplingParams

    return SamplingParams(max_new_tokens=n)


@pytest.mark.parametrize("mode,cache,et", [
    ("full", {}, False), ("prefix", {}, False), ("naive", {}, False),
    ("cachedrag", {"token_choice": "question+inter"}, False),
    ("cachedrag", {"token_choice": "deviation"}, True),
])
def test_uninitialised_buffer_equals_the_zero_filled_reference(mode, cache, et):
    got = _run(math.nan, mode, cache, et)
    want = _run(0.0, mode, cache, et)
    for g, w in zip(got, want):
        assert g.token_ids == w.token_ids and g.chunk_recompute == w.chunk_recompute
        if w.teacher_logits is not None:
            assert not torch.isnan(g.teacher_logits).any()
            assert torch.equal(g.teacher_logits, w.teacher_logits)


def test_engine_default_leaves_the_buffer_uninitialised():
    engine = CachedEngine(tiny_runner("llama", seed=7))
    assert engine.buffer_fill is None
    kv = engine.runner.new_kv(4, fill=math.nan)
    assert torch.isnan(kv.k).all() and torch.isnan(kv.v).all()
    assert (engine.runner.new_kv(4).k == 0).all()  # the runner's default stays zero-filled
