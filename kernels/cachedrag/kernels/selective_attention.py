"""Selective-recompute attention: a flash-style Triton kernel and its torch reference.

Owns: attention of a sparse, gapped set of query positions (the tokens being recomputed, fresh
tokens and the question) over a request's working KV buffer, with an absolute-position causal
mask, grouped-query heads, and optionally the per-segment attention mass that the chunk-cache
metadata (inter/intra attention) is built from.

Does not own: projections, RoPE (``rerotate.py``; queries arrive rotated), choosing which tokens
to recompute, or writing fresh K/V into the buffer (the engine does that before calling this).

Semantics (both backends)::

    q [H_q, T_q, D], k, v [H_kv, T_k, D], G = H_q / H_kv, query head h reads kv head h // G
    key j is visible to query i  iff  j <= q_positions[i]  and  j < kv_len
    out[h, i] = softmax_j(scale * q[h, i] . k[h // G, j]) @ v[h // G, j]   over visible j
    segment_mass[i, s] = sum_h sum_{bounds[s] <= j < bounds[s+1]} softmax weight of (h, i, j)

so each row of ``segment_mass`` sums to ``H_q`` (divide by ``H_q`` for the mean over heads).

Kernel layout: one program owns BLOCK_M "packed" rows of one kv head: row r is query
``r // G`` of q head ``kv_head * G + r % G``, so every K/V tile is loaded once for all G heads
that share it (no repeat_interleave, no copies). Keys are visited in BLOCK_N tiles up to the
largest visible key of the program's rows; softmax is online (running max and sum, rescaled),
so no T_q x T_k matrix exists. The segment mass is accumulated in the same pass: each tile adds
``p @ onehot`` (``[BLOCK_M, BLOCK_N] @ [BLOCK_N, S]``, a tensor-core dot) to a per-row
accumulator that is rescaled with the running max exactly like the output accumulator, and is
divided by the final softmax sum at the end. Per-head masses are written to a small
``[H_q, T_q, S]`` float32 buffer and summed over heads in torch (deterministic, no atomics).

Precision: fp16/bf16 inputs use tensor-core dots with float32 accumulation (softmax weights cast
to the input dtype for ``p @ V``, as flash attention does); fp32 inputs use exact ("ieee") dots
on small tiles; the segment-mass dot is tf32 (it is metadata). The reference is float32 throughout.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import torch

from ._dispatch import (
    FLOAT_DTYPES,
    MAX_COMBINE,
    SUM_COMBINE,
    Backend,
    BackendRequest,
    check,
    interpreting,
    jit,
    next_power_of_2,
    tl,
    tl_dtype,
    which_backend,
)

__all__ = ["AttentionResult", "MAX_SEGMENTS", "selective_attention", "selective_attention_reference"]

MAX_SEGMENTS = 256  # the kernel keeps one float32 accumulator per (row, segment) in registers
_LOG2E = 1.4426950408889634


class AttentionResult(NamedTuple):
    """Output of :func:`selective_attention`.

    ``out`` ``[H_q, T_q, D]`` (q's dtype); ``segment_mass`` ``[T_q, S]`` float32 or None when no
    ``segment_bounds`` were given; ``backend`` says what ran.
    """

    out: torch.Tensor
    segment_mass: torch.Tensor | None
    backend: Backend


# ----------------------------------------------------------------------------------------------
# public entry point


def selective_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_positions: torch.Tensor,
    *,
    kv_len: int | None = None,
    scale: float | None = None,
    segment_bounds: Sequence[int] | torch.Tensor | None = None,
    backend: BackendRequest = "auto",
    validate: bool = True,
) -> AttentionResult:
    """Attention of queries at absolute positions over a working KV buffer.

    Args:
        q: ``[H_q, T_q, D]`` queries (already rotated) at ``q_positions``.
        k, v: ``[H_kv, T_k, D]`` working buffer; row j holds absolute position j.
        q_positions: ``[T_q]`` integer absolute positions, usually sorted and gapped (any order
            is correct; sorted keeps each program's key range tight).
        kv_len: keys at rows ``>= kv_len`` are ignored (default ``T_k``); ``1 <= kv_len <= T_k``.
        scale: softmax scale, default ``1 / sqrt(D)``.
        segment_bounds: optional ``S + 1`` non-decreasing ints with ``bounds[0] == 0`` and
            ``bounds[-1] == T_k``; then ``segment_mass`` ``[T_q, S]`` is returned too.
        backend: ``"auto"`` | ``"triton"`` | ``"torch"`` (see ``cachedrag.kernels._dispatch``).
        validate: check ``q_positions >= 0`` (one host sync); pass False on a hot path whose
            positions are known valid.
    """
    q_positions, kv_len, scale, bounds = _check_args(q, k, v, q_positions, kv_len, scale, segment_bounds, validate)
    chosen = which_backend(q, k, v, q_positions, backend=backend)
    if q.shape[1] == 0:
        n_seg = None if bounds is None else len(bounds) - 1
        mass = None if n_seg is None else torch.zeros(0, n_seg, dtype=torch.float32, device=q.device)
        return AttentionResult(torch.empty_like(q), mass, chosen)
    if chosen.name == "triton":
        out, mass = _attention_triton(q, k, v, q_positions, kv_len, scale, bounds)
    else:
        out, mass = _attention_torch(q, k, v, q_positions, kv_len, scale, bounds)
    return AttentionResult(out, mass, chosen)


def selective_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_positions: torch.Tensor,
    *,
    kv_len: int | None = None,
    scale: float | None = None,
    segment_bounds: Sequence[int] | torch.Tensor | None = None,
    query_chunk: int = 256,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The torch reference of :func:`selective_attention`: returns ``(out, segment_mass)``.

    Float32 arithmetic; queries are processed ``query_chunk`` at a time, each chunk against the
    keys up to its largest visible one, so memory stays ``O(H_q x query_chunk x T_k)``.
    """
    q_positions, kv_len, scale, bounds = _check_args(q, k, v, q_positions, kv_len, scale, segment_bounds, True)
    return _attention_torch(q, k, v, q_positions, kv_len, scale, bounds, query_chunk)


# ----------------------------------------------------------------------------------------------
# boundary checks


def _check_args(q, k, v, q_positions, kv_len, scale, segment_bounds, validate):
    for name, x in (("q", q), ("k", k), ("v", v)):
        check(isinstance(x, torch.Tensor) and x.dim() == 3, f"{name} must be 3-d [H, T, D], got {_shape(x)}")
        check(x.dtype in FLOAT_DTYPES, f"{name} dtype must be one of {FLOAT_DTYPES}, got {x.dtype}", TypeError)
    check(q.dtype == k.dtype == v.dtype, f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}", TypeError)
    H_q, T_q, D = q.shape
    H_kv, T_k, D_k = k.shape
    check(v.shape == k.shape, f"v must have k's shape {tuple(k.shape)}, got {tuple(v.shape)}")
    check(D_k == D, f"q head dim {D} != k head dim {D_k}")
    check(H_kv >= 1 and H_q % H_kv == 0, f"H_q={H_q} must be a multiple of H_kv={H_kv} (GQA)")
    check(isinstance(q_positions, torch.Tensor) and q_positions.dim() == 1 and q_positions.shape[0] == T_q,
          f"q_positions must be [T_q={T_q}], got {_shape(q_positions)}")
    check(not q_positions.is_floating_point() and q_positions.dtype != torch.bool,
          f"q_positions must be an integer tensor, got {q_positions.dtype}", TypeError)
    q_positions = q_positions.to(torch.int64).contiguous()  # [T_q]
    kv_len = T_k if kv_len is None else int(kv_len)
    check(1 <= kv_len <= T_k, f"kv_len must be in [1, T_k={T_k}], got {kv_len}")
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    if validate and T_q > 0:
        lo = int(q_positions.min())
        check(lo >= 0, f"q_positions must be >= 0 (a query sees keys 0..pos), got min {lo}")
    bounds = None
    if segment_bounds is not None:
        bounds = [int(b) for b in (segment_bounds.tolist() if isinstance(segment_bounds, torch.Tensor)
                                   else segment_bounds)]
        check(len(bounds) >= 2, f"segment_bounds needs S + 1 >= 2 values, got {bounds}")
        check(bounds[0] == 0 and bounds[-1] == T_k,
              f"segment_bounds must start at 0 and end at T_k={T_k}, got {bounds[0]}..{bounds[-1]}")
        check(all(a <= b for a, b in zip(bounds, bounds[1:])), "segment_bounds must be non-decreasing")
        check(len(bounds) - 1 <= MAX_SEGMENTS, f"at most {MAX_SEGMENTS} segments, got {len(bounds) - 1}")
    return q_positions, kv_len, scale, bounds


def _shape(x) -> str:
    return str(tuple(x.shape)) if isinstance(x, torch.Tensor) else type(x).__name__


# ----------------------------------------------------------------------------------------------
# torch reference


def _attention_torch(q, k, v, q_positions, kv_len, scale, bounds, query_chunk=256):
    H_q, T_q, D = q.shape
    H_kv = k.shape[0]
    G = H_q // H_kv
    kf = k[:, :kv_len].to(torch.float32)  # [H_kv, kv_len, D]
    vf = v[:, :kv_len].to(torch.float32)  # [H_kv, kv_len, D]
    out = torch.empty_like(q)  # [H_q, T_q, D]
    mass, onehot = None, None
    if bounds is not None:
        b = torch.tensor(bounds, dtype=torch.int64, device=q.device)  # [S + 1]
        keys = torch.arange(kv_len, device=q.device)[:, None]  # [kv_len, 1]
        onehot = ((keys >= b[None, :-1]) & (keys < b[None, 1:])).to(torch.float32)  # [kv_len, S]
        mass = torch.empty(T_q, len(bounds) - 1, dtype=torch.float32, device=q.device)  # [T_q, S]
    for c0 in range(0, T_q, query_chunk):
        c1 = min(c0 + query_chunk, T_q)
        pos = q_positions[c0:c1]  # [n]
        hi = min(kv_len, int(pos.max()) + 1)
        qc = (q[:, c0:c1].to(torch.float32) * scale).reshape(H_kv, G, c1 - c0, D)  # [H_kv, G, n, D]
        scores = torch.matmul(qc, kf[:, None, :hi].transpose(-1, -2))  # [H_kv, G, n, hi]
        hidden = torch.arange(hi, device=q.device)[None, :] > pos[:, None]  # [n, hi]
        probs = torch.softmax(scores.masked_fill_(hidden, float("-inf")), dim=-1)  # [H_kv, G, n, hi]
        out[:, c0:c1] = torch.matmul(probs, vf[:, None, :hi]).reshape(H_q, c1 - c0, D).to(q.dtype)
        if mass is not None:
            mass[c0:c1] = probs.sum(dim=(0, 1)) @ onehot[:hi]  # [n, S]
    return out, mass


# ----------------------------------------------------------------------------------------------
# Triton kernel


def _attention_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, qpos_ptr, bounds_ptr, mass_ptr,
    T_q, kv_len, G, S, qk_scale,
    stride_qh, stride_qt, stride_kh, stride_kt, stride_vh, stride_vt, stride_oh, stride_ot,
    stride_mh, stride_mt,
    HEAD_DIM: tl.constexpr, HAS_SEG: tl.constexpr, DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
):
    # Offsets inside a tensor (q, out, mass) or inside one kv head's slab are int32 (the host
    # checks they fit); the kv head's base is a 64-bit scalar. int32 offset tiles keep registers low.
    pid_m = tl.program_id(0)
    kv_head = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM] packed (query, head-in-group) rows
    row_ok = rows < T_q * G
    t = rows // G  # [BM] query index
    h = kv_head * G + rows % G  # [BM] q head
    offs_d = tl.arange(0, BLOCK_D)  # [BD]
    d_ok = offs_d < HEAD_DIM  # all true (folded away) when D is a power of two
    qpos = tl.load(qpos_ptr + t, mask=row_ok, other=0).to(tl.int32)  # [BM]; padding rows see key 0 only

    q = tl.load(q_ptr + h[:, None] * stride_qh + t[:, None] * stride_qt + offs_d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)  # [BM, BD]
    q = q.to(DOT_DTYPE)
    k_base = k_ptr + kv_head.to(tl.int64) * stride_kh
    v_base = v_ptr + kv_head.to(tl.int64) * stride_vh

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running max (log2 domain)
    l_i = tl.full([BLOCK_M], 0.0, tl.float32)  # running sum of exp2
    acc = tl.full([BLOCK_M, BLOCK_D], 0.0, tl.float32)
    if HAS_SEG:
        offs_s = tl.arange(0, BLOCK_S)
        seg_lo = tl.load(bounds_ptr + offs_s, mask=offs_s < S, other=0).to(tl.int32)  # [BS]
        seg_hi = tl.load(bounds_ptr + offs_s + 1, mask=offs_s < S, other=0).to(tl.int32)  # [BS]; padding: empty
        seg_acc = tl.full([BLOCK_M, BLOCK_S], 0.0, tl.float32)

    # keys past every row's position are never visited
    hi = tl.minimum(tl.reduce(qpos, 0, MAX_COMBINE) + 1, kv_len)
    for start_n in range(0, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)  # [BN]
        kv_mask = (offs_n < hi)[:, None] & d_ok[None, :]  # [BN, BD]
        kt = tl.load(k_base + offs_n[:, None] * stride_kt + offs_d[None, :], mask=kv_mask, other=0.0)  # [BN, BD]
        s = tl.dot(q, tl.trans(kt.to(DOT_DTYPE)), input_precision=DOT_PRECISION) * qk_scale  # [BM, BN]
        visible = (offs_n[None, :] <= qpos[:, None]) & (offs_n[None, :] < kv_len)  # [BM, BN]
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.reduce(s, 1, MAX_COMBINE))  # finite: key 0 is visible to every row
        alpha = tl.exp2(m_i - m_new)  # [BM]
        p = tl.exp2(s - m_new[:, None])  # [BM, BN]
        l_i = l_i * alpha + tl.reduce(p, 1, SUM_COMBINE)
        vt = tl.load(v_base + offs_n[:, None] * stride_vt + offs_d[None, :], mask=kv_mask, other=0.0)  # [BN, BD]
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(DOT_DTYPE), vt.to(DOT_DTYPE), acc, input_precision=DOT_PRECISION)
        if HAS_SEG:
            onehot = (offs_n[:, None] >= seg_lo[None, :]) & (offs_n[:, None] < seg_hi[None, :])  # [BN, BS]
            seg_acc = seg_acc * alpha[:, None]
            seg_acc = tl.dot(p, onehot.to(tl.float32), seg_acc, input_precision="tf32")  # metadata: tf32 is plenty
        m_i = m_new

    out = acc / l_i[:, None]  # [BM, BD]
    tl.store(o_ptr + h[:, None] * stride_oh + t[:, None] * stride_ot + offs_d[None, :],
             out.to(o_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    if HAS_SEG:
        mass = seg_acc / l_i[:, None]  # [BM, BS]
        tl.store(mass_ptr + h[:, None] * stride_mh + t[:, None] * stride_mt + offs_s[None, :],
                 mass, mask=row_ok[:, None] & (offs_s < S)[None, :])


def _attention_config(dtype: torch.dtype, D: int, n_rows: int, block_s: int, interp: bool) -> dict:
    """Tile sizes and launch options.

    Compiled values were chosen for sm_90 from ptxas resource usage (compiled on a machine
    without a GPU: registers <= 255 and no spills); their speed is untuned until measured with
    ``cachedrag bench kernels`` on a GPU. block_s is 0 without segments.
    """
    if interp:  # small tiles so tests cover several programs and key tiles cheaply
        return dict(BLOCK_M=16, BLOCK_N=16, num_warps=4, num_stages=1)
    if dtype == torch.float32:  # exact fp32 dots run on CUDA cores: small tiles or they spill
        return dict(BLOCK_M=16 if D > 64 else 32, BLOCK_N=32, num_warps=4, num_stages=2)
    stages = 3 if D <= 128 else 2
    if block_s >= 128:  # many segments: the [BLOCK_M, BLOCK_S] mass accumulator needs room
        return dict(BLOCK_M=32, BLOCK_N=64, num_warps=8, num_stages=stages)
    if block_s > 0 or n_rows <= 2048:  # mass accumulator, or few rows: more, smaller programs
        return dict(BLOCK_M=64, BLOCK_N=64, num_warps=8, num_stages=stages)
    return dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=stages)


def _attention_triton(q, k, v, q_positions, kv_len, scale, bounds):
    q = q if q.stride(-1) == 1 else q.contiguous()  # [H_q, T_q, D]
    k = k if k.stride(-1) == 1 else k.contiguous()  # [H_kv, T_k, D]
    v = v if v.stride(-1) == 1 else v.contiguous()  # [H_kv, T_k, D]
    H_q, T_q, D = q.shape
    H_kv = k.shape[0]
    G = H_q // H_kv
    _check_int32_offsets(q, "q")
    _check_int32_offsets(k[0], "one head of k")
    _check_int32_offsets(v[0], "one head of v")
    interp = interpreting()
    out = torch.empty_like(q)  # [H_q, T_q, D]
    has_seg = bounds is not None
    if has_seg:
        S = len(bounds) - 1
        bounds_t = torch.tensor(bounds, dtype=torch.int64)  # [S + 1]
        if q.device.type == "cuda":  # page-locked, so the copy does not make the host wait for the GPU
            bounds_t = bounds_t.pin_memory()
        bounds_t = bounds_t.to(q.device, non_blocking=True)
        mass_h = torch.empty(H_q, T_q, S, dtype=torch.float32, device=q.device)  # [H_q, T_q, S]
    else:
        S = 1
        bounds_t = q_positions  # unused
        mass_h = out  # unused
    # The interpreter's bf16 dot multiplies raw bit patterns (triton 3.x); dot in fp32 there.
    dot_dtype = tl.float32 if (interp and q.dtype == torch.bfloat16) else tl_dtype(q.dtype)
    block_s = max(16, next_power_of_2(S))
    cfg = _attention_config(q.dtype, D, T_q * G, block_s if has_seg else 0, interp)
    block_m, block_n = cfg.pop("BLOCK_M"), cfg.pop("BLOCK_N")
    launch = {} if interp else dict(cfg, enable_fp_fusion=True)  # FMA; pinned across versions
    grid = ((T_q * G + block_m - 1) // block_m, H_kv)
    jit(_attention_kernel)[grid](
        q, k, v, out, q_positions, bounds_t, mass_h,
        T_q, kv_len, G, S, scale * _LOG2E,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), out.stride(0), out.stride(1),
        mass_h.stride(0), mass_h.stride(1),
        HEAD_DIM=D, HAS_SEG=has_seg, DOT_DTYPE=dot_dtype,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=max(16, next_power_of_2(D)),
        BLOCK_S=block_s,
        **launch,
    )
    mass = mass_h.sum(dim=0) if has_seg else None  # [T_q, S]
    return out, mass


def _check_int32_offsets(x: torch.Tensor, name: str) -> None:
    """The kernel addresses q/out/mass and each kv head's slab with int32 element offsets."""
    last = sum((n - 1) * st for n, st in zip(x.shape, x.stride())) if x.numel() else 0
    check(last < 2**31, f"{name} spans {last + 1} elements; the Triton kernel needs < 2**31 (split the call)")
