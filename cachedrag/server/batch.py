"""One batched decode forward over several requests' KV buffers (continuous batching).

Owns: ``batched_decode_step``: B running requests, each with its own ``KVBuffer``, its last
token and that token's absolute position, go through the model as ONE forward. The
projections, norms, MLPs and the LM head (the weight-bound part of a decode step) run once
over the B rows, so B requests cost little more than one on a CPU; only attention is per
request (each buffer has its own length), and each request's fresh K/V lands in its own
buffer. Requests join and leave between calls: nothing here persists across steps.

Two paths, chosen per runner:

- fast (``_fast_layer``), where the runner's own one-token path applies (fused weights,
  RMSNorm, no q/k norms, torch attention: ``ModelRunner._decode_fast``): the same op sequence
  as ``ModelRunner._decode_layer`` with B rows, i.e. fused RMSNorm, q and k rotated in one
  pass, the K/V rows written by index and unmasked attention over a slice. At B = 1 it runs
  the same ops as the engine's decode loop, so the server decodes one request as fast as
  ``CachedEngine.generate`` does (per-op overhead, not arithmetic, dominates a decode step of
  a small model on the CPU: the general path below costs ~2x at B = 1).
- general (``_general_layer``): the runner's public per-layer pieces (``qkv`` with q/k norms,
  ``rotary.apply``, ``finish_layer``) for every other supported model (Qwen3, Triton backend).

Why our own: the model runner's ``decode_step`` is single-request (its attention reads one
buffer); vLLM's paged-attention kernels are GPU-only. Reference path: ``ModelRunner.decode_step``
per request, which both paths equal to float rounding and token for token under greedy
decoding (``tests/server/test_batch.py``).

Does not own: sampling, scheduling, or which requests are running (``cachedrag.server.loop``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from cachedrag.errors import ContextWindowError
from cachedrag.model.rope import rotate_half
from cachedrag.model.runner import KVBuffer, ModelRunner, _rms_norm


@torch.inference_mode()
def batched_decode_step(runner: ModelRunner, tokens: Sequence[int], positions: Sequence[int],
                        kvs: Sequence[KVBuffer], fast: bool | None = None) -> torch.Tensor:
    """Feed ``tokens[b]`` at ``positions[b]`` into ``kvs[b]`` for every b; returns logits ``[B, V]``.

    Each request's query attends to its buffer rows ``[0, positions[b]]`` (within the layer's
    sliding window), as ``runner.decode_step`` does for one request. ``fast``: force the path
    (None: the fast one where the runner supports it; False: the general one, for tests).
    """
    n = len(tokens)
    assert n == len(positions) == len(kvs) and n > 0, "one token, position and buffer per request"
    positions = [int(p) for p in positions]
    for p, kv in zip(positions, kvs):
        if p >= kv.capacity:
            raise ContextWindowError(f"position {p} exceeds the request buffer ({kv.capacity})")
    device = runner.device
    ids = torch.tensor(list(tokens), device=device)  # [B]
    pos = torch.tensor(positions, device=device)  # [B]
    hidden = runner.embed(ids)  # [B, Dm]
    rope = runner.rotary.cos_sin(pos, runner.dtype, device)  # [B, D] each, shared by all layers
    use_fast = runner._decode_fast if fast is None else (fast and runner._decode_fast)
    layer = _fast_layer if use_fast else _general_layer
    for i in range(runner.n_layers):
        hidden = layer(runner, i, hidden, pos, positions, kvs, rope)  # [B, Dm]
    for p, kv in zip(positions, kvs):
        kv.length = max(kv.length, p + 1)
    return runner.logits(hidden)  # [B, V]


def _attend(runner: ModelRunner, i: int, q: torch.Tensor, positions: list[int], kvs: Sequence[KVBuffer]) -> torch.Tensor:
    """Query row b ``q[:, b]`` (``[H_q, B, D]``, rotated) attends to ``kvs[b]`` rows up to
    ``positions[b]`` (within layer ``i``'s window); returns ``[B, H_q*D]``."""
    window = runner.windows[i]
    gqa = runner.n_heads != runner.n_kv_heads
    outs = []
    for b, (p, kv) in enumerate(zip(positions, kvs)):
        lo = 0 if window is None else max(0, p + 1 - window)  # keys j with p - window < j <= p
        out = F.scaled_dot_product_attention(
            q[None, :, b:b + 1], kv.k[None, i, :, lo:p + 1], kv.v[None, i, :, lo:p + 1],
            scale=runner.scaling, enable_gqa=gqa,
        )  # [1, H_q, 1, D]; no mask: every key up to p is visible to the query at p
        outs.append(out.reshape(1, -1))  # [1, H_q*D]
    return outs[0] if len(outs) == 1 else torch.cat(outs, 0)  # [B, H_q*D]


def _fast_layer(runner: ModelRunner, i: int, hidden: torch.Tensor, pos: torch.Tensor, positions: list[int],
                kvs: Sequence[KVBuffer], rope) -> torch.Tensor:
    """``ModelRunner._decode_layer`` over B rows (fused weights, RMSNorm, no q/k norms)."""
    layer, lw = runner.layers[i], runner.fast_layers[i]
    b = hidden.shape[0]
    ln1, ln2 = layer.input_layernorm, layer.post_attention_layernorm
    h_q, h_kv, d = runner.n_heads, runner.n_kv_heads, runner.head_dim
    x = _rms_norm(hidden, ln1.weight, ln1.variance_epsilon)  # [B, Dm]
    qkv = lw.qkv(x)  # [B, Oq + 2*Okv]
    qk = qkv[:, : lw.q_out + lw.kv_out].view(b, h_q + h_kv, d).transpose(0, 1)  # [H_q + H_kv, B, D]
    qk = qk * rope[0] + rotate_half(qk) * rope[1]  # [H_q + H_kv, B, D] RoPE at each row's position
    v = qkv[:, lw.q_out + lw.kv_out:].view(b, h_kv, d)  # [B, H_kv, D]
    for r, (p, kv) in enumerate(zip(positions, kvs)):
        kv.k[i, :, p] = qk[h_q:, r]  # [H_kv, D] into row p
        kv.v[i, :, p] = v[r]  # [H_kv, D]
    out = _attend(runner, i, qk[:h_q], positions, kvs)  # [B, H_q*D]
    h = hidden + lw.o(out)  # [B, Dm]
    return h + lw.mlp(_rms_norm(h, ln2.weight, ln2.variance_epsilon))  # [B, Dm]


def _general_layer(runner: ModelRunner, i: int, hidden: torch.Tensor, pos: torch.Tensor, positions: list[int],
                   kvs: Sequence[KVBuffer], rope) -> torch.Tensor:
    """Layer ``i`` from the runner's public pieces (any supported model and backend)."""
    q, k_raw, v = runner.qkv(i, hidden)  # [H_q, B, D], [H_kv, B, D], [H_kv, B, D]
    q = runner.rotary.apply(q, pos, rope)  # [H_q, B, D]
    k = runner.rotary.apply(k_raw, pos, rope)  # [H_kv, B, D]
    for r, (p, kv) in enumerate(zip(positions, kvs)):
        kv.k[i, :, p] = k[:, r]  # [H_kv, D] into row p
        kv.v[i, :, p] = v[:, r]
    return runner.finish_layer(i, hidden, _attend(runner, i, q, positions, kvs))  # [B, Dm]
