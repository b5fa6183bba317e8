"""RoPE of fresh q/k rows from cos/sin tables, with the K/V rows written into the buffer: a Triton
kernel and its torch reference.

Owns: rotating the raw q and k of ``T`` rows (a decode step: one) to their positions with rows of
precomputed ``cos``/``sin`` tables (``Rotary.cos_sin``: attention scaling folded in, stored in the
model dtype), returning the rotated q and writing the rotated k and the v of each row into row
``positions[t]`` of the layer's K/V buffer. The arithmetic is ``Rotary.apply``'s op for op in the
storage dtype, ``x * cos + rotate_half(x) * sin`` with each product and the sum rounded as torch
rounds them, so the result equals the eager step's bit for bit (no FMA contraction; tests).

Why our own: the eager ops are ~12 launches per layer (index_select of the table rows, rotate_half
as neg + cat, mul, mul, add for q and for k, and two ``index_copy_``); inside the CUDA-graph decode
step (``cachedrag/model/cuda_graph.py``) each launch is 1-2.5 us, longer than the work. One launch,
one program per (row, head), reads the table rows by position on the device (no host sync).

Does not own: the tables (``cachedrag/model/rope.py``), re-rotation of cached keys
(``rerotate.py``: float32 angles computed in the kernel), or attention.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ._dispatch import (
    FLOAT_DTYPES,
    Backend,
    BackendRequest,
    check,
    interpreting,
    jit,
    next_power_of_2,
    tl,
    which_backend,
)

__all__ = ["RopeRowsResult", "rope_rows", "rope_rows_reference"]


class RopeRowsResult(NamedTuple):
    """Output of :func:`rope_rows`: ``q`` the rotated queries ``[H_q, T, D]`` (a new tensor);
    ``k_out`` / ``v_out`` the buffers the rows went into; ``backend`` says what ran."""

    q: torch.Tensor
    k_out: torch.Tensor
    v_out: torch.Tensor
    backend: Backend


# ----------------------------------------------------------------------------------------------
# public entry point


def rope_rows(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
    k_out: torch.Tensor,
    v_out: torch.Tensor,
    *,
    table_rows: torch.Tensor | None = None,
    backend: BackendRequest = "auto",
) -> RopeRowsResult:
    """Rotate ``q`` ``[H_q, T, D]`` and ``k`` ``[H_kv, T, D]`` (raw, pre-RoPE; any strides with the
    last dim contiguous) to ``positions`` ``[T]`` (int64, on the device) with rows ``positions`` of
    ``cos``/``sin`` ``[P, D]``; write rotated k and ``v`` ``[H_kv, T, D]`` into rows ``positions`` of
    ``k_out``/``v_out`` ``[H_kv, C, D]``. ``table_rows`` ``[T]`` (int64, on the device): the rows of
    ``cos``/``sin`` to read instead of ``positions`` (a prefill's tables hold only its own rows:
    ``arange(T)``). Positions are not range-checked (that would read the device): every
    ``positions[t]`` must be below ``C`` and every table row below ``P``."""
    table_rows = positions if table_rows is None else table_rows
    _check_args(q, k, v, cos, sin, positions, k_out, v_out, table_rows)
    chosen = which_backend(q, k, v, cos, sin, positions, k_out, v_out, backend=backend)
    if q.shape[1] == 0:
        return RopeRowsResult(q.clone(), k_out, v_out, chosen)
    if chosen.name == "triton":
        q_rot = _rope_rows_triton(q, k, v, cos, sin, positions, k_out, v_out, table_rows)
    else:
        q_rot = _rope_rows_torch(q, k, v, cos, sin, positions, k_out, v_out, table_rows)
    return RopeRowsResult(q_rot, k_out, v_out, chosen)


def rope_rows_reference(q, k, v, cos, sin, positions, k_out, v_out, table_rows=None) -> torch.Tensor:
    """The torch reference of :func:`rope_rows` (same arguments and checks); returns the rotated q."""
    table_rows = positions if table_rows is None else table_rows
    _check_args(q, k, v, cos, sin, positions, k_out, v_out, table_rows)
    return _rope_rows_torch(q, k, v, cos, sin, positions, k_out, v_out, table_rows)


# ----------------------------------------------------------------------------------------------
# boundary checks


def _check_args(q, k, v, cos, sin, positions, k_out, v_out, table_rows) -> None:
    for name, x in (("q", q), ("k", k), ("v", v), ("k_out", k_out), ("v_out", v_out)):
        check(isinstance(x, torch.Tensor) and x.dim() == 3, f"{name} must be [H, T, D], got {_shape(x)}")
        check(x.stride(-1) == 1, f"{name} must be contiguous in its last (head) dimension")
    dtype = q.dtype
    check(dtype in FLOAT_DTYPES, f"q dtype must be one of {FLOAT_DTYPES}, got {dtype}", TypeError)
    _, t, d = q.shape
    h_kv = k.shape[0]
    check(d % 2 == 0, f"head dim must be even for RoPE, got D={d}")
    check(k.shape == (h_kv, t, d) and v.shape == (h_kv, t, d),
          f"k and v must be [H_kv, T={t}, D={d}], got {tuple(k.shape)} and {tuple(v.shape)}")
    check(k_out.shape[0] == h_kv and k_out.shape[2] == d and v_out.shape == k_out.shape,
          f"k_out and v_out must be [H_kv={h_kv}, C, D={d}], got {tuple(k_out.shape)} and {tuple(v_out.shape)}")
    for name, x in (("cos", cos), ("sin", sin)):
        check(isinstance(x, torch.Tensor) and x.dim() == 2 and x.shape[1] == d and x.stride(-1) == 1,
              f"{name} must be [P, D={d}] contiguous in D, got {_shape(x)}")
    for name, x in (("k", k), ("v", v), ("cos", cos), ("sin", sin), ("k_out", k_out), ("v_out", v_out)):
        check(x.dtype == dtype, f"{name} dtype {x.dtype} must equal q dtype {dtype}", TypeError)
    for name, x in (("positions", positions), ("table_rows", table_rows)):
        check(isinstance(x, torch.Tensor) and x.dtype == torch.int64 and x.shape == (t,),
              f"{name} must be int64 [T={t}], got {_shape(x)} {getattr(x, 'dtype', '')}")


def _shape(x) -> str:
    return str(tuple(x.shape)) if isinstance(x, torch.Tensor) else type(x).__name__


# ----------------------------------------------------------------------------------------------
# torch reference


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _rope_rows_torch(q, k, v, cos, sin, positions, k_out, v_out, table_rows):
    c, s = cos.index_select(0, table_rows), sin.index_select(0, table_rows)  # [T, D] each
    q_rot = q * c + _rotate_half(q) * s  # [H_q, T, D] Rotary.apply's ops
    k_rot = k * c + _rotate_half(k) * s  # [H_kv, T, D]
    k_out.index_copy_(1, positions, k_rot)  # rows of [H_kv, C, D]
    v_out.index_copy_(1, positions, v)
    return q_rot


# ----------------------------------------------------------------------------------------------
# Triton kernel


def _rope_rows_kernel(
    q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, pos_ptr, tab_ptr, qo_ptr, ko_ptr, vo_ptr,
    H_Q, HALF,
    stride_qh, stride_qt, stride_kh, stride_kt, stride_vh, stride_vt, stride_c, stride_s,
    stride_qoh, stride_qot, stride_koh, stride_kot, stride_voh, stride_vot,
    BLOCK_HALF: tl.constexpr,
):
    # One program per (row t, head h): heads [0, H_Q) are q's, the rest k's (and v's) in order.
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    offs = tl.arange(0, BLOCK_HALF)  # [BH]
    mask = offs < HALF
    pos = tl.load(pos_ptr + t)  # int64 scalar: the buffer row
    row = tl.load(tab_ptr + t)  # int64 scalar: the cos/sin row
    c1 = tl.load(cos_ptr + row * stride_c + offs, mask=mask, other=0.0).to(tl.float32)  # [BH]
    c2 = tl.load(cos_ptr + row * stride_c + HALF + offs, mask=mask, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + row * stride_s + offs, mask=mask, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + row * stride_s + HALF + offs, mask=mask, other=0.0).to(tl.float32)
    dt = qo_ptr.dtype.element_ty
    if h < H_Q:
        src = q_ptr + h * stride_qh + t * stride_qt
        dst = qo_ptr + h * stride_qoh + t * stride_qot
    else:
        src = k_ptr + (h - H_Q) * stride_kh + t * stride_kt
        dst = ko_ptr + (h - H_Q) * stride_koh + pos * stride_kot
        vsrc = v_ptr + (h - H_Q) * stride_vh + t * stride_vt
        vdst = vo_ptr + (h - H_Q) * stride_voh + pos * stride_vot
        tl.store(vdst + offs, tl.load(vsrc + offs, mask=mask), mask=mask)
        tl.store(vdst + HALF + offs, tl.load(vsrc + HALF + offs, mask=mask), mask=mask)
    x1 = tl.load(src + offs, mask=mask, other=0.0).to(tl.float32)  # [BH]
    x2 = tl.load(src + HALF + offs, mask=mask, other=0.0).to(tl.float32)
    # x * cos + rotate_half(x) * sin, rotate_half(x) = (-x2, x1); every op rounded to the storage dtype
    o1 = (x1 * c1).to(dt).to(tl.float32) + ((-x2) * s1).to(dt).to(tl.float32)
    o2 = (x2 * c2).to(dt).to(tl.float32) + (x1 * s2).to(dt).to(tl.float32)
    tl.store(dst + offs, o1.to(dt), mask=mask)
    tl.store(dst + HALF + offs, o2.to(dt), mask=mask)


def _rope_rows_triton(q, k, v, cos, sin, positions, k_out, v_out, table_rows):
    h_q, t, d = q.shape
    half = d // 2
    q_rot = torch.empty((h_q, t, d), dtype=q.dtype, device=q.device)  # [H_q, T, D]
    positions = positions if positions.stride(0) == 1 else positions.contiguous()
    table_rows = table_rows if table_rows.stride(0) == 1 else table_rows.contiguous()
    interp = interpreting()
    # no FMA contraction: float32 storage must round the products as torch's separate mul and add do
    launch = {} if interp else dict(num_warps=1, enable_fp_fusion=False)
    jit(_rope_rows_kernel)[(t, h_q + k.shape[0])](
        q, k, v, cos, sin, positions, table_rows, q_rot, k_out, v_out,
        h_q, half,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos.stride(0), sin.stride(0),
        q_rot.stride(0), q_rot.stride(1), k_out.stride(0), k_out.stride(1), v_out.stride(0), v_out.stride(1),
        BLOCK_HALF=next_power_of_2(half),
        **launch,
    )
    return q_rot
