"""RoPE re-rotation of cached keys: a fused Triton kernel and its torch reference.

Owns: moving keys from one set of absolute positions to another (or rotating raw, pre-RoPE keys
for the first time), optionally writing the result straight into rows of a request's working
KV buffer. All heads of a layer go in one launch; cos/sin are computed in the kernel (float32
angles, no tables in memory) once per row tile and reused for every head.

Does not own: choosing positions or rows (the recompute planner and engine do), the rotary
variant (default/linear/llama3 only change ``inv_freq``, which the caller passes), or queries.

Conventions (Hugging Face RoPE, fixed by the model runner):

    rotate_half(x) = cat(-x[..., D/2:], x[..., :D/2])
    x_rot = x * cos + rotate_half(x) * sin,  cos = cat(f, f).cos(),  f = pos.float()[:, None] * inv_freq

so with ``x = (x1, x2)`` split in halves: ``(x1 cos - x2 sin, x2 cos + x1 sin)``.
With ``old_positions`` the keys are rotated by the position difference ``new - old`` (computed in
int64, exact): rotations compose, so this equals un-rotating at old and rotating at new, with
one trig evaluation and no precision lost to large angles. Arithmetic is float32 whatever the
storage dtype. Partial rotary (``2 * len(inv_freq) != D``) is refused.
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
    libdevice,
    next_power_of_2,
    tl,
    which_backend,
)

__all__ = ["RerotateResult", "rerotate", "rerotate_reference"]


class RerotateResult(NamedTuple):
    """Output of :func:`rerotate`: ``k`` is the rotated keys ``[H_kv, T, D]``, or the whole
    ``out`` buffer ``[H_kv, T_total, D]`` when rows were written into it; ``backend`` says what ran."""

    k: torch.Tensor
    backend: Backend


# ----------------------------------------------------------------------------------------------
# public entry point


def rerotate(
    k: torch.Tensor,
    new_positions: torch.Tensor,
    inv_freq: torch.Tensor,
    *,
    old_positions: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    out_rows: torch.Tensor | None = None,
    backend: BackendRequest = "auto",
    validate: bool = True,
) -> RerotateResult:
    """Rotate keys to ``new_positions``.

    Args:
        k: ``[H_kv, T, D]`` raw (pre-RoPE) keys when ``old_positions`` is None, else keys rotated
            at ``old_positions``. fp32, fp16 or bf16.
        new_positions: ``[T]`` integer absolute positions to rotate to.
        inv_freq: ``[D/2]`` float32 RoPE inverse frequencies (any rotary variant's).
        old_positions: ``[T]`` positions ``k`` is currently rotated at, or None for raw keys.
        out: optional ``[H_kv, T_total, D]`` working buffer (same dtype/device as ``k``); the rows
            ``out_rows`` receive the result and the buffer is returned. Must not overlap ``k``
            except exactly in place (``out_rows[i]`` is the row ``k[:, i]`` lives in).
        out_rows: ``[T]`` int64 destination rows in ``out``; required with ``out`` and only with it.
        backend: ``"auto"`` | ``"triton"`` | ``"torch"`` (see ``cachedrag.kernels._dispatch``).
        validate: check row indices are in range (one host sync); the hot path may pass False
            once its plan is known to be valid.
    """
    new_positions, old_positions, inv_freq, out_rows = _check_args(
        k, new_positions, inv_freq, old_positions, out, out_rows, validate
    )
    chosen = which_backend(k, new_positions, inv_freq, old_positions, out, out_rows, backend=backend)
    if k.shape[1] == 0:
        return RerotateResult(out if out is not None else k.clone(), chosen)
    if chosen.name == "triton":
        result = _rerotate_triton(k, new_positions, inv_freq, old_positions, out, out_rows)
    else:
        result = _rerotate_torch(k, new_positions, inv_freq, old_positions, out, out_rows)
    return RerotateResult(result, chosen)


def rerotate_reference(
    k: torch.Tensor,
    new_positions: torch.Tensor,
    inv_freq: torch.Tensor,
    *,
    old_positions: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    out_rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """The torch reference of :func:`rerotate` (same arguments and checks); returns the tensor."""
    new_positions, old_positions, inv_freq, out_rows = _check_args(
        k, new_positions, inv_freq, old_positions, out, out_rows, True
    )
    return _rerotate_torch(k, new_positions, inv_freq, old_positions, out, out_rows)


# ----------------------------------------------------------------------------------------------
# boundary checks


def _check_args(k, new_positions, inv_freq, old_positions, out, out_rows, validate):
    check(isinstance(k, torch.Tensor) and k.dim() == 3, f"k must be [H_kv, T, D], got {_shape(k)}")
    check(k.dtype in FLOAT_DTYPES, f"k dtype must be one of {FLOAT_DTYPES}, got {k.dtype}", TypeError)
    H, T, D = k.shape
    check(D % 2 == 0, f"head dim must be even for RoPE, got D={D}")
    check(inv_freq.dim() == 1, f"inv_freq must be [D/2], got {tuple(inv_freq.shape)}")
    if 2 * inv_freq.shape[0] != D:
        raise ValueError(
            f"partial rotary is not supported: inv_freq has {inv_freq.shape[0]} frequencies "
            f"(rotary dim {2 * inv_freq.shape[0]}) but the head dim is {D}; need rotary dim == head dim"
        )
    check(inv_freq.is_floating_point(), f"inv_freq must be floating point, got {inv_freq.dtype}", TypeError)
    inv_freq = inv_freq.to(torch.float32).contiguous()  # [D/2]
    new_positions = _positions(new_positions, T, "new_positions")  # [T]
    if old_positions is not None:
        old_positions = _positions(old_positions, T, "old_positions")  # [T]
    check((out is None) == (out_rows is None), "out and out_rows go together: pass both or neither")
    if out is not None:
        check(out.dim() == 3 and out.shape[0] == H and out.shape[2] == D,
              f"out must be [H_kv={H}, T_total, D={D}], got {tuple(out.shape)}")
        check(out.dtype == k.dtype, f"out dtype {out.dtype} must equal k dtype {k.dtype}", TypeError)
        check(out.stride(-1) == 1, "out must be contiguous in its last (head) dimension")
        check(out_rows.dim() == 1 and out_rows.shape[0] == T,
              f"out_rows must be [T={T}], got {tuple(out_rows.shape)}")
        check(not out_rows.is_floating_point() and out_rows.dtype != torch.bool,
              f"out_rows must be an integer tensor, got {out_rows.dtype}", TypeError)
        out_rows = out_rows.to(torch.int64).contiguous()  # [T]
        if validate and T > 0:
            lo, hi = int(out_rows.min()), int(out_rows.max())
            check(lo >= 0 and hi < out.shape[1], f"out_rows must lie in [0, {out.shape[1]}), got [{lo}, {hi}]")
    return new_positions, old_positions, inv_freq, out_rows


def _positions(pos: torch.Tensor, T: int, name: str) -> torch.Tensor:
    check(isinstance(pos, torch.Tensor) and pos.dim() == 1 and pos.shape[0] == T,
          f"{name} must be [T={T}], got {_shape(pos)}")
    check(not pos.is_floating_point() and pos.dtype != torch.bool,
          f"{name} must be an integer tensor, got {pos.dtype}", TypeError)
    return pos.to(torch.int64).contiguous()  # [T]


def _shape(x) -> str:
    return str(tuple(x.shape)) if isinstance(x, torch.Tensor) else type(x).__name__


# ----------------------------------------------------------------------------------------------
# torch reference


def _rerotate_torch(k, new_positions, inv_freq, old_positions, out, out_rows):
    half = k.shape[-1] // 2
    delta = new_positions if old_positions is None else new_positions - old_positions  # [T] int64
    angle = delta.to(torch.float32)[:, None] * inv_freq[None, :]  # [T, D/2]
    cos, sin = angle.cos(), angle.sin()  # [T, D/2]
    x = k.to(torch.float32)  # [H, T, D]
    x1, x2 = x[..., :half], x[..., half:]  # [H, T, D/2]
    rotated = torch.empty_like(x)  # [H, T, D] float32
    torch.mul(x1, cos, out=rotated[..., :half]).addcmul_(x2, sin, value=-1)  # x1 cos - x2 sin
    torch.mul(x2, cos, out=rotated[..., half:]).addcmul_(x1, sin)  # x2 cos + x1 sin
    rotated = rotated.to(k.dtype)
    if out is None:
        return rotated
    out.index_copy_(1, out_rows, rotated)  # out[:, out_rows[i]] = rotated[:, i]
    return out


# ----------------------------------------------------------------------------------------------
# Triton kernel


def _rerotate_kernel(
    k_ptr, out_ptr, new_pos_ptr, old_pos_ptr, rows_ptr, inv_freq_ptr,
    H, T, HALF,
    stride_kh, stride_kt, stride_oh, stride_ot,
    HAS_OLD: tl.constexpr, HAS_ROWS: tl.constexpr, PRECISE_TRIG: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_HALF: tl.constexpr,
):
    # One program: BLOCK_T rows x all heads; cos/sin computed once for the tile. Offsets inside
    # one head are int32 (the host checks they fit); head bases advance as 64-bit scalar pointers.
    pid = tl.program_id(0)
    offs_t = pid * BLOCK_T + tl.arange(0, BLOCK_T)  # [BT]
    offs_f = tl.arange(0, BLOCK_HALF)  # [BF]
    mask_t = offs_t < T
    mask = mask_t[:, None] & (offs_f < HALF)[None, :]  # [BT, BF]

    pos = tl.load(new_pos_ptr + offs_t, mask=mask_t, other=0)  # [BT] int64
    if HAS_OLD:
        pos = pos - tl.load(old_pos_ptr + offs_t, mask=mask_t, other=0)
    inv_freq = tl.load(inv_freq_ptr + offs_f, mask=offs_f < HALF, other=0.0)  # [BF] fp32
    angle = pos.to(tl.float32)[:, None] * inv_freq[None, :]  # [BT, BF]
    if PRECISE_TRIG:  # libdevice: full range reduction, whatever tl.cos lowers to in a Triton version
        cos = libdevice.cos(angle)
        sin = libdevice.sin(angle)
    else:  # interpreter (libdevice does not run there): numpy's cos/sin
        cos = tl.cos(angle)
        sin = tl.sin(angle)

    if HAS_ROWS:
        rows = tl.load(rows_ptr + offs_t, mask=mask_t, other=0).to(tl.int32)  # [BT]
    else:
        rows = offs_t
    src_off = offs_t[:, None] * stride_kt + offs_f[None, :]  # [BT, BF] int32
    dst_off = rows[:, None] * stride_ot + offs_f[None, :]  # [BT, BF] int32
    k_head = k_ptr
    o_head = out_ptr
    for _ in range(0, H):
        x1 = tl.load(k_head + src_off, mask=mask, other=0.0).to(tl.float32)  # [BT, BF]
        x2 = tl.load(k_head + HALF + src_off, mask=mask, other=0.0).to(tl.float32)
        tl.store(o_head + dst_off, (x1 * cos - x2 * sin).to(out_ptr.dtype.element_ty), mask=mask)
        tl.store(o_head + HALF + dst_off, (x2 * cos + x1 * sin).to(out_ptr.dtype.element_ty), mask=mask)
        k_head += stride_kh
        o_head += stride_oh


def _rerotate_triton(k, new_positions, inv_freq, old_positions, out, out_rows):
    k = k if k.stride(-1) == 1 else k.contiguous()  # [H, T, D]
    H, T, D = k.shape
    half = D // 2
    target = torch.empty_like(k) if out is None else out  # [H, T, D] or [H, T_total, D]
    for x, name in ((k, "one head of k"), (target, "one head of out")):
        last = (x.shape[1] - 1) * x.stride(1) + D
        check(last < 2**31, f"{name} spans {last} elements; the Triton kernel needs < 2**31 (split the call)")
    interp = interpreting()
    block_half = next_power_of_2(half)
    # ~4 elements per thread per tile: 16 x 64 on 8 warps compiles to 62 registers, no spills (sm_90)
    block_t = 8 if interp else 16
    num_warps = max(1, min(8, block_t * block_half // 128))
    launch = {} if interp else dict(num_warps=num_warps, enable_fp_fusion=True)  # FMA; pinned across versions
    jit(_rerotate_kernel)[(_cdiv(T, block_t),)](
        k, target, new_positions,
        old_positions if old_positions is not None else new_positions,
        out_rows if out_rows is not None else new_positions,
        inv_freq,
        H, T, half,
        k.stride(0), k.stride(1), target.stride(0), target.stride(1),
        HAS_OLD=old_positions is not None, HAS_ROWS=out_rows is not None, PRECISE_TRIG=not interp,
        BLOCK_T=block_t, BLOCK_HALF=block_half,
        **launch,
    )
    return target


def _cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b
