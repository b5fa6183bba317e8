"""RoPE re-rotation: Triton kernel == torch reference (interpreter on CPU), reference == explicit RoPE."""

from __future__ import annotations

import pytest
import torch

from cachedrag.kernels import rerotate, rerotate_reference, triton_available

needs_triton = pytest.mark.skipif(not triton_available(), reason="triton does not import here")

TOL = {  # (atol, rtol) between two fp32-computed results stored in the dtype (1 ulp of slack)
    torch.float32: (1e-5, 1e-5),
    torch.float16: (2e-3, 1e-3),
    torch.bfloat16: (2e-2, 1e-2),
}


def inv_freq_for(D: int, base: float = 10000.0) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, D, 2, dtype=torch.float32) / D))  # [D/2]


def rope_naive(x: torch.Tensor, pos: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Hugging Face RoPE written out literally, in float64."""
    f = pos[:, None].float() * inv_freq[None, :]  # [T, D/2] float32 angles, as HF computes them
    emb = torch.cat([f, f], dim=-1).double()  # [T, D]
    x = x.double()  # [H, T, D]
    half = x.shape[-1] // 2
    rotate_half = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * emb.cos() + rotate_half * emb.sin()


# --- Triton == reference ------------------------------------------------------------------------

CASES = [
    # H, T, D, dtype, with_old, with_out
    pytest.param(1, 1, 16, torch.float32, False, False, id="one-row-one-head"),
    pytest.param(2, 7, 16, torch.float16, True, False, id="odd-T-fp16-old"),
    pytest.param(3, 13, 32, torch.bfloat16, False, True, id="bf16-out-rows"),
    pytest.param(8, 33, 64, torch.float32, True, True, id="8-heads-old-out"),
    pytest.param(2, 5, 24, torch.float32, False, False, id="half-dim-not-pow2"),
    pytest.param(4, 17, 16, torch.float16, True, True, id="fp16-old-out"),
    pytest.param(12, 9, 32, torch.bfloat16, True, True, id="12-heads-two-head-groups"),
]


@needs_triton
@pytest.mark.parametrize("H,T,D,dtype,with_old,with_out", CASES)
def test_triton_matches_reference(H, T, D, dtype, with_old, with_out):
    inv_freq = inv_freq_for(D)
    k = torch.randn(H, T, D).to(dtype)  # [H, T, D]
    new = torch.randint(0, 8192, (T,))  # [T] gapped, unsorted absolute positions
    old = torch.randint(0, 512, (T,)) if with_old else None
    kwargs = {}
    if with_out:
        total = T + 9
        buf = torch.randn(H, total, D).to(dtype)  # [H, T_total, D]
        kwargs = dict(out_rows=torch.randperm(total)[:T])
        ref = rerotate_reference(k, new, inv_freq, old_positions=old, out=buf.clone(), **kwargs)
        got = rerotate(k, new, inv_freq, old_positions=old, out=buf.clone(), backend="triton", **kwargs)
        untouched = torch.ones(total, dtype=torch.bool)
        untouched[kwargs["out_rows"]] = False
        assert torch.equal(got.k[:, untouched], buf[:, untouched])  # other rows keep their contents
    else:
        ref = rerotate_reference(k, new, inv_freq, old_positions=old)
        got = rerotate(k, new, inv_freq, old_positions=old, backend="triton")
    assert got.backend.name == "triton" and got.backend.interpreted
    assert got.k.dtype == dtype and got.k.shape == ref.shape
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(got.k.float(), ref.float(), atol=atol, rtol=rtol)


@needs_triton
def test_triton_non_contiguous_input_and_in_place():
    D, inv_freq = 16, inv_freq_for(16)
    k = torch.randn(11, 3, D).transpose(0, 1)  # [3, 11, D] view, heads not outermost in memory
    pos = torch.arange(100, 111)
    ref = rerotate_reference(k, pos, inv_freq)
    torch.testing.assert_close(rerotate(k, pos, inv_freq, backend="triton").k, ref, atol=1e-5, rtol=1e-5)
    buf = k.contiguous()  # in place: each row written back where it was read
    got = rerotate(buf, pos, inv_freq, out=buf, out_rows=torch.arange(11), backend="triton")
    assert got.k is buf
    torch.testing.assert_close(buf, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", [pytest.param("triton", marks=needs_triton), "torch"])
def test_empty_rows(backend):
    k = torch.randn(2, 0, 16)
    got = rerotate(k, torch.zeros(0, dtype=torch.long), inv_freq_for(16), backend=backend)
    assert got.k.shape == (2, 0, 16)


def test_auto_on_cpu_runs_reference():
    got = rerotate(torch.randn(2, 3, 16), torch.arange(3), inv_freq_for(16))
    assert got.backend.name == "torch" and "cpu" in got.backend.reason


# --- reference == explicit RoPE -------------------------------------------------------------------


@pytest.mark.parametrize("D", [16, 64, 128])
def test_reference_raw_equals_hf_rope(D):
    inv_freq = inv_freq_for(D)
    raw = torch.randn(3, 29, D)
    pos = torch.randint(0, 4096, (29,))
    got = rerotate_reference(raw, pos, inv_freq)
    torch.testing.assert_close(got.double(), rope_naive(raw, pos, inv_freq), atol=1e-5, rtol=1e-5)


def test_reference_moves_between_positions():
    """Rotated at old, re-rotated to new == raw rotated at new (rotations compose)."""
    D, inv_freq = 64, inv_freq_for(64)
    raw = torch.randn(2, 23, D)
    old = torch.arange(23)  # chunk computed standalone at 0..22
    new = torch.arange(23) + 1500  # reused after 1500 tokens of other chunks
    at_old = rope_naive(raw, old, inv_freq).float()
    got = rerotate_reference(at_old, new, inv_freq, old_positions=old)
    torch.testing.assert_close(got.double(), rope_naive(raw, new, inv_freq), atol=2e-4, rtol=1e-4)


def test_reference_matches_transformers_apply_rotary_pos_emb():
    llama = pytest.importorskip("transformers.models.llama.modeling_llama")
    D, inv_freq = 64, inv_freq_for(64, base=500000.0)
    raw = torch.randn(1, 4, 19, D)  # [B, H, T, D]
    pos = torch.randint(0, 8000, (19,))
    f = pos[:, None].float() * inv_freq[None, :]
    emb = torch.cat([f, f], dim=-1)[None]  # [1, T, D]
    _, want = llama.apply_rotary_pos_emb(raw, raw, emb.cos(), emb.sin())
    got = rerotate_reference(raw[0], pos, inv_freq)
    torch.testing.assert_close(got, want[0], atol=1e-5, rtol=1e-5)


def test_reference_writes_rows_and_dtypes():
    inv_freq = inv_freq_for(16)
    raw = torch.randn(2, 4, 16).to(torch.bfloat16)
    buf = torch.zeros(2, 10, 16, dtype=torch.bfloat16)
    rows = torch.tensor([9, 0, 5, 3])
    out = rerotate_reference(raw, rows, inv_freq, out=buf, out_rows=rows)
    assert out is buf
    want = rope_naive(raw, rows, inv_freq)
    torch.testing.assert_close(buf[:, rows].double(), want.to(torch.bfloat16).double(), atol=2e-2, rtol=1e-2)
    assert buf[:, [1, 2, 4, 6, 7, 8]].abs().sum() == 0


# --- boundary checks -----------------------------------------------------------------------------


def test_partial_rotary_refused():
    with pytest.raises(ValueError, match="partial rotary"):
        rerotate(torch.randn(2, 3, 64), torch.arange(3), inv_freq_for(32))


@pytest.mark.parametrize(
    "make, exc, match",
    [
        (lambda: (torch.randn(3, 16), torch.arange(3), {}), ValueError, r"\[H_kv, T, D\]"),
        (lambda: (torch.randn(2, 3, 16).long(), torch.arange(3), {}), TypeError, "dtype"),
        (lambda: (torch.randn(2, 3, 15), torch.arange(3), {}), ValueError, "even"),
        (lambda: (torch.randn(2, 3, 16), torch.arange(4), {}), ValueError, "new_positions"),
        (lambda: (torch.randn(2, 3, 16), torch.arange(3.0), {}), TypeError, "integer"),
        (lambda: (torch.randn(2, 3, 16), torch.arange(3), {"out": torch.zeros(2, 5, 16)}), ValueError, "together"),
        (lambda: (torch.randn(2, 3, 16), torch.arange(3),
                  {"out": torch.zeros(2, 5, 16), "out_rows": torch.tensor([0, 1, 5])}), ValueError, "out_rows"),
        (lambda: (torch.randn(2, 3, 16), torch.arange(3),
                  {"out": torch.zeros(2, 5, 16).half(), "out_rows": torch.arange(3)}), TypeError, "out dtype"),
        (lambda: (torch.randn(2, 3, 16), torch.arange(3), {"old_positions": torch.arange(2)}),
         ValueError, "old_positions"),
    ],
)
def test_bad_arguments(make, exc, match):
    k, pos, kwargs = make()
    with pytest.raises(exc, match=match):
        rerotate(k, pos, inv_freq_for(16), **kwargs)


# --- GPU at real sizes ---------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_gpu_rerotate_8k(dtype):
    dev, H, total, D = "cuda", 8, 8192, 128
    inv_freq = inv_freq_for(D, base=500000.0).to(dev)
    rows = torch.randperm(total, device=dev)[: int(total * 0.85)].sort().values  # [T]
    raw = torch.randn(H, rows.numel(), D, device=dev).to(dtype)
    buf = torch.zeros(H, total, D, device=dev, dtype=dtype)
    got = rerotate(raw, rows, inv_freq, out=buf.clone(), out_rows=rows)
    assert got.backend.name == "triton" and not got.backend.interpreted
    ref = rerotate_reference(raw, rows, inv_freq, out=buf.clone(), out_rows=rows)
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(got.k.float(), ref.float(), atol=max(atol, 1e-4), rtol=rtol)
    moved = rerotate(got.k[:, rows], rows + 100, inv_freq, old_positions=rows).k
    want = rerotate_reference(raw, rows + 100, inv_freq)
    torch.testing.assert_close(moved.float(), want.float(), atol=max(atol, 1e-3) * 4, rtol=rtol * 4)
