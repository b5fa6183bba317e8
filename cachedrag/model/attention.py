"""Native CPU attention: decode (one query row per head over a request's KV rows, split across the
keys) and the partial prefill (sorted query positions, causal by position), each with its torch
reference.

Owns: ``decode_attention(q, k, v, start, end, scale)`` (``[H_q, D]`` query rows over the rows
``start..end-1`` of ``[H_kv, C, D]`` key/value buffers, GQA: query head ``h`` reads KV head
``h // (H_q / H_kv)``), ``decode_attention_batch`` (B requests' rows in one call, each bit for bit
its single call: the server's batched step) and their reference ``decode_attention_reference``;
``prefill_attention(q, k, v, positions, kv_len, scale, hidden_keys)`` (query rows at sorted
absolute positions over the request's KV rows, key ``j`` visible to the row at position ``p`` iff
``j <= p`` and not hidden) and its reference ``prefill_attention_reference``; ``prefill_module()``
(the library when it holds the prefill kernel: AVX-512 builds only, else None and the runner
keeps SDPA).

The kernels are C++ (``csrc/decode_attention.cpp``, ``csrc/prefill_attention.cpp``), built and
cached by ``native.py`` (``kernel()``, ``kernel_status()``, ``library_dir()`` are re-exported here).
Why hand-written: torch's CPU SDPA parallelises a single query row over (batch, head) only and
reads bf16 K/V only with a bf16 query; the decode kernel splits the keys too (flash-decoding:
every thread a key range of every KV head, partial max / sum / output merged after), reads each
K/V row once for all the query heads that share it, and reads float32 or bf16 K/V under a float32
query. For a prefill, SDPA takes an arbitrary causal-by-position mask only as a dense tensor it
reads for every block; the prefill kernel masks only the tiles a row's position cuts and skips the
rows that end before a tile. With bf16 queries and K/V on AVX512-BF16 CPUs the prefill scores run
on bf16 pairs (``pairs``). Threads: ``at::parallel_for`` with torch's intra-op thread count.
Measurements: docs/notes/speed.md.

Does not own: building the library (``native.py``), where the KV lives or its dtype
(``runner.py``), which rows a prefill computes.
"""

from __future__ import annotations

import torch

from cachedrag.model import native
from cachedrag.model.native import kernel, kernel_status, library_dir  # re-exported: their old home

__all__ = [
    "PAIRS", "decode_attention", "decode_attention_batch", "decode_attention_reference", "kernel", "kernel_status",
    "library_dir", "prefill_attention", "prefill_attention_reference", "prefill_module",
]


def decode_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, end: int,
                               scale: float) -> torch.Tensor:
    """The reference: float32 softmax attention of ``q [H_q, D]`` over rows ``start..end-1`` of
    ``k, v [H_kv, C, D]`` (GQA by repeating KV heads); ``[H_q, D]`` in ``q``'s dtype."""
    g = q.shape[0] // k.shape[0]
    kk = k[:, start:end].float().repeat_interleave(g, 0)  # [H_q, T, D]
    vv = v[:, start:end].float().repeat_interleave(g, 0)  # [H_q, T, D]
    s = torch.einsum("hd,htd->ht", q.float(), kk) * scale  # [H_q, T]
    return torch.einsum("ht,htd->hd", s.softmax(-1), vv).to(q.dtype)  # [H_q, D]


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, end: int, scale: float,
                     splits: int = 0) -> torch.Tensor:
    """``decode_attention_reference`` through the compiled kernel (raises when it is unavailable:
    callers check ``kernel()`` first). ``q [H_q, D]``, ``k, v [H_kv, C, D]`` -> ``[H_q, D]``."""
    mod = native.kernel()
    if mod is None:
        raise RuntimeError(f"decode attention kernel {native.kernel_status()}")
    return mod.decode_attention(q, k, v, start, end, scale, splits)


def decode_attention_batch(q: torch.Tensor, ks: list[torch.Tensor], vs: list[torch.Tensor], layer: int,
                           starts: list[int], ends: list[int], scale: float) -> torch.Tensor:
    """B requests in one call (the server's batched step): ``q [H_q, B, D]`` (any strides), request
    ``b``'s whole buffers ``ks[b], vs[b] [L, H_kv, C, D]`` at ``layer``, keys ``starts[b]..ends[b]-1``;
    returns ``[B, H_q*D]``. Row ``b`` equals ``decode_attention(q[:, b], ks[b][layer], vs[b][layer],
    starts[b], ends[b], scale)`` bit for bit: the same splits, tasks and merge, all the batch's tasks
    in one parallel loop (one fork/join per layer instead of one per request)."""
    mod = native.kernel()
    if mod is None:
        raise RuntimeError(f"decode attention kernel {native.kernel_status()}")
    return mod.decode_attention_batch(q, ks, vs, layer, starts, ends, scale)


def prefill_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                                kv_len: int, scale: float, hidden_keys: torch.Tensor | None = None) -> torch.Tensor:
    """The reference: float32 softmax attention of ``q [H_q, T, D]`` (row ``t`` at ``positions[t]``)
    over rows ``[0, kv_len)`` of ``k, v [H_kv, C, D]``, key ``j`` visible iff ``j <= positions[t]`` and
    not ``hidden_keys[j]``; ``[T, H_q*D]`` in ``q``'s dtype (GQA by repeating KV heads)."""
    g = q.shape[0] // k.shape[0]
    kk = k[:, :kv_len].float().repeat_interleave(g, 0)  # [H_q, T_k, D]
    vv = v[:, :kv_len].float().repeat_interleave(g, 0)  # [H_q, T_k, D]
    s = torch.einsum("htd,hkd->htk", q.float(), kk) * scale  # [H_q, T, T_k]
    hide = torch.arange(kv_len, device=q.device)[None, :] > positions.to(q.device)[:, None]  # [T, T_k]
    if hidden_keys is not None:
        hide = hide | hidden_keys[None, :kv_len].to(q.device)
    s = s.masked_fill(hide[None], float("-inf"))  # [H_q, T, T_k]
    out = torch.einsum("htk,hkd->thd", s.softmax(-1), vv)  # [T, H_q, D]
    return out.reshape(q.shape[1], -1).to(q.dtype)  # [T, H_q*D]


def prefill_module():
    """The compiled library when it holds the prefill kernel (AVX-512 builds), else None."""
    mod = native.kernel()
    return mod if mod is not None and mod.prefill_attention_available() else None


PAIRS = {"none": 0, "scores": 1, "scores+values": 2}  # prefill_attention's ``pairs`` -> the kernel's code


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, kv_len: int,
                      scale: float, hidden_keys: torch.Tensor | None = None, pairs: str = "scores") -> torch.Tensor:
    """``prefill_attention_reference`` through the compiled kernel (raises when it is unavailable:
    callers check ``prefill_module()`` first). ``positions`` must ascend (as every prefill passes
    them); ``hidden_keys``: bool ``[kv_len]`` or None. ``pairs`` (bf16 ``q`` and K/V on AVX512-BF16
    CPUs; elsewhere every element is widened to float32): ``"scores"`` multiplies bf16 pairs for the
    scores (exact products, another order of sums: the widened path's accuracy), ``"scores+values"``
    for the value products too (the probabilities rounded to bf16 for them, as GPU flash attention
    does: faster, a little less accurate), ``"none"`` widens everything. Returns ``[T, H_q*D]``."""
    if pairs not in PAIRS:
        raise ValueError(f"pairs must be one of {', '.join(PAIRS)}, got {pairs!r}")
    mod = prefill_module()
    if mod is None:
        raise RuntimeError(f"prefill attention kernel unavailable ({native.kernel_status()})")
    hidden = _NO_HIDDEN if hidden_keys is None else hidden_keys[:kv_len].to(torch.uint8).contiguous()
    return mod.prefill_attention(q, k, v, positions.to(torch.int64), kv_len, scale, hidden, PAIRS[pairs])


_NO_HIDDEN = torch.empty(0, dtype=torch.uint8)
