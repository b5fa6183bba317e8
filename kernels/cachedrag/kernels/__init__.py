"""cachedrag.kernels: the GPU kernels of the prefill and decode paths, each with a torch reference.

Owns: RoPE re-rotation of cached keys (:func:`rerotate`) and selective-recompute attention with
an absolute-position causal mask and per-segment attention mass (:func:`selective_attention`);
for the layers' rows (the CUDA-graph decode step and prefill layers), RMSNorm with an optional
residual add (:func:`rmsnorm`) and RoPE of fresh q/k rows with their K/V written into the buffer
(:func:`rope_rows`); plus the backend
dispatch shared by all (:func:`which_backend`). Every public kernel returns a
result naming the :class:`Backend` that ran (Triton on CUDA, the torch reference elsewhere; a
fallback says so). Does not own: model weights, planning, or buffer management.

Tensor conventions (per layer, no batch dim): K, V ``[H_kv, T, D]`` with row j = absolute
position j; queries ``[H_q, T_q, D]``; query head h reads kv head ``h // (H_q // H_kv)``.

Example (CPU: the references run)::

    >>> import torch
    >>> from cachedrag.kernels import rerotate, selective_attention
    >>> inv_freq = 1.0 / 10000 ** (torch.arange(0, 64, 2).float() / 64)
    >>> k = rerotate(torch.randn(3, 10, 64), torch.arange(10), inv_freq).k      # [3, 10, 64]
    >>> q = torch.randn(9, 4, 64)                                               # [9, 4, 64]
    >>> r = selective_attention(q, k, torch.randn(3, 10, 64), torch.tensor([2, 5, 8, 9]),
    ...                         segment_bounds=[0, 5, 10])
    >>> r.out.shape, r.segment_mass.shape, r.backend.name
    (torch.Size([9, 4, 64]), torch.Size([4, 2]), 'torch')
"""

from ._dispatch import Backend, interpreting, triton_available, which_backend
from .rerotate import RerotateResult, rerotate, rerotate_reference
from .rmsnorm import RMSNormResult, rmsnorm, rmsnorm_reference
from .rope_rows import RopeRowsResult, rope_rows, rope_rows_reference
from .selective_attention import (
    MAX_SEGMENTS,
    AttentionResult,
    selective_attention,
    selective_attention_reference,
)

__all__ = [
    "AttentionResult",
    "Backend",
    "MAX_SEGMENTS",
    "RMSNormResult",
    "RerotateResult",
    "RopeRowsResult",
    "interpreting",
    "rerotate",
    "rerotate_reference",
    "rmsnorm",
    "rmsnorm_reference",
    "rope_rows",
    "rope_rows_reference",
    "selective_attention",
    "selective_attention_reference",
    "triton_available",
    "which_backend",
]
