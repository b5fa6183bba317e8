"""Lower-precision copies of a runner's layers, for rows whose precision is a setting: passes whose
output is only a ranking, and the recomputed rows of reused chunks.

Owns: ``ScoringLayer`` (one decoder layer's fused projections in bfloat16 behind the
``LayerWeights`` interface the runner calls: ``qkv``, ``o``, ``mlp``; it takes and returns the
runner's dtype), ``scoring_layers(runner, n)``, the first ``n`` of them, built
once per runner (by the engine at construction, or on first use) and shared by every engine on it,
and ``RowSplitLayer``: one layer's projections with some rows through the bfloat16 copy and the
others through the runner's own weights (``CacheConfig.precision.recompute="bfloat16"``: a prefill's
recomputed reused-chunk rows in bfloat16, its question and fresh rows in the runner's precision).

Why: the engine's question pre-pass (``CachedEngine._question_scores``) runs the question's
~20 tokens through the first 17 layers only to rank reused tokens by the question's attention.
With so few rows the float32 projections are bound by reading the weights (14 MB a layer for
SmolLM2-135M); bfloat16 weights through oneDNN (AMX where the CPU has it) read half the bytes and
compute faster: the pre-pass of a request that reuses 5 chunks fell from 52 to 38 ms (probe,
docs/notes/fidelity.md). The pass produces a ranking, never KV or logits of the answer: the prefill
overwrites every row it wrote. Residual stream, norms, RoPE and attention stay in the runner's
dtype; only the matmuls round their inputs and outputs to bfloat16 (fp32 accumulation).
Costs one bfloat16 copy of those layers' projections (17 layers of SmolLM2-135M: 120 MB; all 30,
212 MB, with ``recompute_dtype="bfloat16"``). The same copies serve the recomputed rows of reused
chunks when asked (``RowSplitLayer``): those rows only repair approximate cached K/V, and their
matmuls are most of a reuse-served request's time; in bfloat16 they run ~2x faster here
(docs/notes/fidelity.md, round 10).

Does not own: the pre-pass or when it may use these (``cachedrag.engine``), the runner's own weight
formats (``weights.py``).
"""

from __future__ import annotations

import threading
import weakref

import torch

from cachedrag.model.weights import LayerWeights, Numerics

_LOCK = threading.Lock()
_BUILT: "weakref.WeakKeyDictionary[object, list[ScoringLayer]]" = weakref.WeakKeyDictionary()


class ScoringLayer:
    """A layer's projections in bfloat16 (oneDNN layout on the CPU): ``[T, Dm]`` in the runner's
    dtype -> the same dtype, each matmul on bfloat16-rounded inputs."""

    def __init__(self, layer):
        self._lw = LayerWeights(layer, Numerics(dtype="bfloat16"))
        self.q_out, self.kv_out = self._lw.q_out, self._lw.kv_out

    def qkv(self, x: torch.Tensor) -> torch.Tensor:
        return self._lw.qkv(x.to(torch.bfloat16)).to(x.dtype)  # [T, H_q*D + 2*H_kv*D]

    def o(self, x: torch.Tensor) -> torch.Tensor:
        return self._lw.o(x.to(torch.bfloat16)).to(x.dtype)  # [T, Dm]

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        return self._lw.mlp(x.to(torch.bfloat16)).to(x.dtype)  # [T, Dm]


class RowSplit:
    """A bool row mask ``[T]`` with the row indices ``RowSplitLayer`` gathers with: ``low`` (the masked
    rows) and ``full`` (the others), each None when empty. Built once per row set and shared by every
    layer and projection that splits those rows (a mask would be turned into indices at each)."""

    __slots__ = ("mask", "low", "full")

    def __init__(self, mask: torch.Tensor):
        self.mask = mask  # [T] bool
        self.low = mask.nonzero().flatten() if bool(mask.any()) else None  # [T_low]
        self.full = (~mask).nonzero().flatten() if not bool(mask.all()) else None  # [T_full]


class RowSplitLayer:
    """Layer projections (``LayerWeights``' interface) computing the rows in ``low`` (a bool mask over
    ``qkv``'s input rows, or its ``RowSplit``) through ``low_weights`` and the others through
    ``weights``; ``o`` and ``mlp`` take the rows of ``low_out`` (the same, or its last row where the
    runner's last layer computes only the last row's output). Each group of rows is one matmul on its
    own weights; a row never mixes the two."""

    def __init__(self, weights, low_weights, low: torch.Tensor | RowSplit,
                 low_out: torch.Tensor | RowSplit | None = None):
        self._w, self._low_w = weights, low_weights
        self._rows = low if isinstance(low, RowSplit) else RowSplit(low)
        if low_out is None:
            low_out = self._rows
        self._rows_out = low_out if isinstance(low_out, RowSplit) else RowSplit(low_out)
        self._low = self._rows.mask  # [T] bool: the rows on the low-precision copy
        self.q_out, self.kv_out = weights.q_out, weights.kv_out

    @staticmethod
    def _split(x: torch.Tensor, rows: RowSplit, full_fn, low_fn) -> torch.Tensor:
        if rows.low is None:
            return full_fn(x)
        if rows.full is None:
            return low_fn(x)
        out_low = low_fn(x.index_select(0, rows.low))  # [T_low, N]
        out = torch.empty(x.shape[0], out_low.shape[1], dtype=out_low.dtype, device=x.device)  # [T, N]
        out.index_copy_(0, rows.low, out_low)
        out.index_copy_(0, rows.full, full_fn(x.index_select(0, rows.full)))  # [T_full, N] rows
        return out

    def qkv(self, x: torch.Tensor) -> torch.Tensor:
        return self._split(x, self._rows, self._w.qkv, self._low_w.qkv)  # [T, H_q*D + 2*H_kv*D]

    def o(self, x: torch.Tensor) -> torch.Tensor:
        return self._split(x, self._rows_out, self._w.o, self._low_w.o)  # [T_out, Dm]

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        return self._split(x, self._rows_out, self._w.mlp, self._low_w.mlp)  # [T_out, Dm]


def scoring_layers(runner, n: int) -> list[ScoringLayer] | None:
    """bfloat16 projections of the runner's first ``n`` layers (built on first use, then extended
    as needed), or None where they buy nothing or cannot be built: a runner already computing
    in bfloat16 or with quantised weights (its own fast layers are as cheap), or one without
    fused fast layers (``fast=False``, the reference path: it keeps its own precision)."""
    if runner.fast_layers is None or runner.dtype != torch.float32 or runner.numerics.weights != "dense":
        return None
    n = min(n, runner.n_layers)
    with _LOCK:
        layers = _BUILT.setdefault(runner, [])
        while len(layers) < n:
            layers.append(ScoringLayer(runner.layers[len(layers)]))
        return layers[:n]
