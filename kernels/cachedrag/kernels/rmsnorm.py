"""RMSNorm of rows, optionally after a residual add: a Triton kernel and its torch reference.

Owns: ``y = weight * (x * rsqrt(mean(x^2) + eps)).to(x.dtype)`` over the last dim of each row, the
arithmetic of Hugging Face's ``LlamaRMSNorm`` (Qwen2, Qwen3 and Mistral use the same form): x in
float32, normalised, rounded to the input dtype, then multiplied by the weight in the promoted
dtype of the two (bf16 x bf16: the exact float32 product rounded to bf16, as torch does). With
``residual`` the row is first ``h = residual + x`` rounded to the input dtype (torch's add), ``h``
is returned too and normalised: the decode step's ``h = h + delta; norm(h)`` in one launch.

Why our own: HF's module is ~8 elementwise kernels per call on CUDA (cast, pow, mean, add, rsqrt,
mul, cast, weight mul), two calls per layer plus the residual adds; inside the CUDA-graph decode
step (``cachedrag/model/cuda_graph.py``) each is a 1-2.5 us launch, and together they were a third
of the step of an 8B model. One program per row reads it once and writes the result once.

Does not own: which modules are plain RMSNorms (the runner checks), Gemma's ``(1 + weight)``
form, or anything but the last dim.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ._dispatch import (
    FLOAT_DTYPES,
    SUM_COMBINE,
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

__all__ = ["MAX_ROW", "RMSNormResult", "rmsnorm", "rmsnorm_reference"]

#: longest row one program normalises (it holds the whole row in registers)
MAX_ROW = 32768


class RMSNormResult(NamedTuple):
    """Output of :func:`rmsnorm`: ``out`` the normalised rows (``x``'s shape, the promoted dtype of
    ``x`` and the weight), ``hidden`` the summed rows ``residual + x`` (``x``'s dtype) or None
    without a residual; ``backend`` says what ran."""

    out: torch.Tensor
    hidden: torch.Tensor | None
    backend: Backend


# ----------------------------------------------------------------------------------------------
# public entry point


def rmsnorm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    *,
    residual: torch.Tensor | None = None,
    backend: BackendRequest = "auto",
) -> RMSNormResult:
    """RMSNorm of the rows of ``x`` (``[..., N]``, fp32/fp16/bf16) with ``weight`` ``[N]``.

    ``residual``: same shape and dtype as ``x``; the rows normalised are then ``residual + x``
    (returned as ``hidden``). ``backend``: ``"auto"`` | ``"triton"`` | ``"torch"``
    (see ``cachedrag.kernels._dispatch``). Launches nothing that depends on values (graph-safe).
    """
    _check_args(x, weight, residual)
    chosen = which_backend(x, weight, residual, backend=backend)
    if x.numel() == 0:
        out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
        return RMSNormResult(out, None if residual is None else x + residual, chosen)
    if chosen.name == "triton":
        out, hidden = _rmsnorm_triton(x, weight, eps, residual)
    else:
        out, hidden = _rmsnorm_torch(x, weight, eps, residual)
    return RMSNormResult(out, hidden, chosen)


def rmsnorm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float,
                      residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The torch reference of :func:`rmsnorm` (same checks): ``(out, hidden or None)``."""
    _check_args(x, weight, residual)
    return _rmsnorm_torch(x, weight, eps, residual)


# ----------------------------------------------------------------------------------------------
# boundary checks


def _check_args(x, weight, residual) -> None:
    check(isinstance(x, torch.Tensor) and x.dim() >= 1, f"x must be [..., N], got {_shape(x)}")
    check(x.dtype in FLOAT_DTYPES, f"x dtype must be one of {FLOAT_DTYPES}, got {x.dtype}", TypeError)
    n = x.shape[-1]
    check(isinstance(weight, torch.Tensor) and weight.dim() == 1 and weight.shape[0] == n,
          f"weight must be [N={n}], got {_shape(weight)}")
    check(weight.dtype in FLOAT_DTYPES, f"weight dtype must be one of {FLOAT_DTYPES}, got {weight.dtype}", TypeError)
    if residual is not None:
        check(isinstance(residual, torch.Tensor) and residual.shape == x.shape,
              f"residual must be x's shape {tuple(x.shape)}, got {_shape(residual)}")
        check(residual.dtype == x.dtype, f"residual dtype {residual.dtype} must equal x dtype {x.dtype}", TypeError)


def _shape(x) -> str:
    return str(tuple(x.shape)) if isinstance(x, torch.Tensor) else type(x).__name__


# ----------------------------------------------------------------------------------------------
# torch reference


def _rmsnorm_torch(x, weight, eps, residual):
    hidden = None
    if residual is not None:
        x = hidden = residual + x  # [..., N] rounded to x's dtype
    xf = x.to(torch.float32)  # [..., N]
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)  # [..., N] float32
    return weight * normed.to(x.dtype), hidden  # [..., N] HF LlamaRMSNorm's order


# ----------------------------------------------------------------------------------------------
# Triton kernel


def _rmsnorm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, hid_ptr,
    N, eps,
    stride_x, stride_r, stride_o, stride_h,
    HAS_RES: tl.constexpr, LIBDEVICE: tl.constexpr, BLOCK: tl.constexpr,
):
    # One program per row; the row lives in registers between the two passes over it.
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)  # [B]
    mask = offs < N
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)  # [B] input dtype
    if HAS_RES:
        r = tl.load(res_ptr + row * stride_r + offs, mask=mask, other=0.0)
        x = (r.to(tl.float32) + x.to(tl.float32)).to(x_ptr.dtype.element_ty)  # torch's add, rounded
        tl.store(hid_ptr + row * stride_h + offs, x, mask=mask)
    xf = x.to(tl.float32)  # [B]
    var = tl.reduce(xf * xf, 0, SUM_COMBINE) / N  # masked lanes are 0
    if LIBDEVICE:  # rsqrtf, what torch's CUDA rsqrt calls
        rstd = libdevice.rsqrt(var + eps)
    else:  # interpreter (libdevice does not run there)
        rstd = 1.0 / tl.sqrt(var + eps)
    normed = (xf * rstd).to(x_ptr.dtype.element_ty)  # rounded to the input dtype
    w = tl.load(w_ptr + offs, mask=mask, other=0.0)
    y = normed.to(tl.float32) * w.to(tl.float32)  # exact for two bf16/fp16 values
    tl.store(out_ptr + row * stride_o + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def _rmsnorm_triton(x, weight, eps, residual):
    shape = x.shape
    n = shape[-1]
    check(n <= MAX_ROW, f"rows of {n} elements: the Triton kernel takes at most {MAX_ROW} (use the reference)")
    x2 = x.reshape(-1, n)  # [R, N] (a view where it can be)
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    rows = x2.shape[0]
    out = torch.empty(shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device).view(rows, n)
    weight = weight if weight.stride(0) == 1 else weight.contiguous()
    if residual is not None:
        r2 = residual.reshape(rows, n)  # [R, N]
        r2 = r2 if r2.stride(-1) == 1 else r2.contiguous()
        hidden = torch.empty(shape, dtype=x.dtype, device=x.device).view(rows, n)  # [R, N]
    else:
        r2 = hidden = x2
    interp = interpreting()
    block = next_power_of_2(n)
    # ~8 elements per thread: 4096 (Llama-3-8B) on 16 warps
    launch = {} if interp else dict(num_warps=max(1, min(16, block // 256)))
    jit(_rmsnorm_kernel)[(rows,)](
        x2, r2, weight, out, hidden,
        n, float(eps),
        x2.stride(0), r2.stride(0), out.stride(0), hidden.stride(0),
        HAS_RES=residual is not None, LIBDEVICE=not interp, BLOCK=block,
        **launch,
    )
    return out.view(shape), (hidden.view(shape) if residual is not None else None)
