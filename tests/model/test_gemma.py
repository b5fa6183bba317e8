"""Gemma 3 layers in the runner on a tiny random Gemma 3 (``tiny_config("gemma3")``: 3 sliding-window
layers of window 24 and 1 global layer, each kind with its own RoPE base, q/k norms, (1 + w) norms,
sandwich norms, GELU-tanh, final logit soft-capping): the equivalence tests of the Llama family
(full prefill and greedy decoding equal the HF model; a recomputed subset against exact K/V equals
full prefill; 100% recompute through the engine equals full prefill). The real-weight tests are in
test_gguf.py."""

from __future__ import annotations

import pytest
import torch

from cachedrag.model.generation import SamplingParams
from cachedrag.model.textgen import TextGenerator
from cachedrag.testing import tiny_runner


def _ids(n: int, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), generator=g)


@pytest.mark.parametrize("length", [1, 7, 61])
def test_full_prefill_equals_hf_logits(length):
    runner = tiny_runner("gemma3")
    assert runner.sandwich_norms and runner.final_softcap == 30.0
    assert runner.windows == [24, 24, 24, None]
    ids = _ids(length)
    with torch.no_grad():
        expected = runner.model(ids[None]).logits[0]  # [T, V]
    torch.testing.assert_close(runner.prefill(ids, all_logits=True), expected, atol=1e-4, rtol=0)


def test_greedy_generation_equals_hf_generate():
    runner = tiny_runner("gemma3")
    prompt = _ids(40, seed=3).tolist()  # past the window while decoding
    gen = TextGenerator(runner)
    result = gen.generate(prompt, SamplingParams(max_new_tokens=16))
    with torch.no_grad():
        expected = runner.model.generate(
            torch.tensor([prompt]), attention_mask=torch.ones(1, 40, dtype=torch.long), max_new_tokens=16,
            do_sample=False, eos_token_id=list(gen.eos_ids), pad_token_id=runner.tokenizer.pad_token_id,
        )[0, 40:].tolist()
    assert result.token_ids == [t for t in expected if t not in gen.eos_ids]


def test_engine_full_recompute_equals_full_prefill():
    """Every chunk cached at another position (re-rotated per layer kind), then 100% of its rows recomputed:
    the logits of full prefill (the window applied at the new absolute positions)."""
    from cachedrag.config import EngineConfig
    from cachedrag.engine import CachedEngine
    from cachedrag.kvcache.config import CacheConfig

    cache = CacheConfig(recompute_ratio=1.0, precision={"recompute": "float32", "fresh": "float32"})
    engine = CachedEngine(tiny_runner("gemma3"), config=EngineConfig(cache=cache, early_termination=False))
    chunks = ["alpha beta gamma delta " * 2, "one two three four five " * 2, "red green blue " * 3]
    system = "Answer briefly."
    engine.generate(chunks, "warm up", system, max_new_tokens=1)  # caches every chunk
    reordered = [chunks[2], chunks[0], chunks[1]]
    r = engine.generate(reordered, "which colour?", system, max_new_tokens=1)
    assert r.chunks_hit == 3 and r.prefix_hit_tokens < r.prompt_tokens - r.question_tokens
    segs = engine.prompts.chat(reordered, "which colour?", system)
    assert sum(len(s) for s in segs) > 2 * 24  # the prompt spans several windows
    torch.testing.assert_close(engine.prefill_logits(segs), engine.prefill_logits(segs, mode="full"),
                               atol=1e-4, rtol=0)
