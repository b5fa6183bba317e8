"""The partial prefill takes over the question pre-pass's leading fresh rows (fresh chunks before
every reused chunk, ``engine._Lead``): logits, recompute choice, buffer and stored entries equal
the reference path that recomputes them (``share_lead_rows = False``)."""

from __future__ import annotations

import pytest
import torch

from cachedrag.config import EngineConfig
from cachedrag.engine import CachedEngine
from cachedrag.kvcache.config import CacheConfig
from cachedrag.kvcache.keys import path_key
from cachedrag.testing import tiny_runner

CHUNKS = [f"Chunk {i}: the quick brown fox jumps over the lazy dog; {i} pack my box." for i in range(5)]
SYSTEM = "sys"


def _run(share: bool, order: list[int], choice: str):
    runner = tiny_runner("llama", seed=5)
    # the rows behind the lead rows in float32: on the bfloat16 copies a 1e-7 difference in their input (the lead
    # rows' K/V from the pre-pass vs the prefill) can cross a bfloat16 rounding boundary and move an output by 1e-3
    cache = CacheConfig(recompute_ratio=0.27, token_choice=choice, precision={"recompute": "float32", "fresh": "float32"})
    engine = CachedEngine(runner, config=EngineConfig(cache=cache))
    engine.share_lead_rows = share
    engine.generate(CHUNKS[:3], "warm up", SYSTEM, max_new_tokens=1)  # chunks 0-2 cached
    segs = engine.prompts.chat([CHUNKS[i] for i in order], "which chunk?", SYSTEM)
    calls = []
    original = engine._question_scores
    engine._question_scores = lambda *a, **k: calls.append(k.get("lead")) or original(*a, **k)
    pre = engine.prefill(segs, 2)  # hands off before returning
    keys = [s.key for s in segs[:-1]]
    stored = {}
    for i in range(len(keys)):
        entry = engine.manager.store.get(path_key(keys[: i + 1]))
        variant = {v.handle: v for v in engine.manager.index.variants(keys[i])}.get(path_key(keys[: i + 1]))
        stored[i] = (None if entry is None else {n: t.clone() for n, t in entry.tensors.items()},
                     None if variant is None else list(variant.meta.token_inter))
    return pre, stored, calls


@pytest.mark.parametrize("choice", ["question+inter", "question"])
@pytest.mark.parametrize("order", [[3, 4, 1, 0, 2], [3, 1, 4, 0, 2]])
def test_shared_lead_rows_equal_the_reference(order, choice):
    got, got_stored, calls = _run(True, order, choice)
    want, want_stored, _ = _run(False, order, choice)
    assert got.info["chunks_missed"] == 2 and got.info["chunks_hit"] == 3
    n_lead = sum(1 for i in order[: next(k for k, i in enumerate(order) if i < 3)])  # fresh chunks before a reused one
    assert calls and (calls[0].hidden is not None) == (n_lead > 0)  # the pre-pass ran and shared what it could
    torch.testing.assert_close(got.logits, want.logits, atol=1e-5, rtol=0)
    assert got.info["chunk_recompute"] == want.info["chunk_recompute"]
    assert got.info["computed_fraction"] == pytest.approx(want.info["computed_fraction"])
    n = got.info["prompt_tokens"]
    torch.testing.assert_close(got.kv.k[:, :, :n], want.kv.k[:, :, :n], atol=1e-5, rtol=0)
    torch.testing.assert_close(got.kv.v[:, :, :n], want.kv.v[:, :, :n], atol=1e-5, rtol=0)
    assert got_stored.keys() == want_stored.keys()
    for i, (tensors, inter) in got_stored.items():
        ref_tensors, ref_inter = want_stored[i]
        assert (tensors is None) == (ref_tensors is None) and (inter is None) == (ref_inter is None)
        for name in tensors or {}:
            torch.testing.assert_close(tensors[name], ref_tensors[name], atol=1e-5, rtol=0)
        if inter is not None:
            torch.testing.assert_close(torch.tensor(inter), torch.tensor(ref_inter), atol=1e-5, rtol=0)
