"""The runner and engine on the Triton backend (interpreter on CPU) equal the torch backend."""

from __future__ import annotations

import pytest
import torch

from cachedrag.config import EngineConfig
from cachedrag.engine import CachedEngine
from cachedrag.kvcache.config import CacheConfig
from cachedrag.model.runner import ModelRunner
from cachedrag.testing import tiny_runner


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_prefill_and_subset_on_triton_equal_torch(arch):
    ref = tiny_runner(arch)
    tri = ModelRunner(ref.model, ref.tokenizer, kernel_backend="triton")
    assert tri.row_kernels  # the layers' norms and RoPE + K/V writes run as the row kernels
    ids = torch.randint(0, 256, (21,), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(tri.prefill(ids, all_logits=True), ref.prefill(ids, all_logits=True), atol=1e-4, rtol=0)
    kv_ref, kv_tri = ref.new_kv(21), tri.new_kv(21)
    ref.prefill(ids, kv=kv_ref)
    kv_tri.k.copy_(kv_ref.k)
    kv_tri.v.copy_(kv_ref.v)
    rows = torch.tensor([2, 7, 8, 20])
    got = tri.prefill(ids[rows], positions=rows, kv=kv_tri, kv_len=21, all_logits=True)
    want = ref.prefill(ids[rows], positions=rows, kv=kv_ref, kv_len=21, all_logits=True)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


def test_engine_reuse_on_triton_equals_torch():
    ref_runner = tiny_runner("llama", seed=5)
    tri_runner = ModelRunner(ref_runner.model, ref_runner.tokenizer, kernel_backend="triton")
    cfg = EngineConfig(early_termination=False, cache=CacheConfig(recompute_ratio=0.3))
    chunks = ["alpha beta gamma delta", "epsilon zeta eta", "theta iota kappa"]
    results = []
    for runner in (ref_runner, tri_runner):
        engine = CachedEngine(runner, config=cfg)
        engine.generate(chunks, "warm", "sys", max_new_tokens=1)
        segs = engine.prompts.chat([chunks[2], chunks[0], chunks[1]], "which?", "sys")
        results.append(engine.prefill_logits(segs))
    torch.testing.assert_close(results[1], results[0], atol=1e-4, rtol=0)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_rotated_segments_in_one_launch_equal_one_write_per_segment(dtype):
    """``write_rotated_segments`` (one re-rotation and one V copy for all of a layer's cached
    segments, Triton) writes what ``write_rotated_layer`` per segment writes; the rows it returns
    serve the next layer unchanged."""
    ref = tiny_runner("llama", dtype=dtype)
    tri = ModelRunner(ref.model, ref.tokenizer, kernel_backend="triton", dtype=dtype)
    g = torch.Generator().manual_seed(1)
    h, d = tri.n_kv_heads, tri.head_dim
    parts = [(torch.randn(h, n, d, generator=g).to(tri.dtype), torch.randn(h, n, d, generator=g).to(tri.dtype), start)
             for n, start in ((7, 3), (12, 30), (5, 14))]  # gapped, not in row order
    one, many = tri.new_kv(48), tri.new_kv(48)
    rows = None
    for layer in range(tri.n_layers):
        for raw_k, v, start in parts:
            tri.write_rotated_layer(one, layer, raw_k, v, start)
        rows = tri.write_rotated_segments(many, layer, parts, rows)
    assert rows.tolist() == [*range(3, 10), *range(30, 42), *range(14, 19)]
    torch.testing.assert_close(many.k, one.k, atol=0, rtol=0)
    torch.testing.assert_close(many.v, one.v, atol=0, rtol=0)


def test_layerwise_reuse_on_triton_equals_torch(tmp_path):
    """Layer-wise loads (a disk tier) on the Triton backend, a layer's chunks written in one launch."""
    from cachedrag.store.config import StoreConfig
    from cachedrag.store.tiered import TieredStore

    ref_runner = tiny_runner("llama", seed=5)
    tri_runner = ModelRunner(ref_runner.model, ref_runner.tokenizer, kernel_backend="triton")
    cfg = EngineConfig(early_termination=False, cache=CacheConfig(recompute_ratio=0.3), break_even_factor=1e6)
    chunks = ["alpha beta gamma delta", "epsilon zeta eta", "theta iota kappa"]
    results = []
    for name, runner in (("torch", ref_runner), ("triton", tri_runner)):
        ns = CachedEngine(runner).model_namespace.digest
        store = TieredStore.from_config(StoreConfig(namespace=ns, disk_dir=str(tmp_path / name), disk_bytes=64 << 20))
        engine = CachedEngine(runner, config=cfg, store=store)
        assert engine._layerwise
        engine.generate(chunks, "warm", "sys", max_new_tokens=1)
        r = engine.generate([chunks[2], chunks[0], chunks[1]], "which?", "sys", max_new_tokens=1)
        assert r.chunks_hit == 3 and not r.notes
        results.append(engine.prefill_logits(engine.prompts.chat([chunks[2], chunks[0], chunks[1]], "which?", "sys")))
    torch.testing.assert_close(results[1], results[0], atol=1e-4, rtol=0)
