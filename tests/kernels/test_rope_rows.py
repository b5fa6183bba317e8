"""RoPE of fresh rows with the K/V write: Triton kernel == torch reference (interpreter on CPU, compiled
on CUDA: bit for bit), reference == the runner's ``Rotary.apply`` + ``index_copy_``."""

from __future__ import annotations

import pytest
import torch

from cachedrag.kernels import rope_rows, rope_rows_reference, triton_available
from cachedrag.model.rope import Rotary

needs_triton = pytest.mark.skipif(not triton_available(), reason="triton does not import here")

# Triton's interpreter truncates float32 -> bfloat16 casts: interpreted bf16 is within an ulp or two; fp32/fp16 exact.
BF16_ULP = 2 ** -7


def _case(h_q, h_kv, t, d, cap, dtype, device="cpu"):
    rotary = Rotary(1.0 / 10000 ** (torch.arange(0, d, 2).float() / d), attention_scaling=1.25)
    cos, sin = rotary.cos_sin(torch.arange(cap), dtype, device)  # [C, D] each
    qkv = torch.randn(t, (h_q + 2 * h_kv) * d, device=device).to(dtype)  # [T, (H_q + 2 H_kv) D] one projection
    q = qkv[:, :h_q * d].view(t, h_q, d).transpose(0, 1)  # [H_q, T, D] strided views, as the runner has them
    k = qkv[:, h_q * d:(h_q + h_kv) * d].view(t, h_kv, d).transpose(0, 1)  # [H_kv, T, D]
    v = qkv[:, (h_q + h_kv) * d:].view(t, h_kv, d).transpose(0, 1)  # [H_kv, T, D]
    pos = torch.randperm(cap, device=device)[:t]  # [T]
    k_out = torch.randn(h_kv, cap, d, device=device).to(dtype)  # [H_kv, C, D]
    v_out = torch.randn(h_kv, cap, d, device=device).to(dtype)
    return rotary, q, k, v, cos, sin, pos, k_out, v_out


CASES = [
    pytest.param(4, 2, 1, 16, 32, torch.float32, id="decode-row-fp32"),
    pytest.param(4, 2, 1, 16, 32, torch.bfloat16, id="decode-row-bf16"),
    pytest.param(6, 3, 5, 24, 40, torch.float16, id="rows-half-not-pow2-fp16"),
    pytest.param(2, 2, 3, 8, 9, torch.bfloat16, id="mha-bf16"),
]


@needs_triton
@pytest.mark.parametrize("h_q,h_kv,t,d,cap,dtype", CASES)
def test_triton_matches_reference(h_q, h_kv, t, d, cap, dtype):
    _, q, k, v, cos, sin, pos, k_out, v_out = _case(h_q, h_kv, t, d, cap, dtype)
    k_ref, v_ref = k_out.clone(), v_out.clone()
    want = rope_rows_reference(q, k, v, cos, sin, pos, k_ref, v_ref)
    got = rope_rows(q, k, v, cos, sin, pos, k_out, v_out, backend="triton")
    assert got.backend.name == "triton" and got.backend.interpreted
    assert got.q.shape == (h_q, t, d) and got.q.dtype == dtype
    assert torch.equal(v_out, v_ref)  # V rows are copied
    untouched = torch.ones(cap, dtype=torch.bool)
    untouched[pos] = False
    assert torch.equal(k_out[:, untouched], k_ref[:, untouched])  # other rows keep their contents
    if dtype == torch.bfloat16:
        for a, b in ((got.q, want), (k_out, k_ref)):
            # a sum of two truncated products: off by up to an ulp of the products' size
            scale = float(b.abs().max())
            torch.testing.assert_close(a.float(), b.float(), atol=2 * BF16_ULP * scale, rtol=2 * BF16_ULP)
    else:
        assert torch.equal(got.q, want) and torch.equal(k_out, k_ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_is_the_runners_rope(dtype):
    rotary, q, k, v, cos, sin, pos, k_out, v_out = _case(4, 2, 3, 16, 20, dtype)
    table = (cos[pos], sin[pos])  # [T, D] each
    want_q = rotary.apply(q, pos, table)
    want_k = k_out.clone()
    want_k[:, pos] = rotary.apply(k, pos, table)
    got_q = rope_rows_reference(q, k, v, cos, sin, pos, k_out, v_out)
    assert torch.equal(got_q, want_q) and torch.equal(k_out, want_k)
    assert torch.equal(v_out[:, pos], v)


def test_boundaries_are_checked():
    _, q, k, v, cos, sin, pos, k_out, v_out = _case(4, 2, 1, 16, 8, torch.float32)
    with pytest.raises(TypeError, match="cos dtype"):
        rope_rows(q, k, v, cos.half(), sin, pos, k_out, v_out, backend="torch")
    with pytest.raises(ValueError, match="positions must be int64"):
        rope_rows(q, k, v, cos, sin, pos.int(), k_out, v_out, backend="torch")
    with pytest.raises(ValueError, match="k_out and v_out"):
        rope_rows(q, k, v, cos, sin, pos, k_out[:1], v_out[:1], backend="torch")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_compiled_on_cuda_is_the_reference_bit_for_bit(dtype):
    _, q, k, v, cos, sin, pos, k_out, v_out = _case(32, 8, 1, 128, 300, dtype, device="cuda")
    k_ref, v_ref = k_out.clone(), v_out.clone()
    want = rope_rows_reference(q, k, v, cos, sin, pos, k_ref, v_ref)
    got = rope_rows(q, k, v, cos, sin, pos, k_out, v_out, backend="triton")
    assert not got.backend.interpreted
    assert torch.equal(got.q, want) and torch.equal(k_out, k_ref) and torch.equal(v_out, v_ref)


@needs_triton
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_table_rows_read_a_prefills_own_cos_sin_rows(backend):
    # a prefill holds cos/sin for its own rows only ([T, D]): table_rows = arange(T), positions the buffer rows
    _, q, k, v, cos, sin, pos, k_out, v_out = _case(4, 2, 7, 16, 40, torch.float32)
    k_ref, v_ref = k_out.clone(), v_out.clone()
    want = rope_rows(q, k, v, cos, sin, pos, k_ref, v_ref, backend=backend).q  # full table, read by position
    own_cos, own_sin = cos[pos].contiguous(), sin[pos].contiguous()  # [T, D] each
    got = rope_rows(q, k, v, own_cos, own_sin, pos, k_out, v_out, table_rows=torch.arange(7), backend=backend)
    assert torch.equal(got.q, want) and torch.equal(k_out, k_ref) and torch.equal(v_out, v_ref)
    with pytest.raises(ValueError, match="table_rows"):
        rope_rows(q, k, v, own_cos, own_sin, pos, k_out, v_out, table_rows=torch.arange(6), backend=backend)
