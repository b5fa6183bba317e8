"""The runner's fused row kernels on the Triton backend (the CUDA-graph step's layers).

Owns: ``RunnerRows`` (mixed into ``ModelRunner``): ``row_kernels`` (whether they apply: Triton
backend, every norm of ``LlamaRMSNorm``'s form), ``row_norms``, and one decode row's layer as
``write_row`` (residual add + input norm, q/k/v, RoPE with the K/V row write) / ``finish_row``
(output projection, residual add + post-attention norm, MLP) / ``logits_row``. Equal to
``write_layer`` / ``finish_layer`` / ``logits`` to float rounding (tests).

Does not own: the kernels (``cachedrag.kernels``), capturing and replaying graphs (``cuda_graph.py``).
"""

from __future__ import annotations

import torch

from cachedrag.model.kv_buffer import KVBuffer
from cachedrag.model.linear import gated_mlp
from cachedrag.model.norms import RowNorms, plain_rms_norm


class RunnerRows:
    """``ModelRunner``'s fused row kernels (module docstring)."""

    @property
    def row_kernels(self) -> bool:
        """Fused row kernels on the Triton backend, when every norm is a plain RMSNorm (``row_norms``):
        the CUDA-graph step (``model/cuda_graph.py``) runs its layers as ``write_row`` / ``finish_row`` /
        ``logits_row``, and prefill layers take their norms (the post-attention one with its residual
        add) and RoPE with the K/V row writes from the same kernels (``kernels/cachedrag/kernels/rmsnorm.py``,
        ``kernels/cachedrag/kernels/rope_rows.py``): ~20 elementwise launches fewer per layer, ~10 ms of GPU time of an
        8B reuse request (docs/gpu.md)."""
        return self.kernel_backend == "triton" and self.row_norms() is not None

    def row_norms(self) -> RowNorms | None:
        """The model's norms for the row kernels, or None where one is not ``plain_rms_norm``'s form
        (then the graph step runs ``write_layer`` / ``finish_layer``'s ops). Looked up once."""
        if self._row_norms is False:
            plans = []
            for layer in self.layers:
                attn = layer.self_attn
                qk = None
                if hasattr(attn, "q_norm"):
                    qk = (plain_rms_norm(attn.q_norm), plain_rms_norm(attn.k_norm))
                    qk = None if None in qk else qk
                    if qk is None:
                        plans = None
                        break
                plans.append((plain_rms_norm(layer.input_layernorm), plain_rms_norm(layer.post_attention_layernorm),
                              qk))
            final = plain_rms_norm(self.model.model.norm)
            ok = plans is not None and final is not None and all(a is not None and b is not None for a, b, _ in plans)
            self._row_norms = RowNorms([a for a, _, _ in plans], [b for _, b, _ in plans], [q for _, _, q in plans],
                                       final) if ok else None
        return self._row_norms

    def write_row(self, i: int, hidden: torch.Tensor, delta: torch.Tensor | None, position: torch.Tensor,
                  kv: KVBuffer, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``write_layer`` for the one row of a decode step, in fused kernels (``row_kernels``):
        ``h = hidden + delta`` (``delta``: the previous layer's MLP output from ``finish_row``, its residual
        add deferred to here; None for the first layer) and the input norm in one launch, the q/k/v
        projection, then q and k rotated to ``position`` (``[1]`` int64 on the device; rows of ``cos``/``sin``
        ``[C, D]``) with the K/V row written into the buffer in one more. Returns ``(q [H_q, 1, D], h [1, Dm])``.
        Equal to ``finish_layer``'s add + ``write_layer`` to float rounding (tests); nothing reads the device."""
        from cachedrag.kernels import rmsnorm, rope_rows

        norms = self.row_norms()
        w, eps = norms.inputs[i]
        normed = rmsnorm(hidden, w, eps, residual=delta, backend="triton")  # [1, Dm] each
        h = hidden if delta is None else normed.hidden  # [1, Dm]
        x = normed.out  # [1, Dm]
        attn = self.layers[i].self_attn
        lw = self._projections(i)
        if lw is not None:
            q, k, v = lw.qkv(x).split([lw.q_out, lw.kv_out, lw.kv_out], dim=-1)  # [1, H*D] each
        else:
            q, k, v = (self.project(m, x) for m in (attn.q_proj, attn.k_proj, attn.v_proj))  # [1, H*D] each
        q = q.view(1, -1, self.head_dim)  # [1, H_q, D]
        k = k.view(1, -1, self.head_dim)  # [1, H_kv, D]
        v = v.view(1, -1, self.head_dim)  # [1, H_kv, D]
        if norms.qk[i] is not None:  # Qwen3: per-head RMSNorm of q and k before RoPE
            (wq, eq), (wk, ek) = norms.qk[i]
            q = rmsnorm(q, wq, eq, backend="triton").out  # [1, H_q, D]
            k = rmsnorm(k, wk, ek, backend="triton").out  # [1, H_kv, D]
        q = rope_rows(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), cos, sin, position, kv.k[i], kv.v[i],
                      backend="triton").q  # [H_q, 1, D]; the K/V row written
        return q, h

    def finish_row(self, i: int, h: torch.Tensor, attn_out: torch.Tensor,
                   weights=None) -> tuple[torch.Tensor, torch.Tensor]:
        """``finish_layer`` in fused kernels, its last residual add deferred: output projection,
        ``h2 = h + o`` with the post-attention norm in one launch, the MLP. Returns ``(h2, mlp_out)``
        ``[T, Dm]`` each: the layer's output is ``h2 + mlp_out``, added by the next ``write_row`` or by
        ``logits_row`` (the decode step), or by ``finish_layer`` (``weights`` as there)."""
        from cachedrag.kernels import rmsnorm

        layer = self.layers[i]
        lw = self._projections(i, weights)
        o = lw.o(attn_out) if lw is not None else self.project(layer.self_attn.o_proj, attn_out)  # [T, Dm]
        w, eps = self.row_norms().posts[i]
        normed = rmsnorm(o, w, eps, residual=h, backend="triton")  # [T, Dm] each
        x = normed.out  # [T, Dm]
        mlp = lw.mlp(x) if lw is not None else gated_mlp(layer.mlp, x, self.project)  # [T, Dm]
        return normed.hidden, mlp

    def logits_row(self, h: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        """``logits(h + delta)`` with the add and the final norm in one launch: ``[1, V]`` float32."""
        from cachedrag.kernels import rmsnorm

        w, eps = self.row_norms().final
        return self._head(rmsnorm(delta, w, eps, residual=h, backend="triton").out)  # [1, V]
