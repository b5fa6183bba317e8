"""One batched decode forward over several requests' KV buffers (continuous batching).

Owns: ``batched_decode_step``: B running requests, each with its own ``KVBuffer``, its last
token and that token's absolute position, go through the model as ONE forward. The
projections, norms, MLPs and the LM head (the weight-bound part of a decode step) run once
over the B rows, so B requests cost little more than one on a CPU; only attention is per
request (each buffer has its own length), and each request's fresh K/V lands in its own
buffer. Requests join and leave between calls: nothing here persists across steps.

Why our own: the model runner's ``decode_step`` is single-request (its attention reads one
buffer); vLLM's paged-attention kernels are GPU-only. This is built from the runner's public
per-layer pieces (``embed``, ``qkv``, ``finish_layer``, ``logits``, the rotary tables), so it
follows their numerics; reference path: ``ModelRunner.decode_step`` per request, which this
equals token for token under greedy decoding (``tests/server/test_batch.py``).

Does not own: sampling, scheduling, or which requests are running (``cachedrag.server.loop``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from cachedrag.errors import ContextWindowError
from cachedrag.model.runner import KVBuffer, ModelRunner


@torch.inference_mode()
def batched_decode_step(runner: ModelRunner, tokens: Sequence[int], positions: Sequence[int],
                        kvs: Sequence[KVBuffer]) -> torch.Tensor:
    """Feed ``tokens[b]`` at ``positions[b]`` into ``kvs[b]`` for every b; returns logits ``[B, V]``.

    Each request's query attends to its buffer rows ``[0, positions[b]]`` (within the layer's
    sliding window), as ``runner.decode_step`` does for one request.
    """
    n = len(tokens)
    assert n == len(positions) == len(kvs) and n > 0, "one token, position and buffer per request"
    for p, kv in zip(positions, kvs):
        if p >= kv.capacity:
            raise ContextWindowError(f"position {p} exceeds the request buffer ({kv.capacity})")
    device = runner.device
    ids = torch.tensor(list(tokens), device=device)  # [B]
    pos = torch.tensor(list(positions), device=device)  # [B]
    hidden = runner.embed(ids)  # [B, Dm]
    rope = runner.rotary.cos_sin(pos, runner.dtype, device)  # [B, D] each, shared by all layers
    gqa = runner.n_heads != runner.n_kv_heads
    for i in range(runner.n_layers):
        q, k_raw, v = runner.qkv(i, hidden)  # [H_q, B, D], [H_kv, B, D], [H_kv, B, D]
        q = runner.rotary.apply(q, pos, rope)  # [H_q, B, D]
        k = runner.rotary.apply(k_raw, pos, rope)  # [H_kv, B, D]
        window = runner.windows[i]
        outs = []
        for b, (p, kv) in enumerate(zip(positions, kvs)):
            kv.k[i, :, p] = k[:, b]  # [H_kv, D] into row p
            kv.v[i, :, p] = v[:, b]
            lo = 0 if window is None else max(0, p + 1 - window)  # keys j with p - window < j <= p
            out = F.scaled_dot_product_attention(
                q[None, :, b:b + 1], kv.k[None, i, :, lo:p + 1], kv.v[None, i, :, lo:p + 1],
                scale=runner.scaling, enable_gqa=gqa,
            )  # [1, H_q, 1, D]; no mask: every key up to p is visible to the query at p
            outs.append(out.reshape(1, -1))  # [1, H_q*D]
        hidden = runner.finish_layer(i, hidden, torch.cat(outs, 0))  # [B, Dm]
    for p, kv in zip(positions, kvs):
        kv.length = max(kv.length, p + 1)
    return runner.logits(hidden)  # [B, V]
