"""Cached K/V segments into the runner's working buffer, K re-rotated to the new positions.

Owns: ``RunnerCachedWrites`` (mixed into ``ModelRunner``): ``write_rotated`` (every layer of a
segment), ``write_rotated_layer`` (one layer) and ``write_rotated_segments`` (several segments of
one layer; one launch on the Triton backend). Stored K is pre-RoPE ("raw"); it is rotated to the
buffer rows it is written to (``Rotary.apply_into``, or the fused Triton re-rotation).

Does not own: which segments are loaded or from where (``cachedrag.kvcache``, ``cachedrag.store``).
"""

from __future__ import annotations

import torch

from cachedrag.model.kv_buffer import KVBuffer
from cachedrag.model.transfer import device_tensor


class RunnerCachedWrites:
    """``ModelRunner``'s writes of cached segments (module docstring)."""

    def write_rotated(self, kv: KVBuffer, raw_k: torch.Tensor, v: torch.Tensor, start: int) -> None:
        """Write a cached segment (raw K ``[L, H_kv, T, D]``, V) into buffer rows ``start..start+T``,
        K rotated to those positions (fused Triton re-rotation on the kernel backend)."""
        t = raw_k.shape[2]
        raw_k = raw_k.to(self.dtype)  # stored chunk caches may be in another dtype (kv_store_dtype)
        positions = torch.arange(start, start + t, device=self.device)  # [T]
        kv.v[:, :, start:start + t] = v
        if self.kernel_backend == "triton" and self.rotary.for_layer(0) is self.rotary:
            from cachedrag.kernels import rerotate

            flat_out = kv.k.view(-1, kv.capacity, self.head_dim)  # [L*H_kv, C, D]
            rerotate(raw_k.reshape(-1, t, self.head_dim), positions, self.rotary.inv_freq_on(self.device),
                     out=flat_out, out_rows=positions, backend="triton", validate=False)
            return
        self.rotary.apply_into(raw_k, positions, kv.k[:, :, start:start + t])  # [L, H_kv, T, D]

    def write_rotated_layer(self, kv: KVBuffer, layer: int, raw_k: torch.Tensor, v: torch.Tensor, start: int) -> None:
        """One layer of a cached segment (raw K ``[H_kv, T, D]``, V) into rows ``start..start+T``."""
        t = raw_k.shape[1]
        raw_k = raw_k.to(self.dtype)  # stored chunk caches may be in another dtype (kv_store_dtype)
        positions = torch.arange(start, start + t, device=self.device)  # [T]
        kv.v[layer, :, start:start + t] = v
        if self.kernel_backend == "triton":
            from cachedrag.kernels import rerotate

            rerotate(raw_k, positions, self.rotary.for_layer(layer).inv_freq_on(self.device), out=kv.k[layer],
                     out_rows=positions,
                     backend="triton", validate=False)
            return
        self.rotary.for_layer(layer).apply_into(raw_k, positions, kv.k[layer, :, start:start + t])  # [H_kv, T, D]

    def write_rotated_segments(self, kv: KVBuffer, layer: int, parts: list[tuple[torch.Tensor, torch.Tensor, int]],
                               rows: torch.Tensor | None = None) -> torch.Tensor | None:
        """``write_rotated_layer`` for several cached segments ``parts`` = ``[(raw K [H_kv, T_i, D],
        V [H_kv, T_i, D], start_i)]`` of one layer. On the Triton backend in one re-rotation launch
        and one V copy over the concatenated rows (a launch per segment and layer made a 20-chunk
        8B request host-bound on the GPU: docs/gpu.md); ``rows``: their buffer rows ``[sum T_i]``
        on the device, the same for every layer of a request (returned, pass it back next layer).
        Elsewhere segment by segment. Equal to the per-segment writes (tests)."""
        if self.kernel_backend != "triton" or len(parts) < 2:
            for raw_k, v, start in parts:
                self.write_rotated_layer(kv, layer, raw_k, v, start)
            return rows
        from cachedrag.kernels import rerotate

        if rows is None:  # [sum T_i], no wait for the GPU
            rows = device_tensor([p for k, _, start in parts for p in range(start, start + k.shape[1])], self.device)
        raw = torch.cat([k.to(self.dtype) for k, _, _ in parts], dim=1)  # [H_kv, sum T_i, D]
        kv.v[layer].index_copy_(1, rows, torch.cat([v for _, v, _ in parts], dim=1).to(kv.v.dtype))  # rows of [H_kv, C, D]
        rerotate(raw, rows, self.rotary.for_layer(layer).inv_freq_on(self.device), out=kv.k[layer], out_rows=rows,
                 backend="triton",
                 validate=False)
        return rows
