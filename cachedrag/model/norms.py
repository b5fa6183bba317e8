"""RMSNorm arithmetic the runner's fast paths share.

Owns: ``rms_norm`` (LlamaRMSNorm's arithmetic), ``rms_norm_rows`` (the same for the decode step in a
few kernels: LayerNorm of ``[x, -x]``), ``plain_rms_norm`` (an HF norm's ``(weight, eps)`` when it
has ``LlamaRMSNorm``'s form) and ``RowNorms`` (every norm of a model for the row kernels).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """LlamaRMSNorm's arithmetic (float32 inside, weight applied in the input dtype). In float32
    ``F.rms_norm`` computes the same values in one fused op (bitwise equal, ~30% faster on one row,
    measured, torch 2.13); for bf16 it rounds differently from HF (weight applied in float32), so
    the HF arithmetic is spelled out (``F.rms_norm`` without a weight on the float32 row, then
    rounding and the weight, is bitwise equal with half the ops, but no faster inside a decode
    step: measured, docs/notes/speed.md)."""
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)  # [T, Dm]
    xf = x.float()  # [T, Dm]
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def rms_norm_rows(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``rms_norm`` for the decode step in 3-4 kernels instead of ~10: LayerNorm of ``[x, -x]``
    (mean 0, mean square equal to ``x``'s) is ``x * rsqrt(mean(x^2) + eps)`` on its first half, and
    ``F.layer_norm`` is one fused CPU kernel while ``F.rms_norm`` is composite on the CPU in torch
    2.13 (casts, pow, mean, add, rsqrt, mul: measured 1.0-1.5 ms of a decode step, docs/notes/speed.md).
    ``weight`` comes from ``RunnerDecode._norm_weights``: for float32 rows it is ``[w, 0]`` (``[2*Dm]``,
    applied inside the kernel; equal to ``F.rms_norm`` to float rounding, the mean of ``[x, -x]``
    is zero only up to it); for bfloat16 rows it is ``w`` (``[Dm]``), applied after the kernel's
    float32 arithmetic is rounded to bf16: HF's order (tests)."""
    n = x.shape[-1]
    both = torch.cat([x, x.neg()], -1)  # [T, 2*Dm]
    if weight.shape[-1] == 2 * n:
        return F.layer_norm(both, (2 * n,), weight, None, eps)[..., :n]  # [T, Dm]
    return weight * F.layer_norm(both, (2 * n,), None, None, eps)[..., :n]  # [T, Dm]


#: HF norm classes of LlamaRMSNorm's form (float32 inside, rounded, then ``weight *``): the row kernels' arithmetic
_PLAIN_RMS_NORMS = ("LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm")


def plain_rms_norm(module) -> tuple[torch.Tensor, float] | None:
    """``(weight [Dm], eps)`` of an HF norm of ``LlamaRMSNorm``'s form (by class: Llama, Mistral, Qwen2,
    Qwen3), else None (another form, e.g. Gemma's ``1 + weight``, keeps its own module)."""
    weight, eps = getattr(module, "weight", None), getattr(module, "variance_epsilon", None)
    if type(module).__name__ not in _PLAIN_RMS_NORMS or not isinstance(weight, torch.Tensor) or weight.dim() != 1:
        return None
    if getattr(module, "bias", None) is not None or not isinstance(eps, (int, float)):
        return None
    return weight.detach(), float(eps)


@dataclass(frozen=True)
class RowNorms:
    """Every RMSNorm of a model as ``(weight, eps)`` for the row kernels (``ModelRunner.row_norms``):
    per layer the input and post-attention norms, the per-head q/k norms (Qwen3) or None, and the final norm."""

    inputs: list[tuple[torch.Tensor, float]]
    posts: list[tuple[torch.Tensor, float]]
    qk: list[tuple[tuple[torch.Tensor, float], tuple[torch.Tensor, float]] | None]
    final: tuple[torch.Tensor, float]
