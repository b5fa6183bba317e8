"""Crafted cache entries: valid checksums, wrong shapes. A checksum proves the bytes are the
ones written, not that they fit this model; both load paths (whole entry from a memory tier,
layer by layer from disk) must check layers, KV heads, tokens, head_dim and dtype, and treat a
mismatch as a miss with a note: the answer equals a full recompute."""

from __future__ import annotations

import pytest
import torch

from cachedrag.store.entry import KVEntry
from tests.faults.helpers import REQUESTS, ask, engine_on

CRAFTS = {
    "layers": lambda t: t[:-1],  # [L-1, H, T, D]
    "kv_heads": lambda t: t[:, :-1],  # [L, H-1, T, D]: would broadcast in GQA attention
    "tokens": lambda t: t[:, :, :-1],  # [L, H, T-1, D]: meta still says T
    "head_dim": lambda t: t[..., :-1],  # [L, H, T, D-1]
    "dtype": lambda t: t.to(torch.float16),
    "extra_layer": lambda t: torch.cat([t, t[:1]]),  # [L+1, H, T, D]
}


def craft(entry: KVEntry, how: str) -> KVEntry:
    tensors = dict(entry.tensors)
    tensors["k"] = CRAFTS[how](entry.k.clone())
    tensors["v"] = CRAFTS[how](entry.v.clone())
    return KVEntry(tensors, dict(entry.meta))  # same meta (n_tokens, path): only the tensors lie


STORES = {
    "whole_entry": lambda tmp: {"cpu_bytes": 64 << 20},  # memory tier: whole-entry load
    "layerwise": lambda tmp: {"disk_dir": tmp, "disk_bytes": 64 << 20, "disk_fsync": False},
}


@pytest.mark.parametrize("path", ["whole_entry", "layerwise"])
@pytest.mark.parametrize("how", sorted(CRAFTS))
def test_crafted_wrong_shape_is_a_miss_with_a_note(runner, expected, tmp_path, path, how):
    engine, store = engine_on(runner, STORES[path](tmp_path), layerwise_loading=path == "layerwise")
    try:
        assert ask(engine, REQUESTS[0]).token_ids == expected[0]
        keys = store.keys()
        assert keys
        for key in keys:  # every stored segment is replaced by a crafted one with a valid checksum
            assert store.put(key, craft(store.get(key, promote=False), how), replace=True)
        r = ask(engine, REQUESTS[0])
        assert r.token_ids == expected[0]
        assert any("cached entry has" in n for n in r.notes), r.notes
        assert r.chunks_hit == 0
        again = ask(engine, REQUESTS[0])  # the crafted entries were dropped and good ones stored
        assert again.token_ids == expected[0] and again.chunks_hit == 2
        assert store.check_invariants() == [] and engine.manager.check() == []
    finally:
        store.close()
