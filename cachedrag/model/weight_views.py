"""Hugging Face projection modules that read the runner's fused weights instead of holding their own.

Owns: ``FusedRows``, an ``nn.Module`` standing in for one ``nn.Linear`` of a decoder layer (or the
LM head) once the runner's quantised fused weights (``weights.PackedLinear``, int8 or int4) hold its
values: its ``weight`` is its rows of the fused weight, dequantised on each read (a transient copy,
freed after use), its forward ``F.linear`` on that; and ``release_linears``, which swaps them in for
a packed layer's projections. So the model keeps one resident copy of each projection (the packed
one), and whatever reads the Hugging Face modules (the model's own forward, ``linear.py``'s
functions, a reference runner built on the same model) computes with the weights the runner's
kernels use, at the cost of one dequantisation per read.

Does not own: the weight formats (``weights.py``) or when the runner releases (``runner.py``,
``gguf.py``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

QUANTISED_KINDS = ("int8", "int4")  # ``PackedLinear.kind`` values that hold no dense copy of the weight


class FusedRows(torch.nn.Module):
    """Rows ``start:stop`` of a ``PackedLinear``'s weight as a linear module: ``[..., I] -> [..., stop - start]``."""

    def __init__(self, packed, start: int, stop: int, bias: torch.Tensor | None):
        super().__init__()
        self.packed = packed
        self.rows = (start, stop)
        self.in_features, self.out_features = packed.in_features, stop - start
        self.bias = bias if bias is None or isinstance(bias, torch.nn.Parameter) else torch.nn.Parameter(
            bias, requires_grad=False)

    @property
    def weight(self) -> torch.Tensor:
        """The rows as the runner's kernels compute with them: ``[stop - start, I]`` (a new tensor per read)."""
        start, stop = self.rows
        return self.packed.dequantized()[start:stop]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight  # [O, I]
        return F.linear(x, w.to(x.dtype), self.bias.to(x.dtype) if self.bias is not None else None)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fused {self.packed.kind}"


def _swap(parent, name: str, packed, start: int, stop: int) -> None:
    old = getattr(parent, name)
    setattr(parent, name, FusedRows(packed, start, stop, old.bias))


def release_linears(layer, lw) -> None:
    """Point a decoder layer's projections at their rows of ``lw`` (its ``LayerWeights``); the layer's own
    weights are dropped. Only for quantised ``lw`` (dense fused weights already share the modules' storage)."""
    attn, mlp = layer.self_attn, layer.mlp
    q, kv = lw.q_out, lw.kv_out
    for name, (a, b) in (("q_proj", (0, q)), ("k_proj", (q, q + kv)), ("v_proj", (q + kv, q + 2 * kv))):
        _swap(attn, name, lw.qkv, a, b)
    _swap(attn, "o_proj", lw.o, 0, lw.o.out_features)
    _swap(mlp, "gate_proj", lw.gate_up, 0, lw.ff)
    _swap(mlp, "up_proj", lw.gate_up, lw.ff, 2 * lw.ff)
    _swap(mlp, "down_proj", lw.down, 0, lw.down.out_features)


def pack_layers(layers, numerics, release: bool) -> list:
    """Every decoder layer's ``LayerWeights`` in ``numerics``; with ``release``, a quantised layer's own weights
    are released as soon as it is packed (``release_linears``): the peak holds one layer twice, not the model."""
    from cachedrag.model.weights import LayerWeights

    packed = []
    for layer in layers:
        packed.append(LayerWeights(layer, numerics))
        if release and packed[-1].qkv.kind in QUANTISED_KINDS:
            release_linears(layer, packed[-1])
            trim_heap()
    return packed


class HeadRowsEmbedding(torch.nn.Module):
    """The input embedding as rows of the tied LM head's int8 ``PackedLinear``: ``ids [T] -> [T, Dm]``,
    each row dequantised as gathered (``embed_scale`` applied where the model's embedding has one: Gemma)."""

    def __init__(self, head, old):
        super().__init__()
        self.packed = head
        self.num_embeddings, self.embedding_dim = head.out_features, head.in_features
        self.padding_idx = getattr(old, "padding_idx", None)
        scale = getattr(old, "embed_scale", None)
        self.embed_scale = scale.detach().clone() if torch.is_tensor(scale) else scale

    @property
    def weight(self) -> torch.Tensor:
        """The whole table, dequantised (a new tensor per read): ``[V, Dm]``."""
        return self.packed.dequantized()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        p = self.packed
        flat = input_ids.reshape(-1)  # [T]
        rows = p.levels(flat).to(p.scale.dtype) * p.scale.index_select(0, flat)[:, None]  # [T, Dm]
        if self.embed_scale is not None:
            rows = rows * (self.embed_scale.to(rows.dtype) if torch.is_tensor(self.embed_scale) else self.embed_scale)
        return rows.view(*input_ids.shape, self.embedding_dim)


def release_head(model, head):
    """The LM head reads ``head`` (returned) where that is quantised. A head tied to the input embedding
    keeps that table where ``head`` is int4 (the embedding reads it); an int8 one also serves the
    embedding (``HeadRowsEmbedding``: rows gathered and dequantised), so no bf16 table stays."""
    if head.kind not in QUANTISED_KINDS or isinstance(model.lm_head, FusedRows):
        return head
    embedding = model.get_input_embeddings()
    tied = model.lm_head.weight is embedding.weight
    if tied and head.kind != "int8":
        return head
    model.lm_head = FusedRows(head, 0, head.out_features, getattr(model.lm_head, "bias", None))
    if tied:
        model.set_input_embeddings(HeadRowsEmbedding(head, embedding))
    return head


def _tensors_of(packed) -> list[torch.Tensor]:
    """Every tensor a ``PackedLinear`` keeps (its weight in each layout, scales, bias)."""
    int4 = getattr(packed, "int4", None)
    names = ("weight", "packed", "qrows", "tiles", "scale", "bias")
    found = [getattr(packed, n, None) for n in names]
    if int4 is not None:
        found += [int4.tiles, int4.packed, int4.scale_zero, int4.plain]
    return [t for t in found if torch.is_tensor(t)]


def resident_bytes(model, packed=None) -> int:
    """Bytes the model's parameters and buffers and the runner's packed weights (``(layers, head)``) keep
    in memory, each storage counted once (dense fused weights share the modules' storage)."""
    tensors = list(model.parameters()) + list(model.buffers())
    if packed is not None:
        layers, head = packed
        for p in [q for lw in layers for q in (lw.qkv, lw.o, lw.gate_up, lw.down)] + [head]:
            tensors += _tensors_of(p)
    seen, total = set(), 0
    for t in tensors:
        if t.device.type == "meta":
            continue
        if t.is_mkldnn:  # an opaque oneDNN tensor: its own storage
            total += t.numel() * t.element_size()
            continue
        key = (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        if key not in seen:
            seen.add(key)
            total += key[1]
    return total


def trim_heap() -> None:
    """Hand the allocator's freed pages back to the OS (glibc's ``malloc_trim``; nothing elsewhere). glibc
    keeps freed blocks below its mmap threshold, which rises to 32 MB after large frees, so without
    this the released weights and the transients of packing stay in the resident set."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
