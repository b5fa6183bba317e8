"""Equivalence of the runner's forward with Hugging Face, and of its reuse primitives."""

from __future__ import annotations

import pytest
import torch

from cachedrag.errors import ContextWindowError, UnsupportedModelError
from cachedrag.model.generation import SamplingParams
from cachedrag.model.runner import ModelRunner
from cachedrag.model.textgen import TextGenerator
from cachedrag.testing import TINY_ARCHITECTURES, tiny_model, tiny_runner


def _ids(n: int, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), generator=g)


@pytest.mark.parametrize("arch", TINY_ARCHITECTURES)
@pytest.mark.parametrize("length", [1, 7, 61])
def test_full_prefill_equals_hf_logits(arch, length):
    runner = tiny_runner(arch)
    ids = _ids(length)
    with torch.no_grad():
        expected = runner.model(ids[None]).logits[0]  # [T, V]
    got = runner.prefill(ids, all_logits=True)  # [T, V]
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize("arch", [*TINY_ARCHITECTURES, "gemma3"])  # gemma3: sliding-window and global layers
@pytest.mark.parametrize("subset", [[0], [5, 6, 7], [3, 9, 10, 30, 44], list(range(20, 45))])
def test_subset_with_exact_kv_equals_full(arch, subset):
    """Recomputing a gapped subset against exact K/V of every other row reproduces full prefill."""
    runner = tiny_runner(arch)
    ids = _ids(45)
    full_kv = runner.new_kv(45)
    full = runner.prefill(ids, kv=full_kv, all_logits=True)  # [T, V]
    kv = runner.new_kv(45)
    kv.k.copy_(full_kv.k)
    kv.v.copy_(full_kv.v)
    rows = torch.tensor(subset)
    kv.k[:, :, rows] = 0.0  # the subset's rows must be recomputed, not read
    kv.v[:, :, rows] = 0.0
    got = runner.prefill(ids[rows], positions=rows, kv=kv, kv_len=45, all_logits=True)
    torch.testing.assert_close(got, full[rows], atol=1e-4, rtol=0)
    torch.testing.assert_close(kv.k, full_kv.k, atol=1e-5, rtol=0)


@pytest.mark.parametrize("arch", ["llama", "llama3", "qwen3"])
def test_rerotation_equals_rope_at_new_positions(arch):
    runner = tiny_runner(arch)
    raw = torch.randn(runner.n_kv_heads, 13, runner.head_dim)  # [H, T, D]
    old = torch.arange(13) + 3
    new = torch.tensor([40, 41, 42, 50, 51, 52, 53, 54, 90, 91, 92, 93, 200])
    rotated_old = runner.rotary.apply(raw, old)
    torch.testing.assert_close(runner.rotary.rerotate(rotated_old, old, new), runner.rotary.apply(raw, new),
                               atol=1e-5, rtol=1e-5)
    # raw K is old_positions = 0 rotation
    torch.testing.assert_close(runner.rotary.rerotate(raw, torch.zeros(13, dtype=torch.long), new),
                               runner.rotary.apply(raw, new), atol=1e-5, rtol=1e-5)


def test_raw_k_is_pre_rope():
    runner = tiny_runner("llama")
    ids = _ids(10)
    kv = runner.new_kv(10)
    hidden = runner.embed(ids)
    raw = {}
    runner.forward_layer(0, hidden, torch.arange(10), kv, 10, raw_out=raw)
    torch.testing.assert_close(runner.rotary.apply(raw["k"], torch.arange(10)), kv.k[0, :, :10])
    torch.testing.assert_close(raw["v"], kv.v[0, :, :10])


@pytest.mark.parametrize("arch", TINY_ARCHITECTURES)
def test_greedy_generation_equals_hf_generate(arch):
    runner = tiny_runner(arch)
    prompt = _ids(12, seed=3).tolist()
    gen = TextGenerator(runner)
    result = gen.generate(prompt, SamplingParams(max_new_tokens=16))
    with torch.no_grad():
        expected = runner.model.generate(
            torch.tensor([prompt]), attention_mask=torch.ones(1, 12, dtype=torch.long), max_new_tokens=16,
            do_sample=False, eos_token_id=list(gen.eos_ids), pad_token_id=runner.tokenizer.pad_token_id,
        )[0, 12:].tolist()
    expected = [t for t in expected if t not in gen.eos_ids]
    assert result.token_ids == expected
    assert result.prompt_tokens == 12 and result.ttft_s > 0


def test_segment_attention_mass_matches_dense_softmax():
    runner = tiny_runner("qwen2")
    ids = _ids(30)
    kv = runner.new_kv(30)
    runner.prefill(ids, kv=kv)
    hidden = runner.embed(ids)
    raw = {}
    runner.forward_layer(0, hidden, torch.arange(30), kv, 30, raw_out=raw)
    bounds = [0, 4, 17, 30]
    mass = runner.segment_attention_mass(0, raw["q"], torch.arange(30), kv, 30, bounds)  # [T, S]
    group = runner.n_heads // runner.n_kv_heads
    k = kv.k[0, :, :30].repeat_interleave(group, 0)
    scores = (raw["q"] @ k.transpose(1, 2)) * runner.scaling
    scores = scores.masked_fill(~torch.ones(30, 30, dtype=torch.bool).tril(), float("-inf"))
    probs = scores.softmax(-1).mean(0)  # [T, T]
    expected = torch.stack([probs[:, a:b].sum(-1) for a, b in zip(bounds, bounds[1:])], -1)
    torch.testing.assert_close(mass, expected, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(mass.sum(-1), torch.ones(30), atol=1e-5, rtol=0)


@pytest.mark.parametrize("arch", TINY_ARCHITECTURES)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fused_segment_mass_equals_reference(arch, dtype):
    """The fused (attention over segment indicators) path equals the blockwise softmax, at query
    subsets (fresh rows), beyond a sliding window (mistral: 24) and with one segment per column."""
    model = tiny_model(arch, vocab_size=260)
    runner = ModelRunner(model, dtype=dtype)
    n = 70
    ids = _ids(n)
    kv = runner.new_kv(n)
    runner.prefill(ids, kv=kv)
    hidden = runner.embed(ids)
    raw = {}
    runner.forward_layer(0, hidden, torch.arange(n), kv, n, raw_out=raw)
    tol = dict(atol=1e-5, rtol=1e-4) if dtype == "float32" else dict(atol=1.5e-2, rtol=0)
    cases = [(rows, bounds) for rows in (torch.tensor([3, 10, 11, 40, 41, 42, 69]), torch.arange(50))  # subset, leading
             for bounds in ([0, 4, 17, 30, 55, n], [0, n], list(range(0, n + 1, 5)))]
    for rows, bounds in cases:
        assert len(bounds) - 1 <= runner.head_dim  # takes the fused path
        fused = runner.segment_attention_mass(0, raw["q"][:, rows], rows, kv, n, bounds)  # [R, S]
        ref = runner.segment_attention_mass(0, raw["q"][:, rows], rows, kv, n, bounds, reference=True)  # [R, S]
        assert fused.shape == ref.shape == (len(rows), len(bounds) - 1)
        torch.testing.assert_close(fused, ref, **tol)
        torch.testing.assert_close(fused.sum(-1), torch.ones(len(rows)), atol=tol["atol"] * 2, rtol=0)


@pytest.mark.parametrize("arch", TINY_ARCHITECTURES)
@pytest.mark.parametrize("length", [2, 20, 61])
def test_leading_causal_attention_equals_masked(arch, length):
    """Queries at 0..T-1 take SDPA's causal mode (block-sparse); it equals the absolute-position
    mask, with longer buffers and with a sliding window (mistral: 24) that forces the mask."""
    runner = tiny_runner(arch)
    ids = _ids(length)
    kv = runner.new_kv(length + 9)
    runner.prefill(ids, kv=kv)
    raw = {}
    pos = torch.arange(length)
    runner.forward_layer(1, runner.embed(ids), pos, kv, length + 9, raw_out=raw)
    window = runner.windows[1]
    assert runner._leading_causal(1, pos, length + 9) == (length >= 2 and (window is None or window >= length))
    got = runner.attend(1, raw["q"], pos, kv, length + 9)  # [T, H_q*D]
    mask = runner.attention_mask(1, pos, length + 9)  # [T, T_k]
    expected = torch.nn.functional.scaled_dot_product_attention(
        raw["q"][None], kv.k[1, :, :length + 9][None], kv.v[1, :, :length + 9][None], attn_mask=mask,
        scale=runner.scaling, enable_gqa=True)[0].transpose(0, 1).reshape(length, -1)
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-5)
    assert not runner._leading_causal(1, pos + 1, length + 9)  # shifted queries keep the mask


def test_unknown_architecture_is_refused_with_supported_list():
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50))
    with pytest.raises(UnsupportedModelError, match="LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM"):
        ModelRunner(model)


def test_length_dependent_rope_is_refused():
    model = tiny_model("llama", rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0})
    with pytest.raises(UnsupportedModelError, match="rotary variant 'dynamic'"):
        ModelRunner(model)


def test_prompt_longer_than_context_window_is_refused():
    runner = tiny_runner("llama")
    gen = TextGenerator(runner)
    with pytest.raises(ContextWindowError, match="context window of 512"):
        gen.generate(list(range(200)) * 3, SamplingParams(max_new_tokens=8))


def test_kv_deviation_is_zero_on_exact_rows_and_finds_a_changed_row():
    runner = tiny_runner("llama", seed=1)
    ids = torch.randint(0, runner.model.config.vocab_size, (24,))
    pos = torch.arange(24)
    kv = runner.new_kv(24)
    with torch.inference_mode():
        hidden = runner.forward_layer(0, runner.embed(ids), pos, kv, 24)  # layer 1's input, exact
        runner.prefill(ids, kv=kv)  # every row of every layer exact
        for on in ("v", "k", "kv"):
            assert runner.kv_deviation(1, hidden, pos, kv, on=on).abs().max() < 1e-8
        kv.v[1, :, 9] += 1.0
        kv.k[1, :, 4] += 1.0
        assert int(runner.kv_deviation(1, hidden, pos, kv, on="v").argmax()) == 9
        assert int(runner.kv_deviation(1, hidden, pos, kv, on="k").argmax()) == 4
        with pytest.raises(ValueError, match="on must be"):
            runner.kv_deviation(1, hidden, pos, kv, on="q")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 5])
def test_decode_rms_norm_equals_hf(dtype, rows):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from cachedrag.model.runner import _rms_norm

    norm = LlamaRMSNorm(96, eps=1e-5).to(dtype)
    torch.nn.init.normal_(norm.weight)
    x = torch.randn(rows, 96, dtype=dtype) * 3
    with torch.no_grad():
        torch.testing.assert_close(_rms_norm(x, norm.weight, norm.variance_epsilon), norm(x), atol=1e-6, rtol=1e-6)
