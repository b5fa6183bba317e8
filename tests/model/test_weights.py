"""The runner's fast weight layout (model/weights.py) against the reference path."""

import pytest
import torch
import torch.nn.functional as F

from cachedrag.errors import ConfigError
from cachedrag.model.runner import ModelRunner, default_threads, set_threads
from cachedrag.model.weights import Numerics, PackedLinear
from cachedrag.testing import TINY_ARCHITECTURES, byte_tokenizer, tiny_model


def _pair(arch, dtype=torch.float32, weights="dense"):
    tok = byte_tokenizer()
    ref_model = tiny_model(arch, vocab_size=len(tok), dtype=dtype)
    fast_model = tiny_model(arch, vocab_size=len(tok), dtype=dtype)
    ref = ModelRunner(ref_model, tok, fast=False, skinny_linear=False)
    fast = ModelRunner(fast_model, tok, weights=weights)
    return fast, ref


def test_numerics_names_and_validation():
    assert Numerics(dtype="bf16").dtype == "bfloat16"
    assert Numerics(dtype=torch.float32).tag == "float32"
    assert Numerics(weights="int8").dtype == "bfloat16"  # int8 computes in bf16 by default
    assert Numerics(weights="int8").tag == "bfloat16+int8w"
    assert Numerics(dtype="float32", kv_store_dtype="bf16").tag == "float32+kv-bfloat16"
    with pytest.raises(ValueError, match="bfloat16"):
        Numerics(dtype="float32", weights="int8")
    with pytest.raises(ValueError, match="unsupported dtype"):
        Numerics(dtype="float16")


def test_runner_rejects_bad_numerics_with_config_errors():
    tok = byte_tokenizer()
    with pytest.raises(ConfigError, match="bfloat16"):
        ModelRunner(tiny_model(vocab_size=len(tok)), tok, dtype="float32", weights="int8")
    with pytest.raises(ConfigError, match="fast"):
        ModelRunner(tiny_model(vocab_size=len(tok)), tok, weights="int8", fast=False)
    with pytest.raises(ConfigError, match="threads"):
        ModelRunner(tiny_model(vocab_size=len(tok)), tok, threads=0)


@pytest.mark.parametrize("rows", [1, 3, 40])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_formats_equal_f_linear(rows, bias):
    torch.manual_seed(0)
    w = torch.randn(48, 32) * 0.1  # [O, I]
    b = torch.randn(48) if bias else None
    x = torch.randn(rows, 32)
    dense = PackedLinear(w, b, Numerics())
    torch.testing.assert_close(dense(x), F.linear(x, w, b), atol=1e-5, rtol=1e-5)
    bf16 = PackedLinear(w, b, Numerics(dtype="bfloat16"))
    want = F.linear(x.bfloat16(), w.bfloat16(), b.bfloat16() if bias else None).float()
    torch.testing.assert_close(bf16(x.bfloat16()).float(), want, atol=2e-2, rtol=2e-2)
    int8 = PackedLinear(w, b, Numerics(weights="int8"))
    assert int8.kind == "int8" and int8.qweight.dtype == torch.int8
    # the kernel computes with the dequantised weight: within half a step of w (+ bf16 rounding of the scale)
    step = w.abs().amax(dim=1, keepdim=True) / 127
    assert ((int8.dequantized().float() - w).abs() <= step / 2 + w.abs() * 8e-3 + 1e-6).all()
    deq = F.linear(x.bfloat16(), int8.dequantized(), b.bfloat16() if bias else None).float()
    torch.testing.assert_close(int8(x.bfloat16()).float(), deq, atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("arch", TINY_ARCHITECTURES)
def test_fast_runner_equals_reference_prefill_and_decode(arch):
    """Fused fp32 weights and the one-token decode path equal the HF modules' forward (fp32 rounding)."""
    fast, ref = _pair(arch)
    assert fast.fast_layers is not None and ref.fast_layers is None
    ids = torch.randint(0, 256, (20,), generator=torch.Generator().manual_seed(3))
    kv_f, kv_r = fast.new_kv(26), ref.new_kv(26)
    torch.testing.assert_close(fast.prefill(ids, kv=kv_f), ref.prefill(ids, kv=kv_r), atol=1e-4, rtol=0)
    for step, token in enumerate([5, 17, 99, 3]):
        torch.testing.assert_close(fast.decode_step(token, 20 + step, kv_f), ref.decode_step(token, 20 + step, kv_r),
                                   atol=1e-4, rtol=0)
    torch.testing.assert_close(kv_f.k[:, :, :24], kv_r.k[:, :, :24], atol=1e-5, rtol=0)
    torch.testing.assert_close(kv_f.v[:, :, :24], kv_r.v[:, :, :24], atol=1e-5, rtol=0)


def test_fused_dense_weights_share_storage_with_the_hf_modules():
    fast, _ = _pair("llama")
    attn = fast.layers[0].self_attn
    assert attn.q_proj.weight.data_ptr() == fast.fast_layers[0].qkv.weight.data_ptr()


@pytest.mark.parametrize("weights", ["dense", "int8"])
def test_bf16_and_int8_runners_track_the_fp32_reference(weights):
    """Same random model in bf16 (and int8 weights): logits close to fp32's, relative to their spread."""
    tok = byte_tokenizer()
    ref = ModelRunner(tiny_model("llama", vocab_size=len(tok)), tok, fast=False, skinny_linear=False)
    low = ModelRunner(tiny_model("llama", vocab_size=len(tok)), tok, dtype="bfloat16", weights=weights)
    assert low.dtype == torch.bfloat16 and low.numerics.weights == weights
    ids = torch.randint(0, 256, (16,), generator=torch.Generator().manual_seed(1))
    kv_l, kv_r = low.new_kv(20), ref.new_kv(20)
    want = ref.prefill(ids, kv=kv_r)
    got = low.prefill(ids, kv=kv_l)
    assert got.dtype == torch.float32
    assert (got - want).abs().max() < 0.1 * want.std() + 0.05
    step_l, step_r = low.decode_step(7, 16, kv_l), ref.decode_step(7, 16, kv_r)
    assert (step_l - step_r).abs().max() < 0.1 * step_r.std() + 0.05


def test_threads_setting():
    before = torch.get_num_threads()
    try:
        assert set_threads(1) == 1 and torch.get_num_threads() == 1
        assert set_threads(None) == default_threads() >= 1
        assert set_threads(10_000) <= max(1, len(__import__("os").sched_getaffinity(0)))  # never more than the cores
    finally:
        torch.set_num_threads(before)


def test_warmup_runs_a_prefill_and_decode():
    fast, _ = _pair("llama")
    seconds = fast.warmup(prompt_tokens=32, decode_steps=2)
    assert seconds > 0
