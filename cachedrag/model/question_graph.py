"""The question pre-pass on CUDA, replayed from captured CUDA graphs.

Owns: the question pre-pass with every shape fixed by the request's KV buffer
(``static_question_pass``: the pass's rows padded to a bucket of ``ROW_STEP`` by repeating the last
row, attention and the question's per-key attention over the buffer's whole capacity under the
causal mask of each row's position), its capture per (buffer, row bucket, scoring layers, weight
set) and replay (``QuestionPassGraphs``). The pre-pass runs the question (and fresh rows) through
layers ``0..max(question_layers)`` against the loaded, re-rotated cache and sums, at each scoring
layer, the question's attention to every key (``CachedEngine._question_scores``, the eager pass
and the reference this one is tested against).

Why our own: on a GPU the pre-pass is a few dozen rows through ~17 layers, ~30 launches a layer,
for almost no arithmetic: on an 8B model the host issuing those launches set the pace (~1.2 ms a
layer, ~20 ms of a ~100 ms reuse request, GPU mostly idle; docs/notes/gpu.md). Replayed from a graph
the launches cost the GPU 1-2 µs each and the host one call. ``torch.compile`` with CUDA graphs
would recompile per row count and buffer size; this is the runner's own ops captured as they are,
as the decode step is (``model/cuda_graph.py``), so it stays equal to the eager pass (tests).

Padding: rows past the pass's own repeat its last row (same token, same position), so they write
the same K/V row with the same values and are left out of the question's sum (weight 0); no row
outside the pass is written. Rows of the buffer at or past the prompt's end are zeroed before each
replay: attention runs over the whole capacity, and a masked key's weight 0 times an
uninitialised NaN would still be NaN.

Status: opt-in (``CachedEngine.question_pass = "cuda-graph"``; the default is the eager pass). It
was written on a machine without a GPU: the padded static pass is tested against the eager pass
on the CPU, the capture only by GPU-marked tests not yet run; ``cachedrag bench shapes`` times it
beside the eager pass on CUDA (``cachedrag_graph_pass``). docs/notes/gpu.md says what remains.

Does not own: which requests may take it (the engine: no hidden rows, no leading fresh rows shared
with the prefill, no sliding windows), the layer loads it reads (done before the replay), or what
the scores rank.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence

import torch

from cachedrag.model.cuda_graph import attend_row, buffer_key
from cachedrag.model.kv_buffer import KVBuffer
from cachedrag.model.transfer import device_tensor

#: pass rows are padded to a multiple of this (one captured graph serves every row count in a bucket)
ROW_STEP = 16
#: passes of more rows than this run eagerly (their launches are no longer the cost)
MAX_ROWS = 256
#: captured passes kept per engine (each holds its own memory pool: one pass's activations)
CACHE_SIZE = 4


def static_question_pass(runner, k: torch.Tensor, v: torch.Tensor, ids: torch.Tensor, positions: torch.Tensor,
                         question_weight: torch.Tensor, inside: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                         layers: Sequence[int], weights: Sequence | None = None) -> torch.Tensor:
    """The question pre-pass with every shape fixed by the buffer (what a graph captures).

    ``k``/``v`` ``[L, H_kv, C, D]`` hold the loaded cache (rows past the prompt finite); ``ids`` and
    ``positions`` ``[Tb]`` the pass's rows (sorted positions, padding repeats the last row);
    ``question_weight`` ``[Tb]`` float32, 1 on the question's rows, 0 elsewhere; ``inside`` ``[C]``
    bool, the keys the scores are normalised over (the deferred chunks' tokens); ``cos``/``sin``
    ``[C, D]`` the RoPE tables of every row. Writes the pass rows' K/V at layers ``0..max(layers)``;
    returns ``[C]`` float32: at each of ``layers``, the question's attention probability to every
    key (averaged over heads, summed over the question's rows) normalised to sum 1 over ``inside``,
    summed over the layers."""
    kv = KVBuffer(k=k, v=v)  # what write_layer writes into (its length is not read)
    capacity = k.shape[2]
    last = max(layers)
    keys = torch.arange(capacity, device=k.device)  # [C]
    visible = keys[None, :] <= positions[:, None]  # [Tb, C]
    mask = torch.zeros(visible.shape, dtype=runner.dtype, device=k.device).masked_fill_(
        ~visible, float("-inf"))  # [Tb, C] additive, shared by every layer
    rope = (cos.index_select(0, positions), sin.index_select(0, positions))  # [Tb, D] each
    hidden = runner.embed(ids)  # [Tb, Dm]
    scores = torch.zeros(capacity, dtype=torch.float32, device=k.device)  # [C]
    for layer in range(last + 1):
        lw = weights[layer] if weights is not None else None
        q = runner.write_layer(layer, hidden, positions, kv, rope=rope, weights=lw)  # [H_q, Tb, D]; K/V rows written
        if layer in layers:
            s = question_attention(runner, q, k[layer], visible, question_weight)  # [C]
            scores += s / torch.where(inside, s, 0.0).sum().clamp_min(1e-12)
        if layer < last:
            hidden = runner.finish_layer(layer, hidden, attend_row(runner, q, k[layer], v[layer], mask),
                                         weights=lw)  # [Tb, Dm]
    return scores  # [C]


def question_attention(runner, q: torch.Tensor, k: torch.Tensor, visible: torch.Tensor,
                       question_weight: torch.Tensor) -> torch.Tensor:
    """The attention probability of the weighted rows of ``q`` ``[H_q, Tb, D]`` to every key of
    ``k`` ``[H_kv, C, D]`` under ``visible`` ``[Tb, C]``, averaged over heads and summed over rows
    with ``question_weight`` ``[Tb]``: ``[C]`` float32 (the eager pass's per-key segment mass,
    ``ModelRunner.segment_attention_mass``'s reference path, over the whole buffer)."""
    h_q, rows, _ = q.shape
    h_kv, capacity, _ = k.shape
    scores = torch.matmul(q.reshape(h_kv, (h_q // h_kv) * rows, -1), k.transpose(1, 2))  # [H_kv, G*Tb, C]
    scores = scores.reshape(h_q, rows, capacity).float() * runner.scaling  # [H_q, Tb, C]
    probs = scores.masked_fill(~visible, float("-inf")).softmax(-1).mean(0)  # [Tb, C]
    return (question_weight[:, None] * probs).sum(0)  # [C]


class CapturedQuestionPass:
    """One captured pre-pass over one KV buffer for one row bucket."""

    def __init__(self, runner, kv: KVBuffer, layers: tuple[int, ...], weights, ids: torch.Tensor,
                 positions: torch.Tensor, question_weight: torch.Tensor, inside: torch.Tensor) -> None:
        device = runner.device
        self.runner, self.layers, self.weights = runner, layers, weights
        self.k, self.v = kv.k, kv.v  # for the capture only (released below)
        self.ids, self.positions = ids.clone(), positions.clone()  # [Tb] each, static
        self.question_weight, self.inside = question_weight.clone(), inside.clone()  # [Tb], [C]
        self.cos, self.sin = runner.rotary.cos_sin(torch.arange(kv.capacity, device=device), runner.dtype,
                                                   device)  # [C, D] each
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):  # warm-up off the capturing stream (cuBLAS handles, Triton compiles)
            for _ in range(2):
                self._pass()  # the request's own rows: the replay writes them again, the same
        torch.cuda.current_stream(device).wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        # thread_local: another thread's CUDA work (a store's background promotion) may run meanwhile
        with torch.cuda.graph(self.graph, capture_error_mode="thread_local"):
            self.scores = self._pass()  # [C] float32, overwritten by every replay
        del self.k, self.v  # the graph holds addresses; the buffer's owner decides its lifetime

    def _pass(self) -> torch.Tensor:
        return static_question_pass(self.runner, self.k, self.v, self.ids, self.positions, self.question_weight,
                                    self.inside, self.cos, self.sin, self.layers, self.weights)

    def run(self, ids: torch.Tensor, positions: torch.Tensor, question_weight: torch.Tensor,
            inside: torch.Tensor) -> torch.Tensor:
        self.ids.copy_(ids)
        self.positions.copy_(positions)
        self.question_weight.copy_(question_weight)
        self.inside.copy_(inside)
        self.graph.replay()
        return self.scores.clone()  # [C]: the next replay overwrites the captured output


class QuestionPassGraphs:
    """An engine's question pre-passes from captured graphs (LRU of ``CACHE_SIZE``), or, with
    ``capture=False``, the same padded static pass run eagerly (the CPU-testable path of the
    padding and masking, and a reference for the capture)."""

    def __init__(self, runner, capture: bool = True, cache_size: int = CACHE_SIZE) -> None:
        self.runner = runner
        self.capture = capture
        self.cache_size = cache_size
        self._passes: OrderedDict[tuple, CapturedQuestionPass] = OrderedDict()
        self._lock = threading.Lock()
        self.captures = 0
        self.passes = 0  # passes served (replayed, or run static)
        self.failed: str | None = None  # why a capture failed: every later pass runs eagerly

    def scores(self, kv: KVBuffer, ids: torch.Tensor, positions: list[int], n_question: int,
               inside: Sequence[tuple[int, int]], total: int, layers: Sequence[int],
               weights: Sequence | None = None) -> torch.Tensor | None:
        """The question's attention to every prompt position ``[total]`` (float32), as
        ``CachedEngine._question_scores`` computes it, for pass rows at sorted ``positions`` (the
        question's rows the last ``n_question``) over ``kv``, whose layers ``0..max(layers)`` hold the
        loaded cache; ``ids`` ``[T]`` the prompt's token ids on the device; ``inside`` the
        ``(start, end)`` rows the scores are normalised over. None where the pass has more than
        ``MAX_ROWS`` rows or after a failed capture (``failed`` says why): the caller runs it eagerly."""
        rows = len(positions)
        bucket = -(-rows // ROW_STEP) * ROW_STEP
        if rows == 0 or bucket > MAX_ROWS or n_question < 1 or self.failed is not None:
            return None
        device = self.runner.device
        capacity = kv.capacity
        pad = bucket - rows
        pos = device_tensor(positions + positions[-1:] * pad, device)  # [Tb]
        weight = device_tensor([0.0] * (rows - n_question) + [1.0] * n_question + [0.0] * pad, device,
                               torch.float32)  # [Tb]
        mask = [False] * capacity
        for start, end in inside:
            mask[start:end] = [True] * (end - start)
        inside_t = device_tensor(mask, device, torch.bool)  # [C]
        token_ids = ids.index_select(0, pos)  # [Tb]
        if total < capacity:  # keys past the prompt: finite (attention runs over the whole capacity)
            kv.k[:, :, total:].zero_()
            kv.v[:, :, total:].zero_()
        layer_set = tuple(sorted(set(layers)))
        if not self.capture:
            self.passes += 1
            cos, sin = self.runner.rotary.cos_sin(torch.arange(capacity, device=device), self.runner.dtype,
                                                  device)  # [C, D] each
            return static_question_pass(self.runner, kv.k, kv.v, token_ids, pos, weight, inside_t, cos, sin,
                                        layer_set, weights)[:total]
        key = (buffer_key(kv), bucket, layer_set, None if weights is None else id(weights[0]))
        with self._lock:  # one replay at a time: a pass's static inputs and output are shared
            captured = self._passes.get(key)
            if captured is None:
                try:
                    captured = CapturedQuestionPass(self.runner, kv, layer_set, weights, token_ids, pos, weight,
                                                    inside_t)
                except RuntimeError as error:  # not capturable here: the eager pass, from now on
                    self.failed = f"{type(error).__name__}: {error}".splitlines()[0]
                    return None
                self.captures += 1
                self._passes[key] = captured
                while len(self._passes) > self.cache_size:
                    self._passes.popitem(last=False)
            self._passes.move_to_end(key)
            self.passes += 1
            return captured.run(token_ids, pos, weight, inside_t)[:total]  # [total]
