"""Selective attention: Triton kernel == torch reference (interpreter on CPU), reference == dense attention."""

from __future__ import annotations

import math

import pytest
import torch

from cachedrag.kernels import MAX_SEGMENTS, selective_attention, selective_attention_reference, triton_available

needs_triton = pytest.mark.skipif(not triton_available(), reason="triton does not import here")

TOL = {torch.float32: (2e-5, 2e-5), torch.float16: (3e-3, 3e-3), torch.bfloat16: (2e-2, 2e-2)}
MASS_TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-3}  # per (query, segment), summed over heads


def dense_attention(q_full, k, v, kv_len=None, scale=None):
    """Full T x T causal attention of every position, GQA by repeat_interleave, in float64.

    Returns (out [H_q, T, D], probs [H_q, T, T]).
    """
    H_q, T, D = q_full.shape
    G = H_q // k.shape[0]
    kv_len = T if kv_len is None else kv_len
    kk = k.double().repeat_interleave(G, dim=0)  # [H_q, T, D]
    vv = v.double().repeat_interleave(G, dim=0)
    scores = q_full.double() @ kk.transpose(-1, -2) * (scale or 1 / math.sqrt(D))  # [H_q, T, T]
    j = torch.arange(T)
    visible = (j[None, :] <= j[:, None]) & (j[None, :] < kv_len)  # [T, T]
    probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
    return probs @ vv, probs


def seg_mass_dense(probs_rows, bounds):
    """[H_q, T_q, T] -> [T_q, S] attention mass per segment, summed over heads."""
    summed = probs_rows.sum(0)
    return torch.stack([summed[:, a:b].sum(-1) for a, b in zip(bounds, bounds[1:])], dim=-1)


def make(H_kv, G, T_k, positions, D, dtype):
    q = torch.randn(H_kv * G, len(positions), D).to(dtype)  # [H_q, T_q, D]
    k = torch.randn(H_kv, T_k, D).to(dtype)  # [H_kv, T_k, D]
    v = torch.randn(H_kv, T_k, D).to(dtype)
    return q, k, v, torch.tensor(positions, dtype=torch.long)


# --- Triton == reference ------------------------------------------------------------------------

CASES = [
    # H_kv, G, T_k, positions, D, dtype, kv_len, bounds
    pytest.param(2, 1, 20, [19], 16, torch.float32, None, None, id="one-query-G1"),
    pytest.param(1, 3, 37, [0, 3, 4, 9, 20, 21, 36], 16, torch.float16, None, [0, 9, 10, 30, 37], id="G3-gaps-seg"),
    pytest.param(2, 4, 50, [1, 7, 8, 15, 16, 17, 31, 32, 33, 40, 44, 47], 32, torch.bfloat16, 45, [0, 16, 32, 50],
                 id="G4-bf16-kvlen-seg"),
    pytest.param(1, 4, 21, list(range(21)), 16, torch.float32, None, [0, 7, 14, 21], id="dense-prefill-G4"),
    pytest.param(3, 1, 33, [0], 16, torch.float16, None, [0, 1, 33], id="query-at-0"),
    pytest.param(1, 3, 40, [5, 12, 39], 24, torch.float32, 30, None, id="D24-positions-past-kvlen"),
    pytest.param(2, 2, 29, [28, 3, 17, 9], 16, torch.float32, None, [0, 5, 5, 29], id="unsorted-empty-segment"),
    pytest.param(1, 1, 70, [10, 33, 64, 69], 64, torch.bfloat16, None, list(range(0, 71, 10)), id="D64-many-segments"),
]


@needs_triton
@pytest.mark.parametrize("H_kv,G,T_k,positions,D,dtype,kv_len,bounds", CASES)
def test_triton_matches_reference(H_kv, G, T_k, positions, D, dtype, kv_len, bounds):
    q, k, v, pos = make(H_kv, G, T_k, positions, D, dtype)
    want_out, want_mass = selective_attention_reference(q, k, v, pos, kv_len=kv_len, segment_bounds=bounds)
    got = selective_attention(q, k, v, pos, kv_len=kv_len, segment_bounds=bounds, backend="triton")
    assert got.backend.name == "triton" and got.backend.interpreted
    assert got.out.dtype == dtype and got.out.shape == q.shape
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(got.out.float(), want_out.float(), atol=atol, rtol=rtol)
    if bounds is None:
        assert got.segment_mass is None
    else:
        assert got.segment_mass.shape == (len(positions), len(bounds) - 1)
        torch.testing.assert_close(got.segment_mass, want_mass, atol=MASS_TOL[dtype], rtol=0)
        torch.testing.assert_close(got.segment_mass.sum(-1), torch.full((len(positions),), float(H_kv * G)),
                                   atol=1e-3, rtol=0)


@needs_triton
def test_triton_custom_scale_and_strided_inputs():
    H_kv, G, T_k, D = 2, 2, 26, 16
    q = torch.randn(5, H_kv * G, D).transpose(0, 1)  # [H_q, T_q, D] view with non-standard strides
    kv = torch.randn(T_k, 2, H_kv, D)
    k, v = kv[:, 0].transpose(0, 1), kv[:, 1].transpose(0, 1)  # [H_kv, T_k, D] views
    pos = torch.tensor([2, 9, 10, 20, 25])
    want, _ = selective_attention_reference(q, k, v, pos, scale=0.3)
    got = selective_attention(q, k, v, pos, scale=0.3, backend="triton")
    torch.testing.assert_close(got.out, want, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("backend", [pytest.param("triton", marks=needs_triton), "torch"])
def test_no_queries(backend):
    q, k, v, pos = make(1, 2, 8, [], 16, torch.float32)
    got = selective_attention(q, k, v, pos, segment_bounds=[0, 4, 8], backend=backend)
    assert got.out.shape == (2, 0, 16) and got.segment_mass.shape == (0, 2)


def test_auto_on_cpu_runs_reference():
    q, k, v, pos = make(1, 2, 8, [3, 7], 16, torch.float32)
    got = selective_attention(q, k, v, pos)
    assert got.backend.name == "torch" and not got.backend.is_fallback


# --- reference == dense attention ---------------------------------------------------------------


@pytest.mark.parametrize(
    "H_kv,G,T,n_q,kv_len,query_chunk",
    [(1, 1, 17, 17, None, 256), (2, 3, 31, 6, None, 4), (2, 4, 40, 9, 33, 3), (1, 2, 12, 1, None, 256)],
)
def test_reference_equals_dense_rows(H_kv, G, T, n_q, kv_len, query_chunk):
    """Selective attention of a subset of positions == those rows of full causal attention."""
    D = 16
    q_full = torch.randn(H_kv * G, T, D)  # [H_q, T, D] queries of every position
    k, v = torch.randn(H_kv, T, D), torch.randn(H_kv, T, D)
    pos = torch.randperm(T)[:n_q].sort().values  # gapped, sorted
    bounds = [0, T // 3, T // 3 + 1, T]
    want_out, probs = dense_attention(q_full, k, v, kv_len=kv_len)
    out, mass = selective_attention_reference(q_full[:, pos], k, v, pos, kv_len=kv_len, segment_bounds=bounds,
                                              query_chunk=query_chunk)
    torch.testing.assert_close(out.double(), want_out[:, pos], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(mass.double(), seg_mass_dense(probs[:, pos], bounds), atol=1e-5, rtol=1e-5)


def test_reference_matches_sdpa_dense_mask():
    D = 32
    q, k, v, pos = make(2, 4, 64, [3, 10, 11, 40, 63], D, torch.float32)
    mask = torch.arange(64)[None, :] <= pos[:, None]  # [T_q, T_k]
    want = torch.nn.functional.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask,
                                                            enable_gqa=True)[0]
    out, _ = selective_attention_reference(q, k, v, pos)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)


# --- boundary checks -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "change, exc, match",
    [
        (dict(q=torch.randn(6, 2, 8)), ValueError, "head dim"),
        (dict(q=torch.randn(5, 2, 16)), ValueError, "multiple"),
        (dict(k=torch.randn(2, 10, 16).half()), TypeError, "share a dtype"),
        (dict(v=torch.randn(2, 9, 16)), ValueError, "v must have"),
        (dict(q_positions=torch.tensor([1, 2, 3])), ValueError, "q_positions"),
        (dict(q_positions=torch.tensor([-1, 2])), ValueError, ">= 0"),
        (dict(q_positions=torch.tensor([1.0, 2.0])), TypeError, "integer"),
        (dict(kv_len=0), ValueError, "kv_len"),
        (dict(kv_len=11), ValueError, "kv_len"),
        (dict(segment_bounds=[0, 5]), ValueError, "end at T_k"),
        (dict(segment_bounds=[0, 6, 5, 10]), ValueError, "non-decreasing"),
        (dict(segment_bounds=[0]), ValueError, "S \\+ 1"),
        (dict(segment_bounds=list(range(0, MAX_SEGMENTS + 2)) + [10**6]), ValueError, "end at|at most"),
        (dict(backend="cuda"), ValueError, "backend must be"),
    ],
)
def test_bad_arguments(change, exc, match):
    args = dict(q=torch.randn(6, 2, 16), k=torch.randn(2, 10, 16), v=torch.randn(2, 10, 16),
                q_positions=torch.tensor([3, 9]))
    kwargs = {name: change.pop(name) for name in list(change) if name not in args}
    args.update(change)
    with pytest.raises(exc, match=match):
        selective_attention(args["q"], args["k"], args["v"], args["q_positions"], **kwargs)


# --- GPU at real sizes ---------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("G", [1, 3, 4])
def test_gpu_attention_8k(dtype, G):
    dev, H_kv, T_k, D = "cuda", 8, 8192, 128
    n_q = int(T_k * 0.15)
    pos = torch.cat([torch.randperm(T_k - 1)[: n_q - 1].sort().values, torch.tensor([T_k - 1])]).to(dev)
    q = torch.randn(H_kv * G, n_q, D, device=dev).to(dtype)
    k = torch.randn(H_kv, T_k, D, device=dev).to(dtype)
    v = torch.randn(H_kv, T_k, D, device=dev).to(dtype)
    bounds = [0, 300] + list(range(512, T_k, 512)) + [T_k]
    got = selective_attention(q, k, v, pos, segment_bounds=bounds)
    assert got.backend.name == "triton" and not got.backend.interpreted
    want_out, want_mass = selective_attention_reference(q, k, v, pos, segment_bounds=bounds)
    atol = {torch.float32: 2e-3, torch.float16: 5e-3, torch.bfloat16: 3e-2}[dtype]
    torch.testing.assert_close(got.out.float(), want_out.float(), atol=atol, rtol=atol)
    torch.testing.assert_close(got.segment_mass, want_mass, atol=5e-3 * H_kv * G, rtol=0)
