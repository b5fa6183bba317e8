"""The fused decode step: every layer of the runner's one-token step, and the LM head, in ONE native call.

Owns: ``FusedDecode`` (``ModelRunner(decode_step="fused")``, the default where it applies): the
runner's fast one-token step (``ModelRunner._decode_layer`` x L, the final norm and the LM head)
for B requests at once, each with its own KV buffer, as one call into the native library
(``csrc/fused_decode.cpp``, compiled with the split-K decode attention kernel into one library that
``native.py`` builds and caches). Per layer: RMSNorm, the fused q/k/v projection, RoPE, the
K/V row writes, the split-K attention (the very code ``decode_attention`` runs), the output
projection, RMSNorm, gate/up, SiLU x up, down, the residuals. Formats: float32 and bfloat16 dense
weights and int8 weight-only (the runner's ``PackedLinear`` weights as they are, no copy: int8 levels
stored as tiles, ``PackedLinear.tiles``, are the packed layout below and are read in place whatever
``packed`` and ``PACK_LIMIT_BYTES`` say; row-major ones where the runner keeps them so), and int4
weight-only (the ``PackedLinear``'s own tiles of 16 rows, ``model/int4.py``, read as they are by
AVX512-BF16 ``vdpbf16ps``, ``csrc/int4_decode.cpp``; the op-by-op step through torch's int4 kernel on
torch's layout is the reference).

Why hand-written: a decode step of a 135M model on a 2-core CPU is ~25 small ops per layer
around 4 one-row matmuls; each op costs a dispatch (and, inside a step, reads its inputs from a
cache the weights just flushed), which put our step 10-20% behind llama.cpp's at the same weight
bytes (docs/speed.md). ``torch.compile`` (AOTInductor, ``compile=True``) fuses the elementwise ops
but keeps one call per layer and the extern matmuls; the attention inside the package did not pay
(round 6). Here one call runs the whole step: one-row matmuls as AVX-512 dot products over the
weight rows in their stored layout (float32 FMA; bf16 pairs through AVX512-BF16 ``vdpbf16ps``;
int8 rows widened to float32 and scaled per row, ``_weight_int8pack_mm``'s arithmetic), split over
torch's intra-op threads by rows (``at::parallel_for``), the small ops in between as plain loops.
float32, bf16 and row-major int8 weights are read from a packed copy (``packed``, default for copies up
to ``PACK_LIMIT_BYTES``; bf16 where the CPU has AVX512-BF16): tiles of 32 rows interleaved by columns
(bf16: column pairs), one load per column (pair) of 16 rows, the inputs' values broadcast,
no horizontal sums; a batch of 8 is then bounded by the weight stream rather than by the load
ports (docs/notes/speed.md round 12). The small ops that follow a projection (bf16 rounding, residual
adds, SiLU(gate) * up from gate/up tiles that hold 16 units' gate and up rows) run in its parallel
region on each tile's outputs (``Epilogue``), not as serial passes over the batch.

Numerics: float32 accumulation everywhere (int4: per group of 32 columns ``scale * sum (128 + q) x +
(zero - 136 scale) * sum x``, exact bf16 products); in a bfloat16 stream every value is rounded to bf16
(round to nearest even) where the torch step rounds it (each projection's output, RoPE's two
products and their sum, the attention output, each residual add, the norms, SiLU and its product),
so it agrees with ``_decode_layer`` to the rounding of the dot products' summation order (tests:
float32 logits to 1e-4; bf16/int8 relative to the logits' spread; greedy tokens). Row ``b`` of a
batch is bit for bit the single call on request ``b``: every dot product and every attention task
is computed in the same order whatever the batch (tests); so the server's batched step and
``CachedEngine.generate`` decode alike.

Does not own: building and caching the library (``model/native.py``), which step the runner
takes (``ModelRunner``), the batched server step's op-by-op paths (``server/batch.py``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from cachedrag.errors import ConfigError
from cachedrag.model import native

SUPPORTED = ("float32 dense", "bfloat16 dense", "int8 weight-only", "int4 weight-only")

# The largest packed copy of the projections made by default (``FusedDecode(packed=None)``): the copy
# doubles those weights' memory, cheap for small models (the default SmolLM2-135M: ~270 MB in bf16,
# ~540 MB in float32, ~135 MB row-major int8), not for a 7B model on a CPU (~14 GB more in bf16), which
# keeps the row-major dot products. int8 levels stored as tiles make no copy: the limit does not apply.
PACK_LIMIT_BYTES = 1 << 30


def unsupported_reason(runner) -> str | None:
    """Why the fused step cannot run this runner's decode (None: it can)."""
    if runner._decode_norms is None or runner.fast_layers is None:
        return "not the fast CPU decode path (fast=True, torch kernels, Llama-family layers without q/k norms)"
    if runner.device.type != "cpu":
        return "not a CPU runner"
    n = runner.numerics
    if n.weights not in ("dense", "int8", "int4") or runner._decode_dtype != runner.dtype:
        return f"{n.weights} weights (the fused step runs {', '.join(SUPPORTED)})"
    if n.weights == "int4" and not _int4_available():
        return "int4 weights on a CPU without AVX512-BF16 (the fused step's int4 kernel)"
    if getattr(runner.config, "hidden_act", None) != "silu":
        return f"activation {getattr(runner.config, 'hidden_act', None)!r} (the fused step runs SiLU MLPs)"
    return None


def _int4_available() -> bool:
    module = native.kernel()
    return module is not None and bool(module.int4_available())


def _parts(p) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A ``PackedLinear``'s weight as the fused step reads it: (weight, int8 scales, bias)."""
    empty = torch.empty(0)
    if p.kind == "int8":  # tiles [T, I, 32] as they are (shared, never copied), or the row-major levels
        w, scale = p.tiles if p.tiles is not None else p.qrows, p.scale
    elif p.kind in ("dense", "mkldnn"):
        w, scale = p.weight, empty
    elif p.kind == "int4":
        w, scale = p.int4.as_tiles(), empty  # the weight's own tiles (a copy only for torch storage)
    else:
        raise ConfigError(f"the fused decode step does not read {p.kind} weights")
    return w.contiguous(), scale, p.bias if p.bias is not None else empty


class FusedDecode:
    """The runner's one-token step for B requests as one native call (module docstring)."""

    def __init__(self, runner, *, prefetch: bool = True, dynamic_rows: bool = True, epilogues: bool = True,
                 packed: bool | None = None):
        """``prefetch``: software prefetch of weight rows in the projections of 4+ requests;
        ``dynamic_rows``: projection rows handed to threads in chunks, not one range each;
        ``epilogues``: the rounding, residual adds and SiLU(gate) * up after a projection done inside
        its parallel region, not as serial passes. All three only move speed (every value the
        same); False, False, False is the reference. ``packed``: the projections (float32, bf16
        or row-major int8) read from a copy in tiles of 32 rows interleaved by columns (bf16: by
        column pairs; one more copy of those weights in memory; sums in another order than the
        row-major dot products, so another rounding, the same for every batch size); None: packed
        where the copy is at most ``PACK_LIMIT_BYTES`` (bf16 ones only on CPUs with AVX512-BF16).
        int8 weights the runner stores as tiles are read from them in any case (no copy, not
        counted in ``packed_bytes``)."""
        reason = unsupported_reason(runner)
        if reason is not None:
            raise ConfigError(f"decode_step='fused' needs {reason}")
        module = native.kernel()
        if module is None:
            raise ConfigError(f"decode_step='fused': the native kernels are {native.kernel_status()}")
        self.runner = runner
        weights, scales, biases, rows = [], [], [], []
        for p in [q for lw in runner.fast_layers for q in (lw.qkv, lw.o, lw.gate_up, lw.down)] + [runner.fast_head]:
            w, s, b = _parts(p)
            weights.append(w)
            scales.append(s)
            biases.append(b)
            rows.append(p.out_features)
        norms, eps = [], []
        for layer in runner.layers:
            for n in (layer.input_layernorm, layer.post_attention_layernorm):
                norms.append(n.weight.detach().to(runner.dtype).float())  # [Dm] the stream's values
                eps.append(float(n.variance_epsilon))
        final = runner.model.model.norm
        norms.append(final.weight.detach().to(runner.dtype).float())
        eps.append(float(final.variance_epsilon))
        if packed is None:  # the copy is of row-major float32 / bf16 / int8 weights (int4 and int8 tiles: none)
            weight_bytes = sum(w.numel() * w.element_size() for w in weights if w.dim() == 2)
            packed = 0 < weight_bytes <= PACK_LIMIT_BYTES
        self._step = module.FusedStep(weights, scales, biases, norms, eps, runner.n_heads, runner.n_kv_heads,
                                      runner.head_dim, runner.fast_layers[0].ff,
                                      [w or 0 for w in runner.windows], runner.scaling,
                                      runner.dtype == torch.bfloat16, bool(packed), rows)
        self.packed_projections = self._step.packed_count()  # how many read packed tiles (0: none)
        self.packed_bytes = self._step.packed_bytes()  # the copies' memory (shared int8 tiles: none)
        self._step.set_prefetch(prefetch)
        self._step.set_dynamic(dynamic_rows)
        self._step.set_epilogues(epilogues)

    def step(self, token_id: int, position: int, kv) -> torch.Tensor:
        """``ModelRunner.decode_step`` for one request (capacity checked by the caller): logits ``[V]``."""
        return self.step_batch([token_id], [position], [kv])[0]

    def step_batch(self, tokens: Sequence[int], positions: Sequence[int], kvs: Sequence) -> torch.Tensor:
        """``tokens[b]`` at ``positions[b]`` into ``kvs[b]`` for every b: logits ``[B, V]`` float32; row b
        is bit for bit ``step(tokens[b], positions[b], kvs[b])``."""
        r = self.runner
        positions = [int(p) for p in positions]
        hidden = r.embed(torch.tensor(list(tokens), device=r.device))  # [B, Dm]
        cos, sin = r.rotary.cos_sin(torch.tensor(positions, device=r.device), r.dtype, r.device)  # [B, D] each
        logits = self._step.forward(hidden, positions, cos, sin, [kv.k for kv in kvs], [kv.v for kv in kvs])  # [B, V]
        for p, kv in zip(positions, kvs):
            kv.length = max(kv.length, p + 1)
        return logits
