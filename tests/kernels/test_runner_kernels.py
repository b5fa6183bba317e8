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
