"""The engine on a CUDA runner (marked gpu; skipped without CUDA): every mode against full prefill
on the device and against the same engine on CPU, stores with a GPU tier, pinned CPU tier and
disk, layer-wise loading, and a damaged entry read as a miss."""

from __future__ import annotations

import pytest
import torch

from cachedrag.config import EngineConfig
from cachedrag.engine import CachedEngine
from cachedrag.kvcache.config import CacheConfig
from cachedrag.model.runner import ModelRunner
from cachedrag.testing import tiny_runner

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

CHUNKS = [
    "The heapq module provides an implementation of the heap queue algorithm. " * 2,
    "bisect.insort inserts an item into a sorted list keeping it sorted. " * 2,
    "functools.lru_cache memoizes a function with a bounded cache. " * 2,
]
SYSTEM = "Answer from the excerpts."
REORDERED = [CHUNKS[2], CHUNKS[0], CHUNKS[1]]


def _cuda_runner(dtype: str = "float32") -> ModelRunner:
    return tiny_runner("qwen2", seed=3, device="cuda", dtype=dtype)


def _engine(runner, store=None, **kw) -> CachedEngine:
    cache = kw.pop("cache", {})
    return CachedEngine(runner, config=EngineConfig(cache=CacheConfig(**cache), **kw), store=store)


def _logits(engine, chunks, question, mode=None):
    return engine.prefill_logits(engine.prompts.chat(chunks, question, SYSTEM), mode=mode)


def test_cuda_runner_uses_the_triton_kernels_and_the_graph_step():
    runner = _cuda_runner()
    assert runner.device.type == "cuda" and runner.kernel_backend == "triton"
    assert runner.decode_step_kind == "cuda-graph"


def test_full_recompute_of_reused_chunks_equals_full_prefill_on_cuda():
    engine = _engine(_cuda_runner(), early_termination=False,
                     cache={"recompute_ratio": 1.0, "precision": {"recompute": "float32", "fresh": "float32"}})
    engine.generate(CHUNKS, "warm up", SYSTEM, max_new_tokens=1)
    r = engine.generate(REORDERED, "which module memoizes?", SYSTEM, max_new_tokens=1)
    assert r.chunks_hit == 3
    torch.testing.assert_close(_logits(engine, REORDERED, "which module memoizes?"),
                               _logits(engine, REORDERED, "which module memoizes?", mode="full"), atol=1e-4, rtol=0)


def test_exact_prefix_reuse_gives_full_logits_on_cuda():
    engine = _engine(_cuda_runner(), mode="prefix")
    engine.generate(CHUNKS, "first question", SYSTEM, max_new_tokens=1)
    r = engine.generate(CHUNKS, "second question", SYSTEM, max_new_tokens=1)
    assert r.chunks_hit == 3 and r.computed_tokens == r.question_tokens
    torch.testing.assert_close(_logits(engine, CHUNKS, "second question"),
                               _logits(engine, CHUNKS, "second question", mode="full"), atol=1e-4, rtol=0)


@pytest.mark.parametrize("mode", ["full", "prefix", "cachedrag"])
def test_every_mode_on_cuda_matches_the_cpu_engine(mode):
    """Same weights, same requests: the CUDA engine computes what the CPU engine computes
    (float32: the same tokens; logits to accumulation-order rounding)."""
    gpu = _engine(_cuda_runner(), mode=mode)
    cpu = _engine(tiny_runner("qwen2", seed=3), mode=mode)
    for e in (gpu, cpu):
        e.generate(CHUNKS, "warm", SYSTEM, max_new_tokens=1)
    r_gpu, r_cpu = (e.generate(REORDERED, "which module memoizes?", SYSTEM, max_new_tokens=12) for e in (gpu, cpu))
    assert r_gpu.chunks_hit == r_cpu.chunks_hit and r_gpu.computed_tokens == r_cpu.computed_tokens
    assert r_gpu.token_ids == r_cpu.token_ids
    torch.testing.assert_close(_logits(gpu, REORDERED, "q").cpu(), _logits(cpu, REORDERED, "q"), atol=2e-3, rtol=0)


def test_bfloat16_cachedrag_on_cuda_stays_close_to_full():
    engine = _engine(_cuda_runner("bfloat16"))
    engine.generate(CHUNKS, "warm", SYSTEM, max_new_tokens=1)
    r = engine.generate(REORDERED, "q", SYSTEM, max_new_tokens=1)
    assert r.chunks_hit == 3 and r.computed_tokens < r.prompt_tokens
    got = torch.log_softmax(_logits(engine, REORDERED, "q"), -1)
    full = torch.log_softmax(_logits(engine, REORDERED, "q", mode="full"), -1)
    kl = torch.sum(full.exp() * (full - got)).item()
    assert torch.isfinite(got).all() and kl < 0.05


@pytest.mark.parametrize("tier", ["gpu", "cpu", "disk"])
def test_reuse_from_each_tier_on_cuda_equals_the_in_memory_engine(tier, tmp_path):
    from cachedrag.store.config import StoreConfig
    from cachedrag.store.tiered import TieredStore

    runner = _cuda_runner()
    memory = _engine(runner, early_termination=False, cache={"recompute_ratio": 0.2})
    budget = {"gpu": {"gpu_bytes": 64 << 20}, "cpu": {"cpu_bytes": 64 << 20},
              "disk": {"disk_dir": str(tmp_path), "disk_bytes": 64 << 20}}[tier]
    store = TieredStore.from_config(StoreConfig(namespace=memory.model_namespace.digest, **budget))
    # break_even_factor: always wait for a load (what is served must not depend on load timing; test_engine.py)
    tiered = _engine(runner, store=store, early_termination=False, cache={"recompute_ratio": 0.2},
                     break_even_factor=1e6)
    for e in (memory, tiered):
        e.generate(CHUNKS, "warm", SYSTEM, max_new_tokens=1)
    r_mem, r_tier = (e.generate(REORDERED, "q", SYSTEM, max_new_tokens=8) for e in (memory, tiered))
    assert r_tier.chunks_hit == r_mem.chunks_hit == 3 and not r_tier.notes
    assert r_tier.token_ids == r_mem.token_ids
    torch.testing.assert_close(_logits(tiered, REORDERED, "q"), _logits(memory, REORDERED, "q"), atol=1e-5, rtol=0)


def test_bit_flipped_disk_entry_is_a_miss_on_cuda(tmp_path):
    from cachedrag.store.config import StoreConfig
    from cachedrag.store.tiered import TieredStore

    runner = _cuda_runner()
    probe = _engine(runner)
    store = TieredStore.from_config(StoreConfig(namespace=probe.model_namespace.digest, disk_dir=str(tmp_path),
                                                disk_bytes=64 << 20))
    engine = _engine(runner, store=store)
    engine.generate(CHUNKS[:2], "first", SYSTEM, max_new_tokens=1)
    files = sorted(p for p in tmp_path.rglob("*") if p.is_file() and p.stat().st_size > 4096)
    assert files
    for path in files:
        data = bytearray(path.read_bytes())
        data[-100] ^= 0xFF
        path.write_bytes(bytes(data))
    r = engine.generate(CHUNKS[:2], "second", SYSTEM, max_new_tokens=4)
    full = engine.generate(CHUNKS[:2], "second", SYSTEM, max_new_tokens=4, mode="full")
    assert r.token_ids == full.token_ids and r.chunks_hit == 0
