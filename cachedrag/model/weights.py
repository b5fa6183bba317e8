"""The runner's fast weight layout: fused projections in bf16/fp32 or int8 weight-only.

Owns: ``Numerics`` (the validated choice of activation dtype and weight format, and the name
it gives the chunk-cache namespace), ``PackedLinear`` (one projection in the layout that is
fastest on the CPU for its format) and ``LayerWeights`` (a decoder layer's projections fused:
q/k/v into one matrix, gate/up into one, so a layer runs 4 matmuls instead of 7).

Formats, measured on this project's machine (Xeon with AVX512-BF16/AMX, one thread, all 211
projections of SmolLM2-135M for one token, ``docs/speed.md``):

- ``float32``: ``F.linear`` (MKL sgemm/sgemv), 44 ms; MKL's packed weights are no faster for one
  row, and the ``W @ x^T`` layout of ``linear.py`` (faster on the EPYC it was tuned on) is slower here.
- ``bfloat16``: oneDNN's packed (``mkldnn._reorder_linear_weight``) bf16 matmul, the kernel
  inductor's CPU backend uses for bf16 linears: 28.5 ms, against 41 ms through ``F.linear``.
- ``int8`` weight-only (per-output-channel symmetric scales, bf16 activations). Storage: ONE copy of
  the int8 levels. Where the native library is built with AVX-512 (``int8_tiles()``) that copy is
  the fused decode step's tile layout (``PackedLinear.tiles`` ``[ceil(O / 32), I, 32]``: 32 rows
  interleaved by columns, the last tile's missing rows zero; ``csrc/int8_tiles.cpp``): the fused
  step reads it as it is, few rows (up to ``INT8_KERNEL_ROWS``) take the same tile kernel
  (``int8_tiles_linear``: float32 sums scaled per row, bias in float32, one bf16 rounding), many
  rows (prefill) dequantise natively (``int8_tiles_dequantize``, bit for bit
  ``q.to(bf16) * scale[:, None]``) and take oneDNN's matmul; row-major reads (``qweight``,
  ``levels``: the tied head serving the embedding, ``compile=True``'s exported kernel) gather from
  the tiles. Elsewhere (no compiler, no AVX-512, ``INT8_TILES`` off: the reference) the levels are
  row-major (``PackedLinear.qrows`` ``[O, I]``): PyTorch's ``_weight_int8pack_mm`` CPU kernel for
  few rows, 21 ms; many rows dequantise the weight to bf16 and take oneDNN's matmul. torchao's
  ``Int8WeightOnlyConfig`` was measured and not used: on the CPU in eager mode it dequantises the
  whole weight on every call, so it reads more bytes than bf16, and its compiled form needs a
  minutes-long inductor compile per model. The quantisation itself is three lines (absmax per row /
  127), kept here.
- ``int8-dynamic``: the same int8 weights, and for few rows (decode) the activations quantised
  too, per row (one row: per token), asymmetric uint8 from the row's min/max, through fbgemm's
  VNNI int8 GEMM (``quantized.linear_dynamic`` on ``quantized.linear_prepack``-ed per-channel
  weights; what ``torch.ao.nn.quantized.dynamic.Linear`` runs): all 121 matmuls of one decode step
  in 8.6-9.2 ms against 11.4-12.4 ms for ``_weight_int8pack_mm`` (2 threads, docs/speed.md).
  The kernel takes and returns float32, so the runner's decode step keeps its residual stream in
  float32 for this format (``ModelRunner._decode_layer``). Not weight-only: quantising the
  activations moves the next-token distribution ~2.4x more than int8 weight-only does (measured,
  docs/speed.md), hence a format of its own. Full 8-bit activations (``reduce_range=False``) need
  VNNI (no int16 saturation); the 7-bit fallback tripled the KL, so without VNNI the format is
  refused. PyTorch marks its quantized-tensor constructors deprecated (pytorch#184982); torch is
  pinned here, and the weight-only ``int8`` format does not depend on them. Prefill (many rows)
  runs as the reference ``int8`` (dequantised weights, oneDNN bf16), so chunk caches are the same;
  its levels stay row-major (fbgemm's prepack reads them).
- ``int4`` weight-only (group-wise asymmetric, groups of ``INT4_GROUP`` = 32 input columns, bf16
  scale and zero per group), kept once (``model/int4.py``): where the native library reads int4
  (AVX512-BF16), as the fused decode step's tiles of 16 rows, few rows through the native
  ``int4_linear`` (the fused step's projection) and many rows through the weight dequantised natively
  into a per-thread transient bf16 buffer and oneDNN's bf16 matmul (the dequantisation is ~3% of a
  1.5B prefill's matmuls); elsewhere in torch's ``_weight_int4pack_mm_for_cpu`` layout (what
  torchao's Int4 CPU layout calls), few rows through that kernel, many through the weight dequantised
  in torch. 0.56 bytes a weight, no resident bf16 copy. The default GGUF is Q4_1 (blocks of 32 with a
  scale and a minimum), so its dequantised weights take at most 16 levels per group of 32: min/max
  quantisation recovers them up to the rounding of scale and zero to bf16. The group quantisation is
  kept here (a few lines); torchao's ``Int4WeightOnlyConfig`` wraps torch's kernel in a tensor subclass.

The LM head (``head_numerics``, ``pack_head``): in the runner's format, except int4 runners read it
as int8 rows (a group-wise int4 head moved the next-token distribution far more than the int4
projections; llama.cpp's Q4_K_M likewise keeps its output matrix at 6 bits). ``head_weights="dense"``
on the runner keeps it in ``dtype`` (the reference). The head writes no KV: not part of the tag.

Does not own: which layers exist or the attention (``runner.py``).
"""

from __future__ import annotations

import warnings
from functools import lru_cache
from typing import Literal

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field, model_validator

from cachedrag.model import native
from cachedrag.model.int4 import INT4_GROUP, Int4Weight, scratch

INT8_KERNEL_ROWS = 16  # up to this many rows, the int8 kernel; above, dequantise + bf16 matmul
# int8 weight-only levels stored as the fused decode step's tiles where the native library reads them
# (``int8_tiles``); False: row-major and torch's kernels everywhere (the reference; tests switch it)
INT8_TILES = True
# torch's int8 kernel (_weight_int8pack_mm) reads input columns 16 at a time: at other widths it
# returns garbage or crashes (torch 2.x, measured); those weights take the dequantised matmul
INT8_KERNEL_COLUMNS = 16
INT4_KERNEL_ROWS = 128  # up to this many rows, the int4 kernel; above, dequantise (one transient bf16 weight) +
# oneDNN: the 1.5B gate/up (17920 x 1536) from native tiles took 26.5 ms both ways at 128 rows, 4.8 vs 25.7 at 16,
# 45.0 vs 40.5 at 256 (docs/notes/cpu-sizes.md); torch's int4 kernel crossed over at 128-256 rows

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
QUANTIZED = ("int8", "int8-dynamic", "int4")
_ALIASES = {"fp32": "float32", "f32": "float32", "float": "float32", "bf16": "bfloat16"}


def dtype_name(dtype) -> str:
    """``"float32"``/``"bfloat16"`` from a torch dtype or a name (``fp32``, ``bf16`` accepted)."""
    if isinstance(dtype, torch.dtype):
        for name, value in DTYPES.items():
            if value == dtype:
                return name
        raise ValueError(f"unsupported dtype {dtype}; choose float32 or bfloat16")
    name = _ALIASES.get(str(dtype).lower(), str(dtype).lower())
    if name not in DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; choose float32 or bfloat16")
    return name


class Numerics(BaseModel):
    """How the runner computes: activation/KV ``dtype``, weight format, stored-KV dtype."""

    model_config = ConfigDict(frozen=True)

    dtype: Literal["float32", "bfloat16"] = Field("float32", description="activations, working KV and dense weights")
    weights: Literal["dense", "int8", "int8-dynamic", "int4"] = Field(
        "dense", description="dense: weights in `dtype`; int8: int8 weight-only with per-channel scales; "
        "int8-dynamic: the same int8 weights with decode activations quantised per token (fbgemm, needs VNNI); "
        "int4: int4 weight-only, groups of 32 with scale and zero (the quantised formats need bfloat16)")
    kv_store_dtype: Literal["float32", "bfloat16"] | None = Field(
        None, description="dtype of chunk caches handed to the store (None: `dtype`); bfloat16 halves tier bytes")

    @model_validator(mode="before")
    @classmethod
    def _names(cls, data):
        if isinstance(data, dict):
            data = dict(data)
            if data.get("dtype") is None:
                data["dtype"] = "bfloat16" if data.get("weights") in QUANTIZED else "float32"
            else:
                data["dtype"] = dtype_name(data["dtype"])
            if data.get("kv_store_dtype") is not None:
                data["kv_store_dtype"] = dtype_name(data["kv_store_dtype"])
        return data

    @model_validator(mode="after")
    def _quantized_needs_bf16(self):
        if self.weights == "int8-dynamic" and self.dtype != "bfloat16":
            raise ValueError("int8-dynamic weights prefill in bfloat16 and keep bfloat16 KV (only decode rows run "
                             "the float32-in/out int8 kernel); use dtype='bfloat16'")
        if self.weights in QUANTIZED and self.dtype != "bfloat16":
            raise ValueError(f"{self.weights} weights compute with bfloat16 activations (the CPU {self.weights} kernel "
                             "is 5-30x slower with float32 ones); use dtype='bfloat16'")
        return self

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def store_dtype(self) -> torch.dtype:
        return DTYPES[self.kv_store_dtype or self.dtype]

    @property
    def decode_dtype(self) -> torch.dtype:
        """dtype of the decode step's residual stream: float32 for ``int8-dynamic`` (its kernel takes
        and returns float32), else ``dtype``."""
        return torch.float32 if self.weights == "int8-dynamic" else self.torch_dtype

    @property
    def tag(self) -> str:
        """The namespace's dtype field: caches of other numerics never serve this runner."""
        tag = self.dtype + {"dense": "", "int8": "+int8w", "int8-dynamic": "+int8w-a8dyn",
                            "int4": f"+int4w-g{INT4_GROUP}"}[self.weights]
        if self.kv_store_dtype and self.kv_store_dtype != self.dtype:
            tag += f"+kv-{self.kv_store_dtype}"
        return tag


class PackedLinear:
    """``x @ W^T + b`` for ``x`` ``[..., I]`` with ``W`` ``[O, I]`` in a CPU-friendly layout.

    int8 (weight-only, ``Numerics.weights="int8"``) keeps ONE copy of the levels: ``tiles`` (the fused
    decode step's layout, module docstring) where ``int8_tiles()`` has the native library, else ``qrows``
    ``[O, I]`` row-major (int8-dynamic always: fbgemm's prepack reads them); the other is None."""

    # int8 [ceil(O / 32), I, 32]: element [t, k, r] = level [32 t + r, k]; gate/up ones [ceil(O / 32), I, 2, 16]:
    # element [t, k, h, r] = level [h O / 2 + 16 t + r, k]
    tiles: torch.Tensor | None = None
    qrows: torch.Tensor | None = None  # int8 [O, I] row-major

    def __init__(self, weight: torch.Tensor | list[torch.Tensor], bias: torch.Tensor | None, numerics: Numerics,
                 gate_up: bool = False):
        """``weight``: ``[O, I]``, or its row blocks in order (quantised formats read them one at a time,
        never concatenating them: no float copy of the fused weight while packing). ``gate_up``: a fused
        gate/up weight (gate rows, then as many up rows); int8 tiles of one without bias hold 16 units'
        gate and up rows each (``[T, I, 2, 16]``, the fused step's SiLU(gate) * up epilogue)."""
        parts = [w.detach() for w in weight] if isinstance(weight, (list, tuple)) else [weight.detach()]
        self.out_features, self.in_features = sum(w.shape[0] for w in parts), parts[0].shape[1]
        self.kind = "dense"
        self.bias = bias.detach().to(numerics.torch_dtype) if bias is not None else None
        cpu = parts[0].device.type == "cpu"
        self.weight = None  # [O, I] below, unless quantised on the CPU
        if not cpu or numerics.weights not in QUANTIZED:
            self.weight = (parts[0] if len(parts) == 1 else torch.cat(parts)).to(numerics.torch_dtype).contiguous()
        if not cpu:
            return
        self.dynamic = None
        if numerics.weights in ("int8", "int8-dynamic"):
            qweight, scale = int8_rows(parts)  # [O, I] int8, [O] float32
            self.scale = scale.to(numerics.torch_dtype)  # [O]
            self.weight = None
            self.kind = "int8"
            module = int8_tiles() if numerics.weights == "int8" else None
            if module is not None:
                pairs = gate_up and bias is None and self.out_features % 2 == 0
                self.tiles = module.int8_tiles_pack(qweight, pairs)  # [T, I, 32] / [T, I, 2, 16]; row-major dropped
            else:
                self.qrows = qweight
            if numerics.weights == "int8-dynamic":
                self.dynamic = _prepack_dynamic(qweight, self.scale, self.bias)
        elif numerics.weights == "int4":  # the packed codes only: prefill dequantises one weight per call
            self.int4 = Int4Weight(parts)  # kept once: native tiles or torch's layout (model/int4.py)
            self.weight = None
            self.kind = "int4"
        elif numerics.dtype == "bfloat16" and torch.backends.mkldnn.is_available():
            self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight, 1)  # oneDNN blocked layout
            self.kind = "mkldnn"

    @property
    def qweight(self) -> torch.Tensor | None:
        """int8's levels row-major ``[O, I]``: ``qrows``, or read from ``tiles`` (a new tensor, ``O * I`` bytes)."""
        if self.tiles is not None and self.tiles.dim() == 4:  # gate/up: [T, I, 2, 16] -> [2, 16 T, I]
            halves = self.tiles.permute(2, 0, 3, 1).reshape(2, -1, self.in_features)[:, : self.out_features // 2]
            return halves.reshape(self.out_features, self.in_features)
        if self.tiles is not None:
            return self.tiles.permute(0, 2, 1).reshape(-1, self.in_features)[: self.out_features].contiguous()
        return self.qrows

    def levels(self, ids: torch.Tensor) -> torch.Tensor:
        """int8's levels of rows ``ids`` ``[n]``: ``[n, I]`` (gathered from the tiles where stored so)."""
        if self.tiles is not None and self.tiles.dim() == 4:
            half = (ids >= self.out_features // 2).long()  # [n] 0: gate, 1: up
            unit = ids - half * (self.out_features // 2)  # [n]
            return self.tiles[unit // 16, :, half, unit % 16]  # [n, I]
        if self.tiles is not None:
            return self.tiles[ids // 32, :, ids % 32]  # [n, I]
        return self.qrows.index_select(0, ids)

    @property
    def nbytes(self) -> int:
        """Bytes a few-row (decode) call reads (int8 tiles: their zero rows past ``O`` not counted)."""
        if self.kind == "int8":
            return self.out_features * self.in_features + self.scale.numel() * self.scale.element_size()
        if self.kind == "int4":
            return self.int4.nbytes
        return self.weight.numel() * self.weight.element_size()

    @property
    def resident_bytes(self) -> int:
        """Bytes this projection keeps in memory (every copy: the oneDNN-packed one included)."""
        if self.kind == "int4":
            return self.int4.resident_bytes() + (self.bias.nbytes if self.bias is not None else 0)
        packed = getattr(self, "packed", None)
        extra = packed.numel() * packed.element_size() if packed is not None else 0
        if self.tiles is not None:  # the zero rows that pad the last tile
            extra = self.tiles.numel() - self.out_features * self.in_features
        return self.nbytes + extra + (self.bias.nbytes if self.bias is not None else 0)

    def dequantized(self, out: torch.Tensor | None = None) -> torch.Tensor:
        """The weight as the kernel sees it, in the compute dtype: ``[O, I]`` (native int8 tiles and int4: into
        ``out`` when given, a reused buffer)."""
        if self.kind == "int8" and self.tiles is not None:  # bit for bit the expression below
            return _native().int8_tiles_dequantize(self.tiles, self.scale, self.out_features, out)
        if self.kind == "int8":
            return self.qrows.to(self.scale.dtype) * self.scale[:, None]
        if self.kind == "int4":
            return self.int4.dequantized(out)
        return self.weight

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "mkldnn":
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        if self.kind not in ("int8", "int4"):
            return F.linear(x, self.weight, self.bias)
        rows = x.numel() // x.shape[-1]
        out = self._few_rows(x.reshape(rows, x.shape[-1])) if rows else None  # [N, O] or None
        if out is not None:
            return out.reshape(*x.shape[:-1], self.out_features)
        buffered = self.kind == "int4" or (self.tiles is not None and self.scale.dtype == torch.bfloat16)
        w = self.dequantized(scratch(self.out_features, self.in_features) if buffered else None)  # [O, I] transient
        return F.linear(x, w, self.bias)

    def _few_rows(self, flat: torch.Tensor) -> torch.Tensor | None:
        """``flat`` ``[N, I]`` through the format's few-row kernel (``[N, O]``), or None where ``N`` is past it
        or the kernel cannot take this weight (the caller then multiplies the dequantised weight)."""
        n = flat.shape[0]
        if self.kind == "int4":
            return self.int4.matmul(flat, self.bias) if n <= INT4_KERNEL_ROWS else None
        if n > INT8_KERNEL_ROWS:
            return None
        if self.tiles is not None:  # the fused step's tile kernel: float32 sums, bias, one rounding
            bias = self.bias if self.bias is not None else flat.new_empty(0)
            return _native().int8_tiles_linear(flat, self.tiles, self.scale, bias, self.out_features)
        if self.dynamic is not None:  # fbgemm: float32 in and out, bias inside; out in x's dtype
            return torch.ops.quantized.linear_dynamic(flat.float(), self.dynamic, False).to(flat.dtype)
        if self.in_features % INT8_KERNEL_COLUMNS:
            return None
        out = torch._weight_int8pack_mm(flat, self.qrows, self.scale)  # [N, O]
        return out + self.bias if self.bias is not None else out


def head_numerics(numerics: Numerics, dense: bool = False) -> Numerics:
    """The LM head's numerics: the runner's, except that an int4 runner's head is int8 per row (a
    group-wise int4 head moved the next-token distribution ~25x more than the int4 projections did,
    module docstring), and ``dense=True``: the head in ``numerics.dtype`` (the reference). The head
    writes no KV, so it is not part of ``Numerics.tag``; where a released int8 head also serves the
    tied embedding (``weight_views.release_head``), the model's fingerprint changes with it."""
    if dense:
        return numerics.model_copy(update={"weights": "dense"})
    if numerics.weights == "int4":
        return numerics.model_copy(update={"weights": "int8"})
    return numerics


def pack_head(head: torch.nn.Module, numerics: Numerics) -> PackedLinear:
    """The LM head module (``weight`` ``[V, Dm]``) as a ``PackedLinear`` in ``numerics``
    (``head_numerics``' choice), quantised from the weight in ``numerics.dtype`` (as a GGUF load packs
    it, whatever dtype the model holds now); ``ValueError`` where its weight was never loaded
    (``meta``: an untied GGUF head kept quantised only)."""
    if head.weight.device.type == "meta":
        raise ValueError("the LM head's weight was loaded quantised only (an untied GGUF head); no dense head")
    return PackedLinear(head.weight.to(numerics.torch_dtype), getattr(head, "bias", None), numerics)


def int8_rows(weight: torch.Tensor | list[torch.Tensor], block: int = 4096) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-output-row symmetric int8: ``q = round(w / s)``, ``s = absmax(row) / 127``; ``(q [O, I] int8,
    s [O] float32)``. Computed ``block`` rows at a time (each row alone, so the result is the same for
    any block): a large weight (Gemma's 262k-row tied embedding as LM head) never has float32 copies.
    ``weight`` may be a list of row blocks (quantised in order, as if concatenated)."""
    parts = list(weight) if isinstance(weight, (list, tuple)) else [weight]
    q = torch.empty(sum(p.shape[0] for p in parts), parts[0].shape[1], dtype=torch.int8)  # [O, I]
    scale = torch.empty(q.shape[0], dtype=torch.float32)  # [O]
    row = 0
    for part in parts:
        for start in range(0, part.shape[0], block):
            w = part[start:start + block].float()  # [b, I]
            s = w.abs().amax(dim=1).clamp_min(1e-12) / 127.0  # [b]
            q[row:row + w.shape[0]] = torch.round(w / s[:, None]).clamp(-127, 127).to(torch.int8)
            scale[row:row + w.shape[0]] = s
            row += w.shape[0]
    return q, scale


def _native():
    return native.kernel()


def int8_tiles():
    """The native library where int8 weight-only levels are stored as tiles (``INT8_TILES``, the library
    built, AVX-512: ``int8_tiles_available``), else None (row-major levels, torch's kernels)."""
    if not INT8_TILES:
        return None
    module = _native()
    return module if module is not None and module.int8_tiles_available() else None


@lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """The CPU's instruction-set flags from /proc/cpuinfo (Linux); empty where it cannot be read."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def vnni_available() -> bool:
    """True when the CPU has VNNI (int8 dot products into int32: full 8-bit activations without
    int16 saturation in fbgemm)."""
    return bool({"avx512_vnni", "avx_vnni"} & cpu_flags())


def _prepack_dynamic(qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None):
    """fbgemm's packed form of per-channel int8 weights ``[O, I]`` (scales ``[O]``, zero points 0),
    for ``quantized.linear_dynamic``."""
    if not vnni_available() or torch.backends.quantized.engine not in ("x86", "fbgemm"):
        raise ValueError("int8-dynamic weights need fbgemm (quantized engine x86/fbgemm) on a CPU with VNNI "
                         f"(engine {torch.backends.quantized.engine!r}, VNNI {vnni_available()}); use weights='int8'")
    with warnings.catch_warnings():  # the quantized-tensor constructor is marked deprecated (module docstring)
        warnings.simplefilter("ignore", UserWarning)
        q = torch._make_per_channel_quantized_tensor(qweight, scale.double(),
                                                     torch.zeros(qweight.shape[0], dtype=torch.long), 0)  # [O, I] qint8
    return torch.ops.quantized.linear_prepack(q, bias.float() if bias is not None else None)


def _share(packed: PackedLinear, modules) -> None:
    """Point the HF modules' weights at rows of a fused weight that holds their values as they are
    (dense, or bf16 beside its oneDNN-packed copy), so fusing copies nothing (same values; the
    reference path and the fingerprint keep reading them): a bf16 1.5B model is 2.6 GB lighter."""
    if packed.kind not in ("dense", "mkldnn") or packed.weight.dtype != modules[0].weight.dtype:
        return
    row = 0
    for m in modules:
        n = m.weight.shape[0]
        m.weight = torch.nn.Parameter(packed.weight[row:row + n], requires_grad=False)  # view [n, I]
        row += n


def _cat_bias(*modules) -> torch.Tensor | None:
    biases = [m.bias for m in modules]
    if all(b is None for b in biases):
        return None
    return torch.cat([b.detach() if b is not None else torch.zeros(m.weight.shape[0], dtype=m.weight.dtype)
                      for b, m in zip(biases, modules)])


class LayerWeights:
    """One decoder layer's projections in the fast layout: ``qkv`` ``[Dm] -> [H_q*D + 2*H_kv*D]``,
    ``o``, ``gate_up`` ``[Dm] -> [2*Dff]``, ``down``; norms and the activation stay the HF modules."""

    def __init__(self, layer, numerics: Numerics):
        attn, mlp = layer.self_attn, layer.mlp
        self.q_out = attn.q_proj.weight.shape[0]
        self.kv_out = attn.k_proj.weight.shape[0]
        w = [attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]  # row blocks of [Oq + 2*Okv, Dm]
        self.qkv = PackedLinear(w, _cat_bias(attn.q_proj, attn.k_proj, attn.v_proj), numerics)
        self.o = PackedLinear(attn.o_proj.weight, attn.o_proj.bias, numerics)
        self.ff = mlp.gate_proj.weight.shape[0]
        gu = [mlp.gate_proj.weight, mlp.up_proj.weight]  # row blocks of [2*Dff, Dm]
        self.gate_up = PackedLinear(gu, _cat_bias(mlp.gate_proj, mlp.up_proj), numerics, gate_up=True)
        self.down = PackedLinear(mlp.down_proj.weight, mlp.down_proj.bias, numerics)
        self.act = mlp.act_fn
        _share(self.qkv, (attn.q_proj, attn.k_proj, attn.v_proj))
        _share(self.gate_up, (mlp.gate_proj, mlp.up_proj))

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        """``down(act(gate(x)) * up(x))``: ``[T, Dm] -> [T, Dm]``."""
        gate, up = self.gate_up(x).split(self.ff, dim=-1)  # [T, Dff] each
        return self.down(self.act(gate) * up)

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in (self.qkv, self.o, self.gate_up, self.down))


def packable(model) -> bool:
    """True when every layer has the Llama-family projections the fast layout fuses."""
    try:
        for layer in model.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            for m in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj):
                if not isinstance(m, torch.nn.Linear):
                    return False
            if not hasattr(mlp, "act_fn"):
                return False
    except AttributeError:
        return False
    return True
