"""Pooled KV of the running requests: one slot tensor, so a batched step attends in one call.

Owns: ``KVPool`` (slots of one preallocated ``[L, S, H_kv, C, D]`` tensor for K and one for V)
and ``PooledKV`` (a ``KVBuffer`` whose K and V are views of one slot). A request's prompt KV
comes from the engine's prefill in its own buffer; the loop copies its rows into a free slot
(~4 ms for an 800-token prompt of the default model in bf16, once per request) and decodes from
there. The used slots are always ``0..n-1``: when a request leaves, the request in the last
used slot moves into the hole (its valid rows copied), so the running requests' K of layer
``i`` is the single strided view ``k[i, :n]`` ``[n, H_kv, C, D]``: ``cachedrag.server.batch``
then writes the step's K/V rows with one indexed op per layer and runs ONE attention call over
all requests (a length mask per request) instead of B calls and 2B row copies per layer.

Why: per-op overhead and B small attention calls per layer are what a batched decode step of
a small model adds per request on the CPU (docs/serving.md has the measurements). Why our own:
vLLM's paged KV and its attention kernels are GPU-only; a contiguous slot tensor is the
simplest layout torch's CPU SDPA takes in one call.

The pool grows (in ``GROW_TOKENS`` steps, whole attention blocks, up to ``max_tokens`` rounded up
to a step, positions per slot) when a request needs more positions than its slots hold: a new
tensor, live slots copied. Requests larger than
``max_tokens`` are not pooled (they decode from their own buffer, the per-request path).

Does not own: which requests run (``cachedrag.server.loop``), the attention itself
(``cachedrag.server.batch``), the engine's prefill buffers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from cachedrag.model.runner import KVBuffer, ModelRunner

KV_BLOCK = 512  # torch's CPU flash attention walks the keys in blocks of this many (its kv_split_size)
GROW_TOKENS = KV_BLOCK  # slot capacity grows in whole attention blocks (``batch.block_span_of`` reads whole blocks)


@dataclass
class PooledKV(KVBuffer):
    """A request's working KV held in slot ``slot`` of ``pool``: ``k``/``v`` are views
    ``[L, H_kv, C_req, D]`` of the pool (``C_req`` = the request's own capacity, so its context
    checks are those of its own buffer). The pool re-points them when the request moves."""

    pool: "KVPool | None" = field(default=None, repr=False)
    slot: int = -1


class KVPool:
    """``slots`` slots of up to ``max_tokens`` positions for one runner's K and V."""

    def __init__(self, runner: ModelRunner, slots: int, max_tokens: int, grow_tokens: int = GROW_TOKENS):
        assert slots >= 1 and max_tokens >= 1 and grow_tokens >= 1, "a pool needs a slot, a position and a growth step"
        max_tokens = -(-max_tokens // grow_tokens) * grow_tokens  # whole growth steps
        self.runner, self.slots, self.max_tokens, self.grow_tokens = runner, slots, max_tokens, grow_tokens
        self.capacity = 0  # positions per slot allocated so far (grows on demand)
        self.k = self.v = None  # [L, S, H_kv, C, D] each, once a request needs them
        self.used: list[PooledKV] = []  # used[s] sits in slot s (always slots 0..n-1)

    def __len__(self) -> int:
        return len(self.used)

    def fits(self, capacity: int) -> bool:
        return capacity <= self.max_tokens and len(self.used) < self.slots

    @torch.inference_mode()
    def admit(self, kv: KVBuffer, rows: int) -> PooledKV | None:
        """Copy rows ``[0, rows)`` of ``kv`` into the next free slot; returns the pooled buffer
        (same capacity, same rows), or None when it does not fit (the caller keeps ``kv``)."""
        if not self.fits(kv.capacity):
            return None
        self._grow(kv.capacity)
        slot = len(self.used)
        self.k[:, slot, :, :rows] = kv.k[:, :, :rows]  # [L, H_kv, rows, D]
        self.v[:, slot, :, :rows] = kv.v[:, :, :rows]
        pooled = PooledKV(k=self.k[:, slot, :, :kv.capacity], v=self.v[:, slot, :, :kv.capacity], length=kv.length,
                          pool=self, slot=slot)
        self.used.append(pooled)
        return pooled

    @torch.inference_mode()
    def release(self, pooled: PooledKV) -> None:
        """Free ``pooled``'s slot; the request in the last used slot moves into it (rows copied)."""
        if pooled.pool is not self or pooled.slot < 0:
            return
        hole, last = pooled.slot, len(self.used) - 1
        assert self.used[hole] is pooled, "pool slots out of step"
        pooled.pool, pooled.slot = None, -1
        mover = self.used.pop()
        if hole != last:
            n, cap = mover.length, mover.capacity
            self.k[:, hole, :, :n] = self.k[:, last, :, :n]  # [L, H_kv, n, D]
            self.v[:, hole, :, :n] = self.v[:, last, :, :n]
            mover.k, mover.v, mover.slot = self.k[:, hole, :, :cap], self.v[:, hole, :, :cap], hole
            self.used[hole] = mover

    def clear(self) -> None:
        """Forget every slot (after a failed step); the tensors stay for reuse."""
        for p in self.used:
            p.pool, p.slot = None, -1
        self.used = []

    def _grow(self, capacity: int) -> None:
        if capacity <= self.capacity:
            return
        r = self.runner
        new_cap = min(self.max_tokens, -(-capacity // self.grow_tokens) * self.grow_tokens)
        shape = (r.n_layers, self.slots, r.n_kv_heads, new_cap, r.head_dim)
        # zeros, not empty: the attention reads padded rows under a mask, and 0 x NaN (garbage memory) is NaN
        k = torch.zeros(shape, dtype=r.dtype, device=r.device)  # [L, S, H_kv, C, D]
        v = torch.zeros(shape, dtype=r.dtype, device=r.device)  # [L, S, H_kv, C, D]
        for p in self.used:  # live slots keep their rows
            n = p.length
            k[:, p.slot, :, :n] = self.k[:, p.slot, :, :n]
            v[:, p.slot, :, :n] = self.v[:, p.slot, :, :n]
            p.k, p.v = k[:, p.slot, :, :p.capacity], v[:, p.slot, :, :p.capacity]
        self.k, self.v, self.capacity = k, v, new_cap

    @property
    def nbytes(self) -> int:
        return 0 if self.k is None else 2 * self.k.numel() * self.k.element_size()


def pooled_prefix(kvs) -> tuple["KVPool | None", int]:
    """``(pool, m)``: the first ``m`` of ``kvs`` are slots ``0..m-1`` of one pool, in slot order
    (the layout one attention call reads); ``(None, 0)`` when the first is not pooled."""
    if not kvs or not isinstance(kvs[0], PooledKV) or kvs[0].pool is None:
        return None, 0
    pool, m = kvs[0].pool, 0
    for kv in kvs:
        if not isinstance(kv, PooledKV) or kv.pool is not pool or kv.slot != m:
            break
        m += 1
    return pool, m
