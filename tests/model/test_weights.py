"""The runner's fast weight layout (model/weights.py) against the reference path."""

import pytest
import torch
import torch.nn.functional as F

from cachedrag.errors import ConfigError, UnsupportedModelError
from cachedrag.model.runner import ModelRunner, default_threads, set_threads
from cachedrag.model.weights import Numerics, PackedLinear, vnni_available
from cachedrag.testing import TINY_ARCHITECTURES, byte_tokenizer, tiny_model, tiny_runner

needs_vnni = pytest.mark.skipif(not vnni_available() or torch.backends.quantized.engine not in ("x86", "fbgemm"),
                                reason="int8-dynamic needs fbgemm on a CPU with VNNI")
FORMATS = ["dense", "int8", "int4", pytest.param("int8-dynamic", marks=needs_vnni)]


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
    assert Numerics(weights="int4").tag == "bfloat16+int4w-g32"  # the group size is part of the numerics
    assert Numerics(weights="int8-dynamic").tag == "bfloat16+int8w-a8dyn"
    assert len({Numerics(weights=w).tag for w in ("dense", "int8", "int8-dynamic", "int4")}) == 4
    assert Numerics(weights="int8-dynamic").decode_dtype == torch.float32  # fbgemm's kernel: float32 in and out
    assert Numerics(weights="int8").decode_dtype == torch.bfloat16
    with pytest.raises(ValueError, match="bfloat16"):
        Numerics(dtype="float32", weights="int8")
    with pytest.raises(ValueError, match="bfloat16"):
        Numerics(dtype="float32", weights="int4")
    with pytest.raises(ValueError, match="prefill in bfloat16"):
        Numerics(dtype="float32", weights="int8-dynamic")
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


def test_int8_dynamic_is_refused_without_vnni(monkeypatch):
    import cachedrag.model.runner as runner_module

    tok = byte_tokenizer()
    monkeypatch.setattr(runner_module, "vnni_available", lambda: False)
    with pytest.raises(ConfigError, match="VNNI"):
        ModelRunner(tiny_model(vocab_size=len(tok)), tok, weights="int8-dynamic")


@needs_vnni
@pytest.mark.parametrize("rows", [1, 3, 40])
@pytest.mark.parametrize("bias", [False, True])
def test_int8_dynamic_kernel_is_the_dequantised_weight_on_quantised_rows(rows, bias):
    """Few rows (decode): fbgemm quantises each row to 8 bits from its min/max (0 included), so the
    result is ``x @ deq^T`` within half an activation step times each output's weight mass; it takes
    and returns float32 (bf16 rows come back bf16). Many rows (prefill) run as weight-only int8."""
    torch.manual_seed(0)
    w = torch.randn(48, 32) * 0.1  # [O, I]
    b = torch.randn(48) if bias else None
    x = torch.randn(rows, 32)  # [N, I]
    dyn = PackedLinear(w, b, Numerics(weights="int8-dynamic"))
    plain = PackedLinear(w, b, Numerics(weights="int8"))
    assert dyn.kind == "int8" and torch.equal(dyn.qweight, plain.qweight) and dyn.nbytes == plain.nbytes
    deq = dyn.dequantized().float()  # [O, I]
    bias_f = b.bfloat16().float() if bias else None
    if rows > 16:
        torch.testing.assert_close(dyn(x.bfloat16()).float(), plain(x.bfloat16()).float(), atol=0, rtol=0)
        return
    got = dyn(x)  # [N, O]
    assert got.dtype == torch.float32 and got.shape == (rows, 48)
    want = F.linear(x, deq, bias_f)  # [N, O]
    step = (x.amax(-1).clamp_min(0) - x.amin(-1).clamp_max(0)) / 255  # [N]
    bound = step[:, None] / 2 * deq.abs().sum(-1)[None, :] * 1.01 + 1e-4  # [N, O]
    assert ((got - want).abs() <= bound).all()
    assert (got - want).abs().max() > 0  # the activations really are quantised (not weight-only)
    assert dyn(x.bfloat16()).dtype == torch.bfloat16


@pytest.mark.parametrize("rows", [1, 3, 40])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("in_features", [32, 40])  # 40: torch's int8 kernel reads 16 columns at a time
def test_packed_linear_formats_equal_f_linear(rows, bias, in_features):
    torch.manual_seed(0)
    w = torch.randn(48, in_features) * 0.1  # [O, I]
    b = torch.randn(48) if bias else None
    x = torch.randn(rows, in_features)
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


@pytest.mark.parametrize("rows", [1, 3, 40])
@pytest.mark.parametrize("out_features", [48, 40])  # 40: not a multiple of 16, the kernel's rows are padded
@pytest.mark.parametrize("bias", [False, True])
def test_int4_kernel_equals_its_dequantised_weight(rows, out_features, bias):
    """The int4 kernel (decode rows) and the oneDNN path (prefill rows) compute with the same weight:
    ``dequantized()``, within a group's half step of the original."""
    torch.manual_seed(0)
    w = torch.randn(out_features, 64) * 0.1  # [O, I]
    b = torch.randn(out_features) if bias else None
    x = torch.randn(rows, 64).bfloat16()
    int4 = PackedLinear(w, b, Numerics(weights="int4"))
    assert int4.kind == "int4" and all(t.dtype in (torch.uint8, torch.bfloat16) for t in int4.int4.state())
    assert int4.nbytes < w.numel()  # ~0.56 bytes per weight read per decode step
    deq = int4.dequantized().float()  # [O, I]
    step = (w.view(out_features, 2, 32).amax(-1) - w.view(out_features, 2, 32).amin(-1)) / 15  # [O, G]
    assert ((deq - w).abs().view(out_features, 2, 32) <= step[..., None] * 0.52 + 1e-3).all()
    want = F.linear(x.float(), deq, b.bfloat16().float() if bias else None)
    got = int4(x).float()
    assert got.shape == (rows, out_features)
    torch.testing.assert_close(got, want, atol=3e-2, rtol=3e-2)


def test_int4_recovers_weights_that_have_16_levels_per_group():
    """Weights dequantised from a Q4_1-like format (16 levels per group of 32) come back exactly
    when scale and minimum are bf16 values: the default GGUF is Q4_1, so int4 loses ~nothing there."""
    g = torch.Generator().manual_seed(4)
    q = torch.randint(0, 16, (32, 4, 32), generator=g).float()  # [O, G, g]
    q[..., 0], q[..., 1] = 0, 15  # every group spans its full range
    scale = 2.0 ** torch.randint(-8, -3, (32, 4, 1), generator=g).float()  # [O, G, 1]
    low = torch.randint(-64, 0, (32, 4, 1), generator=g).float() / 256  # [O, G, 1]
    w = (q * scale + low).view(32, 128)  # [O, I]
    int4 = PackedLinear(w, None, Numerics(weights="int4"))
    assert torch.equal(int4.dequantized().float(), w)


def test_int4_refuses_input_sizes_off_the_group():
    tok = byte_tokenizer()
    model = tiny_model("llama", vocab_size=len(tok), hidden_size=48, num_attention_heads=3, num_key_value_heads=1)
    with pytest.raises(UnsupportedModelError, match="divisible by 32"):
        ModelRunner(model, tok, weights="int4")


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


def test_bf16_fused_weights_beside_their_onednn_copy_share_storage_with_the_hf_modules():
    """bf16 projections keep a row-major weight (the fused decode step reads it) beside the oneDNN-packed
    one (prefill): the HF modules read that row-major weight, not a copy of their own."""
    tok = byte_tokenizer()
    runner = ModelRunner(tiny_model("llama", vocab_size=len(tok)), tok, dtype="bfloat16")
    lw, attn, mlp = runner.fast_layers[0], runner.layers[0].self_attn, runner.layers[0].mlp
    if lw.qkv.kind != "mkldnn":
        pytest.skip("no oneDNN bf16 packing on this CPU")
    assert attn.k_proj.weight.data_ptr() == lw.qkv.weight[lw.q_out:].data_ptr()
    assert mlp.up_proj.weight.data_ptr() == lw.gate_up.weight[lw.ff:].data_ptr()
    assert torch.equal(attn.v_proj.weight, lw.qkv.weight[lw.q_out + lw.kv_out:])


@pytest.mark.parametrize("weights", FORMATS)
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


@pytest.mark.parametrize("weights", FORMATS)
def test_low_precision_decode_equals_its_own_prefill(weights):
    """Within one numerics, the one-token decode path (kernel rows) equals a prefill of the same tokens
    (oneDNN rows on the same weights): decode adds no error of its own."""
    tok = byte_tokenizer()
    runner = ModelRunner(tiny_model("llama", vocab_size=len(tok)), tok, dtype="bfloat16", weights=weights)
    ids = torch.randint(0, 256, (40,), generator=torch.Generator().manual_seed(2))
    want = runner.prefill(ids, kv=runner.new_kv(40), all_logits=True)  # [40, V]
    kv = runner.new_kv(40)
    runner.prefill(ids[:36], kv=kv)
    for pos in range(36, 40):
        got = runner.decode_step(int(ids[pos]), pos, kv)
        assert (got - want[pos]).abs().max() < 0.05 * want[pos].std() + 0.05


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


def test_weight_format_is_part_of_the_chunk_cache_namespace():
    """Caches computed with int4 (or int8) weights never serve a runner of another format of the same model."""
    from cachedrag.engine import CachedEngine

    tok = byte_tokenizer()
    digests = {}
    formats = ("dense", "int8", "int4") + (("int8-dynamic",) if vnni_available() else ())
    for weights in formats:
        engine = CachedEngine(ModelRunner(tiny_model("llama", vocab_size=len(tok)), tok, dtype="bfloat16", weights=weights))
        assert engine.model_namespace.dtype == engine.runner.numerics.tag
        digests[weights] = engine.model_namespace.digest
    assert "int4w-g32" in Numerics(weights="int4").tag
    assert len(set(digests.values())) == len(formats)


def test_int4_runner_reads_an_int8_lm_head_and_the_dense_one_on_request():
    """int4 runners read the LM head as int8 rows (``head_numerics``); ``head_weights="dense"`` keeps
    it bf16 (the reference). The head writes no KV: the numerics tag and every K/V row are the same."""
    runners = {h: tiny_runner(weights="int4", head_weights=h) for h in ("auto", "dense")}
    fast, ref = runners["auto"], runners["dense"]
    assert fast.numerics.tag == ref.numerics.tag == "bfloat16+int4w-g32"
    assert {lw.qkv.kind for lw in fast.fast_layers} == {"int4"}
    assert fast.fast_head.kind == "int8" and fast.fast_head.qweight.dtype == torch.int8
    assert ref.fast_head.kind in ("mkldnn", "dense") and ref.fast_head.weight.dtype == torch.bfloat16
    assert tiny_runner(weights="int8", head_weights="dense").fast_head.kind in ("mkldnn", "dense")
    with pytest.raises(ConfigError, match="head_weights"):
        tiny_runner(weights="int4", head_weights="int4")


@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_quantised_lm_head_is_close_to_the_dense_head(weights):
    """The int8 head (fast) against the bf16 head (reference) on the same runner weights: all-position
    prefill logits and a decode step's within 2% of the logits' spread, greedy tokens mostly alike,
    and the KV bit for bit (the head computes no KV)."""
    runners = {h: tiny_runner(weights=weights, head_weights=h, decode_step="torch") for h in ("auto", "dense")}
    ids = torch.arange(3, 40)  # [37]
    kvs = {h: r.new_kv(48) for h, r in runners.items()}
    logits = {h: r.prefill(ids, kv=kvs[h], all_logits=True) for h, r in runners.items()}  # [T, V] each
    want = logits["dense"]
    spread = (want.amax(-1) - want.amin(-1))[:, None]  # [T, 1]
    assert ((logits["auto"] - want).abs() / spread).max() < 0.02
    assert (logits["auto"].argmax(-1) == want.argmax(-1)).float().mean() >= 0.9
    assert torch.equal(kvs["auto"].k, kvs["dense"].k) and torch.equal(kvs["auto"].v, kvs["dense"].v)
    step = {h: r.decode_step(7, 37, kvs[h]) for h, r in runners.items()}  # [V] each
    assert (step["auto"] - step["dense"]).abs().max() < 0.02 * (step["dense"].max() - step["dense"].min())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_rms_norm_as_one_layer_norm_equals_the_hf_arithmetic(dtype):
    """The decode step's RMSNorm (LayerNorm of [x, -x]) against LlamaRMSNorm's arithmetic: float32
    to float rounding; bfloat16 rows within one bf16 rounding step (same order: normalise in float32,
    round, then the bf16 weight), nearly all bitwise."""
    from cachedrag.model.runner import _rms_norm, _rms_norm_rows

    g = torch.Generator().manual_seed(5)
    x = (torch.randn(3, 576, generator=g) * torch.rand(3, 1, generator=g) * 8).to(dtype)  # [T, Dm]
    x[0, 7] = 60.0  # an outlier channel, as real hidden states have
    w = (torch.rand(576, generator=g) + 0.5).to(dtype)  # [Dm]
    want = _rms_norm(x, w, 1e-5)
    prepared = torch.cat([w, torch.zeros_like(w)]) if dtype == torch.float32 else w  # as ModelRunner._norm_weights
    got = _rms_norm_rows(x, prepared, 1e-5)
    assert got.shape == want.shape and got.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    else:
        torch.testing.assert_close(got.float(), want.float(), atol=0, rtol=2 ** -7)
        assert (got == want).float().mean() > 0.99
