"""The one-token decode step on CUDA, replayed from captured CUDA graphs.

Owns: capturing a runner's decode step for one KV buffer (its K/V tensors bound by address, the
token and position in static device tensors, attention over the buffer's whole capacity under the
causal mask of the position) and replaying it; a small cache of captured steps keyed by the
buffer's address and shape, so a buffer the allocator hands out again (the next request of the
same capacity gets the block the last one freed) reuses its graph. A captured step keeps no
reference to the buffer: it replays only for a buffer at the same address with the same shape,
which is then the memory it was captured over.

Why our own: a step of a 32-layer model is ~1,300 kernel launches; eager PyTorch issues them from
Python at ~5-10 µs each, far longer than the GPU needs to read the weights (16 GB at ~3 TB/s,
5 ms). ``torch.compile(mode="reduce-overhead")`` captures graphs too, but recompiles per shape
and needs minutes for an 8B model; the step here is the runner's own ops, captured as they are,
so it stays equal to the eager step (tests).

Kernels per layer: even replayed, each launch costs the GPU 1-2.5 µs, so on the Triton backend the
layers run as the runner's fused rows (``write_row`` / ``finish_row`` / ``logits_row``: an RMSNorm
kernel that also does the residual add before it, and one RoPE kernel that rotates q and k from the
cos/sin tables and writes the K/V row; ``cachedrag.kernels``), and the attention mask is built once
per step (per layer only with sliding windows). Per layer: 2 norms, 1 RoPE, the 4 projections
(cuBLAS adds a split-K reduce to some), SDPA (cuDNN: 2), SiLU and the gate product: ~13 launches
instead of ~41 (Llama-3.1-8B bf16 on an H100: 6.4 vs 8.1 ms per replay, measured once; same logits).
Elsewhere (torch kernels, or a norm not of ``LlamaRMSNorm``'s form) the step is ``write_layer`` /
``finish_layer``'s ops.

Does not own: the eager step (``ModelRunner.decode_step``'s other paths, the reference), batching
several requests per step (``server/batch.py``), or sampling.
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict

import torch
import torch.nn.functional as F

from cachedrag.model.kv_buffer import KVBuffer

#: captured steps kept per runner (each holds its own memory pool: one step's activations)
CACHE_SIZE = 4


class CapturedStep:
    """One captured decode step over one KV buffer (``[L, H_kv, C, D]`` K and V)."""

    def __init__(self, runner, kv) -> None:
        self.runner = runner
        device = runner.device
        capacity = kv.capacity
        self.k, self.v = kv.k, kv.v  # for the capture only (released below)
        self.token = torch.zeros(1, dtype=torch.long, device=device)  # [1]
        self.position = torch.full((1,), min(kv.length, capacity - 1), dtype=torch.long, device=device)  # [1]
        cos, sin = runner.rotary.cos_sin(torch.arange(capacity, device=device), runner.dtype, device)  # [C, D] each
        self.cos, self.sin = cos, sin
        self.bound: weakref.ref | None = None
        self._bind(kv)
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):  # warm-up off the capturing stream (cuBLAS handles, workspaces)
            for _ in range(2):
                self._step()  # writes K/V at the row after the valid ones: the real step overwrites it
        torch.cuda.current_stream(device).wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.logits = self._step()  # [V] float32, overwritten by every replay
        del self.k, self.v  # the graph holds addresses; the buffer's owner decides its lifetime
        self._bind(kv)  # the warm-up and capture wrote a row past the valid ones: zero it again

    def _bind(self, kv) -> None:
        """Make rows past ``kv.length`` finite (zeros): attention runs over the whole capacity and a
        masked key's weight is 0, but 0 x NaN from uninitialised memory would still be NaN."""
        if kv.length < kv.capacity:
            kv.k[:, :, kv.length:].zero_()
            kv.v[:, :, kv.length:].zero_()
        self.bound = weakref.ref(kv)

    def _step(self) -> torch.Tensor:
        return static_step(self.runner, self.k, self.v, self.token, self.position, self.cos, self.sin)

    def step(self, token_id: int, position: int, kv) -> torch.Tensor:
        if self.bound is None or self.bound() is not kv:  # another buffer object at this address
            self._bind(kv)
        self.token.fill_(token_id)
        self.position.fill_(position)
        self.graph.replay()
        kv.length = max(kv.length, position + 1)
        return self.logits.clone()  # [V]: the next replay overwrites the captured output


def static_step(runner, k: torch.Tensor, v: torch.Tensor, token: torch.Tensor, position: torch.Tensor,
                cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The decode step with every shape fixed by the buffer (what a graph captures): ``token`` and
    ``position`` ``[1]`` device tensors, ``k``/``v`` ``[L, H_kv, C, D]`` (rows past ``position`` finite),
    ``cos``/``sin`` ``[C, D]`` for every row; writes the K/V row at ``position``, returns logits ``[V]``.
    With ``runner.row_kernels`` (the Triton backend, plain RMSNorms) the layers run as the runner's
    fused rows (``write_row`` / ``finish_row`` / ``logits_row``), else as ``write_layer`` / ``finish_layer``."""
    kv = KVBuffer(k=k, v=v)  # what write_layer writes into (its length is not read)
    masks = step_masks(runner, position, k.shape[2])  # [1, C] each, one object shared where no layer has a window
    hidden = runner.embed(token)  # [1, Dm]
    if runner.row_kernels:
        delta = None  # the last MLP output, its residual add deferred into the next norm kernel
        for i in range(runner.n_layers):
            q, hidden = runner.write_row(i, hidden, delta, position, kv, cos, sin)  # [H_q, 1, D]; K/V row written
            hidden, delta = runner.finish_row(i, hidden, attend_row(runner, q, k[i], v[i], masks[i]))  # [1, Dm] each
        return runner.logits_row(hidden, delta)[0]  # [V]
    rope = (cos.index_select(0, position), sin.index_select(0, position))  # [1, D] each
    for i in range(runner.n_layers):
        q = runner.write_layer(i, hidden, position, kv, rope=rope)  # [H_q, 1, D]; the K/V row written
        hidden = runner.finish_layer(i, hidden, attend_row(runner, q, k[i], v[i], masks[i]))  # [1, Dm]
    return runner.logits(hidden)[0]  # [V]


def step_masks(runner, position: torch.Tensor, capacity: int) -> list[torch.Tensor]:
    """Per layer, the additive mask ``[1, C]`` (0 / -inf, the runner's dtype) of ``position`` over the
    buffer: built once and shared by every layer when none has a sliding window, else per layer.
    Additive in the query dtype is what SDPA turns a bool mask into, so its result is the same, but
    the conversion runs once per step instead of in every layer."""
    def additive(i: int) -> torch.Tensor:
        visible = runner.attention_mask(i, position, capacity)  # [1, C] bool
        return torch.zeros(visible.shape, dtype=runner.dtype, device=visible.device).masked_fill_(
            ~visible, float("-inf"))  # [1, C]

    if all(w is None for w in runner.windows):
        return [additive(0)] * runner.n_layers
    return [additive(i) for i in range(runner.n_layers)]


def attend_row(runner, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """SDPA of the query rows ``q`` ``[H_q, T, D]`` (the step's one row; the question pre-pass's
    rows, ``model/question_graph.py``) over one layer's whole buffer ``k``/``v`` ``[H_kv, C, D]``
    under the additive ``mask`` ``[T, C]``: ``[T, H_q*D]``."""
    out = F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask[None, None], scale=runner.scaling,
                                         enable_gqa=runner.n_heads != runner.n_kv_heads)  # [1, H_q, T, D]
    return out[0].transpose(0, 1).reshape(q.shape[1], -1)  # [T, H_q*D]


def buffer_key(kv) -> tuple:
    """What a captured step is bound to: the K/V addresses, shape, strides and dtype."""
    return kv.k.data_ptr(), kv.v.data_ptr(), tuple(kv.k.shape), tuple(kv.k.stride()), tuple(kv.v.stride()), kv.k.dtype


class CudaGraphDecode:
    """A runner's decode steps from captured graphs, one per KV buffer (LRU of ``CACHE_SIZE``)."""

    def __init__(self, runner, cache_size: int = CACHE_SIZE) -> None:
        self.runner = runner
        self.cache_size = cache_size
        self._steps: OrderedDict[tuple, CapturedStep] = OrderedDict()
        self._lock = threading.Lock()
        self.captures = 0

    def step(self, token_id: int, position: int, kv) -> torch.Tensor:
        """Logits ``[V]`` (float32) of ``token_id`` at ``position`` over ``kv``'s rows ``[0, position]``."""
        key = buffer_key(kv)
        with self._lock:  # one replay at a time: a step's static inputs and output are shared
            captured = self._steps.get(key)
            if captured is None:
                captured = CapturedStep(self.runner, kv)
                self.captures += 1
                self._steps[key] = captured
                while len(self._steps) > self.cache_size:
                    self._steps.popitem(last=False)
            self._steps.move_to_end(key)
            return captured.step(token_id, position, kv)
