"""RMSNorm rows: Triton kernel == torch reference (interpreter on CPU, compiled on CUDA), reference == HF's module."""

from __future__ import annotations

import pytest
import torch

from cachedrag.kernels import rmsnorm, rmsnorm_reference, triton_available

needs_triton = pytest.mark.skipif(not triton_available(), reason="triton does not import here")

# relative size of one ulp. Triton's interpreter rounds float32 -> bfloat16 by truncation (its cast, not
# the kernel's arithmetic): interpreted bf16 results sit up to 3 ulp (three roundings) from the reference.
ULP = {torch.float32: 2e-6, torch.float16: 2 ** -10, torch.bfloat16: 2 ** -7}

CASES = [
    # rows shape, N, dtype, with residual
    pytest.param((1,), 64, torch.float32, False, id="one-row-fp32"),
    pytest.param((3,), 37, torch.float32, True, id="odd-n-fp32-residual"),
    pytest.param((1,), 128, torch.bfloat16, True, id="one-row-bf16-residual"),
    pytest.param((2, 3), 100, torch.bfloat16, False, id="3d-odd-n-bf16"),
    pytest.param((5,), 48, torch.float16, True, id="fp16-residual"),
    pytest.param((4,), 1, torch.float32, False, id="n-1"),
]


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, ulps: float = 1.01) -> None:
    rel = ULP[dtype]
    torch.testing.assert_close(got.float(), want.float(), atol=rel * 1e-2, rtol=rel * ulps)


@needs_triton
@pytest.mark.parametrize("rows,n,dtype,with_res", CASES)
def test_triton_matches_reference(rows, n, dtype, with_res):
    x = (torch.randn(*rows, n) * 3).to(dtype)  # [..., N]
    w = (torch.randn(n) + 1).to(dtype)  # [N]
    res = torch.randn(*rows, n).to(dtype) if with_res else None
    want, want_h = rmsnorm_reference(x, w, 1e-5, residual=res)
    got = rmsnorm(x, w, 1e-5, residual=res, backend="triton")
    assert got.backend.name == "triton" and got.backend.interpreted
    assert got.out.shape == x.shape and got.out.dtype == dtype
    _close(got.out, want, dtype, ulps=3.02 if dtype == torch.bfloat16 else 1.01)  # hidden, normed, product
    if with_res:
        assert got.hidden.dtype == dtype
        _close(got.hidden, want_h, dtype)
    else:
        assert got.hidden is None and want_h is None


@needs_triton
def test_strided_rows_and_mixed_weight_dtype():
    """Rows of a wider tensor (a view with a row stride) and an fp32 weight on bf16 rows (fp32 out, as torch)."""
    x = torch.randn(4, 80)[:, 8:72].to(torch.bfloat16)  # [4, 64] view, row stride 80
    w = torch.randn(64)  # float32
    want, _ = rmsnorm_reference(x, w, 1e-6)
    got = rmsnorm(x, w, 1e-6, backend="triton").out
    assert got.dtype == torch.float32 == want.dtype
    torch.testing.assert_close(got, want, atol=1e-2, rtol=2 ** -7)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_is_hf_llama_rmsnorm(dtype):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    norm = LlamaRMSNorm(96, eps=1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(96))
    x = torch.randn(3, 96).to(dtype)
    r = torch.randn(3, 96).to(dtype)
    out, h = rmsnorm_reference(x, norm.weight.detach(), 1e-5, residual=r)
    assert torch.equal(h, r + x)
    assert torch.equal(out, norm(r + x))
    assert torch.equal(rmsnorm(x, norm.weight.detach(), 1e-5, backend="torch").out, norm(x))


def test_boundaries_are_checked():
    x = torch.randn(2, 8)
    with pytest.raises(ValueError, match="weight must be"):
        rmsnorm(x, torch.ones(7), 1e-6, backend="torch")
    with pytest.raises(ValueError, match="residual must be"):
        rmsnorm(x, torch.ones(8), 1e-6, residual=torch.randn(1, 8), backend="torch")
    with pytest.raises(TypeError, match="residual dtype"):
        rmsnorm(x, torch.ones(8), 1e-6, residual=torch.randn(2, 8).half(), backend="torch")
    with pytest.raises(TypeError, match="x dtype"):
        rmsnorm(x.double(), torch.ones(8), 1e-6, backend="torch")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n", [4096, 100])
def test_compiled_on_cuda_matches_reference(dtype, n):
    x = (torch.randn(3, n, device="cuda") * 3).to(dtype)  # [3, N]
    w = (torch.randn(n, device="cuda") + 1).to(dtype)
    r = torch.randn(3, n, device="cuda").to(dtype)
    want, want_h = rmsnorm_reference(x, w, 1e-5, residual=r)
    got = rmsnorm(x, w, 1e-5, residual=r, backend="triton")
    assert got.backend.name == "triton" and not got.backend.interpreted
    assert torch.equal(got.hidden, want_h)  # the add is one rounding either way
    _close(got.out, want, dtype)  # rsqrt and the sum's order may flip a rounding
    if dtype != torch.float32:  # float32 differs in its last bits; rounded to 16 bits nearly all are equal
        assert (got.out == want).float().mean() > 0.99
