"""Linear layers for few-row inputs (decode steps, speculative verification) on the CPU.

Owns: the matmul layout the runner uses for its projections, MLP and LM head. ``F.linear``
computes ``x @ W^T``; with one or a few rows of ``x`` on the CPU, torch's BLAS path for that
shape reads the weights at about half the memory bandwidth the same product reaches as
``W @ x^T`` with at least two columns (measured on this project's 2-core EPYC: one decode step of
SmolLM2-135M takes 46 ms through ``F.linear`` and 28 ms through ``W @ x^T``; see
``docs/model-runner.md``). Decode is bound by reading the weights, so the layout is the decode
speed. :func:`linear` takes the ``W @ x^T`` path for CPU inputs of at most ``SKINNY_ROWS``
rows (a single row is padded to two) and ``F.linear`` otherwise; :func:`reference_linear` is
``F.linear`` always (the reference path of the equivalence tests).

Both compute the same sums in a different order, so results agree to float rounding, not
bit for bit. Does not own: which modules are projected (``runner.py``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

SKINNY_ROWS = 8  # above this, F.linear is as fast or faster (measured: 8 rows 70 vs 79 ms, 12 rows 103 vs 88 ms)


def linear(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``module(x)`` for an ``nn.Linear``-like module (``weight`` ``[O, I]``, optional ``bias``):
    ``[..., I] -> [..., O]``; the ``W @ x^T`` layout for few CPU rows."""
    if not isinstance(module, torch.nn.Linear):  # quantised or custom layers keep their own forward
        return module(x)
    weight = module.weight  # [O, I]
    rows = x.numel() // x.shape[-1] if x.numel() else 0
    if weight.device.type != "cpu" or rows == 0 or rows > SKINNY_ROWS or x.dtype != weight.dtype:
        return F.linear(x, weight, module.bias)
    flat = x.reshape(rows, x.shape[-1])  # [N, I]
    if rows == 1:  # a one-column product takes the slow matrix-vector path: pad to two columns
        flat = torch.cat([flat, flat.new_zeros(1, flat.shape[1])])  # [2, I]
    out = torch.mm(weight, flat.t())[:, :rows].t()  # [N, O]
    if module.bias is not None:
        out = out + module.bias
    return out.reshape(*x.shape[:-1], weight.shape[0])  # [..., O]


def reference_linear(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``F.linear`` (what the HF module computes)."""
    return F.linear(x, module.weight, module.bias)


def gated_mlp(mlp: torch.nn.Module, x: torch.Tensor, project=linear) -> torch.Tensor:
    """The Llama/Mistral/Qwen MLP ``down(act(gate(x)) * up(x))`` through ``project``: ``[T, Dm] -> [T, Dm]``.
    Modules of another shape are called as they are."""
    if not all(hasattr(mlp, name) for name in ("gate_proj", "up_proj", "down_proj", "act_fn")):
        return mlp(x)
    hidden = mlp.act_fn(project(mlp.gate_proj, x)) * project(mlp.up_proj, x)  # [T, Dff]
    return project(mlp.down_proj, hidden)  # [T, Dm]
