"""One batched decode forward over several requests' KV buffers (continuous batching), the model
layer's half of the server's decode step, reached through ``ModelRunner.decode_batch`` and
``ModelRunner.prepare_batch``.

Owns: ``batched_decode_step``: B running requests, each with its own ``KVBuffer``, its last
token and that token's absolute position, go through the model as ONE forward. The
projections, norms, MLPs and the LM head (the weight-bound part of a decode step) run once
over the B rows, so B requests cost little more than one on a CPU; attention reads each
request's own keys, and each request's fresh K/V lands in its own buffer. Attention reads each
request's exact keys with the runner's own arithmetic: with the split-K kernel
(``model/attention.py``) one ``decode_attention_batch`` call for all of them per layer (each row
bit for bit the runner's own call), else the runner's ``_attend_row`` (SDPA) per request. Requests join and
leave between calls: nothing here persists across steps but the packed weights below (built
once per runner).

Three paths, chosen per runner:

- fused (the default where the runner has one, ``ModelRunner.fused``):
  the runner's native step (``model/fused_decode.py``) over the B requests in ONE call, each
  weight row read from memory once for all of them; each row is bit for bit the runner's own
  ``decode_step`` on that request, so a batch of one decodes as ``CachedEngine.generate`` and
  batch-mates change nothing (tests).
- fast (``_fast_layer``), where the runner's own one-token path applies (fused weights,
  RMSNorm, no q/k norms, torch attention: ``ModelRunner._decode_fast``): the same op sequence
  as ``ModelRunner._decode_layer`` with B rows, i.e. fused RMSNorm, q and k rotated in one
  pass, the K/V rows written by index and unmasked attention over a slice. At B = 1 it runs
  the same ops as the engine's decode loop, so the server decodes one request as fast as
  ``CachedEngine.generate`` does (per-op overhead, not arithmetic, dominates a decode step of
  a small model on the CPU: the general path below costs ~2x at B = 1).
- general (``_general_layer``): the runner's public per-layer pieces (``qkv`` with q/k norms,
  ``rotary.apply``, ``finish_layer``) for every other supported model (Qwen3, Triton backend).

Few-row float32 projections (``BatchWeights``): a decode step reads every weight once, so B
rows should cost about what one row costs. With dense float32 weights ``F.linear`` (MKL sgemm)
does not get there: over all 211 projections and the LM head of SmolLM2-135M (2-core Xeon,
torch 2.13, one exclusive run) it takes 23 / 26 / 29 / 43 / 55 ms for 1 / 2 / 3 / 4 / 8 rows,
while oneDNN's packed float32 matmul (``mkldnn._reorder_linear_weight``, the layout inductor's
CPU backend uses after freezing) takes 30 / 31 / 31 / 30 / 36 ms: flat in the row count but
slower for one row. So from ``PACKED_ROWS`` rows on, the batched step runs a packed copy of the
runner's fused weights (built once per runner, ~0.2 s, as many bytes as the weights), and below
it the runner's own ``F.linear`` weights, as the one-token path does. MKL's own packed sgemm
(``mkl._mkl_linear``) was measured too: as fast at the row count it was packed for, but it
falls back to ``F.linear`` at any other count. Weights already in a row-flexible layout
(bfloat16 oneDNN, int8) are used as they are.

Why our own: the model runner's ``decode_step`` is single-request (its attention reads one
buffer); vLLM's paged-attention kernels are GPU-only. Reference path: ``ModelRunner.decode_step``
per request, which both paths equal to float rounding and token for token under greedy
decoding (``tests/server/test_batch.py``). Reads the runner's decode internals (its fused weights,
decode norms, attention kernel): it is the runner's batched step, kept in its own module.

Does not own: sampling, scheduling, or which requests are running (``cachedrag.server.loop``),
the runner's own decode step (``ModelRunner._decode_layer``).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from cachedrag.errors import ContextWindowError
from cachedrag.model.kv_buffer import KVBuffer
from cachedrag.model.norms import rms_norm_rows as _rms_norm_rows
from cachedrag.model.rope import rotate_half

PACKED_ROWS = 4  # from this many rows, the packed oneDNN float32 matmul (table in the module docstring)

_PACKED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # runner -> BatchWeights | None


class _Packed:
    """``x @ W^T + b`` through oneDNN's packed float32 layout (any row count)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)  # oneDNN blocked [O, I]
        self.bias = bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")  # [B, O]


class BatchWeights:
    """Row-flexible projections of a runner with dense float32 fused weights: per layer
    ``qkv``, ``o``, ``gate_up``, ``down`` and the LM ``head``, as packed oneDNN copies."""

    def __init__(self, runner: "ModelRunner"):
        self.layers = [tuple(_Packed(p.weight, p.bias) for p in (lw.qkv, lw.o, lw.gate_up, lw.down))
                       for lw in runner.fast_layers]
        self.head = _Packed(runner.fast_head.weight, runner.fast_head.bias)

    @staticmethod
    def applies(runner: "ModelRunner") -> bool:
        """Dense float32 fused weights on the CPU with oneDNN present (other formats already are
        row-flexible, or are not fused)."""
        if runner.fast_layers is None or runner.fast_head is None or runner.device.type != "cpu":
            return False
        if runner.dtype != torch.float32 or not torch.backends.mkldnn.is_available():
            return False
        return all(p.kind == "dense" for lw in runner.fast_layers for p in (lw.qkv, lw.o, lw.gate_up, lw.down))

    @property
    def nbytes(self) -> int:
        return sum(p.packed.numel() * 4 for layer in self.layers for p in layer) + self.head.packed.numel() * 4


def batch_weights(runner: "ModelRunner", build: bool = True) -> BatchWeights | None:
    """The runner's ``BatchWeights`` (built on first use, then kept while the runner lives), or
    None where they do not apply. Call it once on the thread that runs the steps, before the
    first one (``EngineLoop`` does), so no request pays the build."""
    if runner not in _PACKED:
        if not build:
            return None
        _PACKED[runner] = BatchWeights(runner) if BatchWeights.applies(runner) else None
    return _PACKED[runner]


def prepare(runner: "ModelRunner", max_batch: int) -> None:
    """Build the packed weights and run each batch size from ``PACKED_ROWS`` to ``max_batch``
    once, so oneDNN's per-shape kernel setup happens now, not inside a request. Not for a runner
    with the fused step: its batches never read them."""
    if runner.fused is not None:
        return
    bw = batch_weights(runner) if max_batch >= PACKED_ROWS else None
    if bw is None:
        return
    with torch.inference_mode():
        for b in range(PACKED_ROWS, max_batch + 1):
            x = torch.zeros(b, runner.fast_layers[0].qkv.in_features, dtype=runner.dtype)  # [B, Dm]
            qkv, o, gate_up, down = bw.layers[0]
            qkv(x), o(x), bw.head(x)
            down(gate_up(x)[:, : runner.fast_layers[0].ff])


@torch.inference_mode()
def batched_decode_step(runner: "ModelRunner", tokens: Sequence[int], positions: Sequence[int],
                        kvs: Sequence[KVBuffer], fast: bool | None = None, packed: bool | None = None,
                        fused: bool | None = None) -> torch.Tensor:
    """Feed ``tokens[b]`` at ``positions[b]`` into ``kvs[b]`` for every b; returns logits ``[B, V]``.

    Each request's query attends to its buffer rows ``[0, positions[b]]`` (within the layer's
    sliding window), as ``runner.decode_step`` does for one request. ``fast``: force the path
    (None: the fast one where the runner supports it; False: the general one, for tests).
    ``packed``: force the packed float32 weights on or off (None: from ``PACKED_ROWS`` rows on,
    where they apply; tests force them to compare the layouts).
    ``fused``: the runner's fused native step (``model/fused_decode.py``: all B requests in one call,
    each row bit for bit the runner's own ``decode_step``) where the runner has one (None: so, unless
    ``fast`` or ``packed`` forces the op-by-op path; False: op by op).
    """
    n = len(tokens)
    assert n == len(positions) == len(kvs) and n > 0, "one token, position and buffer per request"
    positions = [int(p) for p in positions]
    for p, kv in zip(positions, kvs):
        if p >= kv.capacity:
            raise ContextWindowError(f"position {p} exceeds the request buffer ({kv.capacity})")
    if fused is None:
        fused = fast is None and packed is None
    if fused and runner.fused is not None:
        return runner.fused.step_batch(tokens, positions, kvs)  # [B, V]
    device = runner.device
    ids = torch.tensor(list(tokens), device=device)  # [B]
    pos = torch.tensor(positions, device=device)  # [B]
    hidden = runner.embed(ids)  # [B, Dm]
    use_fast = runner._decode_fast if fast is None else (fast and runner._decode_fast)
    if use_fast:  # the runner's decode stream dtype (float32 for int8-dynamic), as its decode step
        hidden = hidden.to(runner._decode_dtype)  # [B, Dm]
    rope = runner.rotary.cos_sin(pos, hidden.dtype, device)  # [B, D] each, shared by all layers
    if use_fast:
        bw = batch_weights(runner) if (packed if packed is not None else n >= PACKED_ROWS) else None
        views = _Views(runner, positions, kvs)
        for i in range(runner.n_layers):
            hidden = _fast_layer(runner, i, hidden, views, rope, bw)  # [B, Dm]
    else:
        bw = None
        for i in range(runner.n_layers):
            hidden = _general_layer(runner, i, hidden, pos, positions, kvs, rope)  # [B, Dm]
    for p, kv in zip(positions, kvs):
        kv.length = max(kv.length, p + 1)
    if not use_fast:
        return runner.logits(hidden)  # [B, V]
    w, _, eps, _ = runner._decode_norms[-1]
    head = bw.head if bw is not None else runner.fast_head
    return head(_rms_norm_rows(hidden, w, eps)).float()  # [B, V]


class _Views:
    """Per step, per request: views of the buffer rows the step writes (``[L, H_kv, D]``) and
    reads (``[L, 1, H_kv, T, D]`` per sliding window), taken once for all layers instead of
    indexing the buffers again in every layer (per-op overhead dominates a small model's step)."""

    def __init__(self, runner: "ModelRunner", positions: list[int], kvs: Sequence[KVBuffer]):
        self.runner, self.positions, self.kvs = runner, positions, kvs
        self.k_rows = [kv.k[:, :, p] for p, kv in zip(positions, kvs)]  # B x [L, H_kv, D]
        self.v_rows = [kv.v[:, :, p] for p, kv in zip(positions, kvs)]  # B x [L, H_kv, D]
        self.ks = [kv.k for kv in kvs]  # B x [L, H_kv, C, D]: the split-K kernel's batched call
        self.vs = [kv.v for kv in kvs]
        self._ranges: dict[int | None, tuple[list[int], list[int]]] = {}

    def key_ranges(self, window: int | None) -> tuple[list[int], list[int]]:
        """Per request, its keys ``starts[r]..ends[r]-1``: ``p - window < j <= p``."""
        if window not in self._ranges:
            ps = self.positions
            self._ranges[window] = ([0 if window is None else max(0, p + 1 - window) for p in ps], [p + 1 for p in ps])
        return self._ranges[window]

def _attend(runner: "ModelRunner", i: int, q: torch.Tensor, positions: list[int], kvs: Sequence[KVBuffer]) -> torch.Tensor:
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


def _fast_layer(runner: "ModelRunner", i: int, hidden: torch.Tensor, views: _Views, rope,
                bw: BatchWeights | None) -> torch.Tensor:
    """``ModelRunner._decode_layer`` over B rows (fused weights, RMSNorm, no q/k norms); the
    projections through ``bw`` (packed float32) when given, else the runner's own weights."""
    lw = runner.fast_layers[i]
    qkv_w, o_w, gate_up_w, down_w = bw.layers[i] if bw is not None else (lw.qkv, lw.o, lw.gate_up, lw.down)
    b = hidden.shape[0]
    w1, w2, eps1, eps2 = runner._decode_norms[i]  # prepared for ``_rms_norm_rows`` in the stream's dtype
    h_q, h_kv, d = runner.n_heads, runner.n_kv_heads, runner.head_dim
    x = _rms_norm_rows(hidden, w1, eps1)  # [B, Dm]
    qkv = qkv_w(x)  # [B, Oq + 2*Okv]
    qk = qkv[:, : lw.q_out + lw.kv_out].view(b, h_q + h_kv, d).transpose(0, 1)  # [H_q + H_kv, B, D]
    qk = qk * rope[0] + rotate_half(qk) * rope[1]  # [H_q + H_kv, B, D] RoPE at each row's position
    v = qkv[:, lw.q_out + lw.kv_out:].view(b, h_kv, d)  # [B, H_kv, D]
    window = runner.windows[i]
    for r in range(b):
        views.k_rows[r][i].copy_(qk[h_q:, r])  # [H_kv, D] into row p of request r
        views.v_rows[r][i].copy_(v[r])  # [H_kv, D]
    kernel = runner._attn_kernel
    if kernel is not None and b > 1:  # the split-K kernel, all requests in one call: each row
        starts, ends = views.key_ranges(window)  # is bit for bit the runner's own call on that request
        out = kernel.decode_attention_batch(qk[:h_q], views.ks, views.vs, i, starts, ends,
                                            runner.scaling)  # [B, H_q*D]
    else:
        outs = [runner._attend_row(i, qk[:h_q, r], p, kv)  # B x [1, H_q*D]: the runner's own attention
                for r, (p, kv) in enumerate(zip(views.positions, views.kvs))]  # (its kernel or SDPA)
        out = outs[0] if len(outs) == 1 else torch.cat(outs, 0)  # [B, H_q*D]
    h = hidden + o_w(out.to(hidden.dtype))  # [B, Dm]
    y = _rms_norm_rows(h, w2, eps2)  # [B, Dm]
    gate, up = gate_up_w(y).split(lw.ff, dim=-1)  # [B, Dff] each
    return h + down_w(lw.act(gate) * up)  # [B, Dm]


def _general_layer(runner: "ModelRunner", i: int, hidden: torch.Tensor, pos: torch.Tensor, positions: list[int],
                   kvs: Sequence[KVBuffer], rope) -> torch.Tensor:
    """Layer ``i`` from the runner's public pieces (any supported model and backend)."""
    q, k_raw, v = runner.qkv(i, hidden)  # [H_q, B, D], [H_kv, B, D], [H_kv, B, D]
    rope = runner.rotary.table_for(i, rope)  # layer i's frequencies (Gemma 3's local and global layers differ)
    q = runner.rotary.apply(q, pos, rope)  # [H_q, B, D]
    k = runner.rotary.apply(k_raw, pos, rope)  # [H_kv, B, D]
    for r, (p, kv) in enumerate(zip(positions, kvs)):
        kv.k[i, :, p] = k[:, r]  # [H_kv, D] into row p
        kv.v[i, :, p] = v[:, r]
    return runner.finish_layer(i, hidden, _attend(runner, i, q, positions, kvs))  # [B, Dm]
