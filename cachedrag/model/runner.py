"""RoPE-decoupled forward pass over a Hugging Face causal LM's weights.

Owns: driving the decoder layers ourselves (gpt-fast / nano-vllm style) while reusing the HF
modules (projections, norms, MLP, rotary frequencies), and the per-request working KV buffer.
The primitive every reuse mode builds on is :meth:`ModelRunner.forward_layer`: compute only a
chosen subset of token positions, write their fresh (rotated) K/V into the buffer rows of
those absolute positions, and attend to the whole buffer under an absolute-position causal
mask. Raw (pre-RoPE) K is exposed so chunk caches can be stored position-free.

Does not own: what to reuse or recompute (``cachedrag.kvcache``), where caches live
(``cachedrag.store``), or sampling (``generation.py``).

Layout: working K/V are ``[L, H_kv, C, D]`` with row ``j`` = absolute position ``j``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from pydantic import ValidationError

from cachedrag.errors import ConfigError, ContextWindowError, UnsupportedModelError
from cachedrag.model.attention import PAIRS
from cachedrag.model.linear import gated_mlp, linear, reference_linear
from cachedrag.model.loader import check_architecture
from cachedrag.model.rope import Rotary, rotate_half
from cachedrag.model.transfer import device_tensor
from cachedrag.model.weights import (DTYPES, QUANTIZED, LayerWeights, Numerics, PackedLinear, dtype_name, packable,
                                     vnni_available)

_ATTN_BLOCK = 256  # query rows per block when attention weights are materialised for metadata
_CAUSAL_ROWS = 64  # query rows per block of the block-causal partial-prefill attention (probe: 64 best of 32-256)
_CAUSAL_GAIN = 0.8  # cut into blocks only when they visit at most this share of the single call's query-key pairs
_KERNEL_MIN_ROWS = 48  # float32 prefills of fewer query rows keep SDPA (probe: 25 rows 1.14 vs 1.02 ms, 64 rows 1.96 vs 2.31)
_NO_HIDDEN = torch.empty(0, dtype=torch.uint8)
DECODE_STEPS = ("auto", "fused", "torch", "cuda-graph")
GRAPH_ROWS = 256  # a CUDA-graph runner's buffer capacities are multiples of this (graphs are per buffer)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """LlamaRMSNorm's arithmetic (float32 inside, weight applied in the input dtype). In float32
    ``F.rms_norm`` computes the same values in one fused op (bitwise equal, ~30% faster on one row,
    measured, torch 2.13); for bf16 it rounds differently from HF (weight applied in float32), so
    the HF arithmetic is spelled out (``F.rms_norm`` without a weight on the float32 row, then
    rounding and the weight, is bitwise equal with half the ops, but no faster inside a decode
    step: measured, docs/speed.md)."""
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)  # [T, Dm]
    xf = x.float()  # [T, Dm]
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _rms_norm_rows(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``_rms_norm`` for the decode step in 3-4 kernels instead of ~10: LayerNorm of ``[x, -x]``
    (mean 0, mean square equal to ``x``'s) is ``x * rsqrt(mean(x^2) + eps)`` on its first half, and
    ``F.layer_norm`` is one fused CPU kernel while ``F.rms_norm`` is composite on the CPU in torch
    2.13 (casts, pow, mean, add, rsqrt, mul: measured 1.0-1.5 ms of a decode step, docs/speed.md).
    ``weight`` comes from ``ModelRunner._norm_weights``: for float32 rows it is ``[w, 0]`` (``[2*Dm]``,
    applied inside the kernel; equal to ``F.rms_norm`` to float rounding, the mean of ``[x, -x]``
    is zero only up to it); for bfloat16 rows it is ``w`` (``[Dm]``), applied after the kernel's
    float32 arithmetic is rounded to bf16: HF's order (tests)."""
    n = x.shape[-1]
    both = torch.cat([x, x.neg()], -1)  # [T, 2*Dm]
    if weight.shape[-1] == 2 * n:
        return F.layer_norm(both, (2 * n,), weight, None, eps)[..., :n]  # [T, Dm]
    return weight * F.layer_norm(both, (2 * n,), None, None, eps)[..., :n]  # [T, Dm]


#: HF norm classes of LlamaRMSNorm's form (float32 inside, rounded, then ``weight *``): the row kernels' arithmetic
_PLAIN_RMS_NORMS = ("LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm")


def plain_rms_norm(module) -> tuple[torch.Tensor, float] | None:
    """``(weight [Dm], eps)`` of an HF norm of ``LlamaRMSNorm``'s form (by class: Llama, Mistral, Qwen2,
    Qwen3), else None (another form, e.g. Gemma's ``1 + weight``, keeps its own module)."""
    weight, eps = getattr(module, "weight", None), getattr(module, "variance_epsilon", None)
    if type(module).__name__ not in _PLAIN_RMS_NORMS or not isinstance(weight, torch.Tensor) or weight.dim() != 1:
        return None
    if getattr(module, "bias", None) is not None or not isinstance(eps, (int, float)):
        return None
    return weight.detach(), float(eps)


@dataclass(frozen=True)
class RowNorms:
    """Every RMSNorm of a model as ``(weight, eps)`` for the row kernels (``ModelRunner.row_norms``):
    per layer the input and post-attention norms, the per-head q/k norms (Qwen3) or None, and the final norm."""

    inputs: list[tuple[torch.Tensor, float]]
    posts: list[tuple[torch.Tensor, float]]
    qk: list[tuple[tuple[torch.Tensor, float], tuple[torch.Tensor, float]] | None]
    final: tuple[torch.Tensor, float]


def default_threads() -> int:
    """Cores this process may run on (its CPU affinity), at most torch's own default."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return max(1, min(cores, torch.get_num_threads()))


def set_threads(threads: int | None) -> int:
    """Set torch's intra-op threads (``None``: ``default_threads()``) and return the count.

    Never more than the cores this process may use: more OpenMP threads than cores make every
    small op of a decode step wait on sleeping workers (``cachedrag/executor.py``).
    """
    if threads is not None and threads < 1:
        raise ConfigError(f"threads must be >= 1, got {threads}")
    n = default_threads() if threads is None else threads
    try:
        n = min(n, len(os.sched_getaffinity(0)))
    except AttributeError:
        pass
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)
    return n


@dataclass(frozen=True)
class CausalBlocks:
    """A sorted position set's query rows cut into blocks for ``ModelRunner.attend``: block ``b``
    (rows ``bounds[b][0]:bounds[b][1]``) sees keys ``[0, bounds[b][2])`` only (its last position
    + 1), under the additive mask ``masks[b]`` ``[rows, keys]`` (0 / -inf, in the compute dtype).
    Built once per position set (``ModelRunner.causal_blocks``) and shared by every layer."""

    bounds: list[tuple[int, int, int]]
    masks: list[torch.Tensor]
    hidden: torch.Tensor | None = None  # uint8 [kv_len]: keys no query may see (the prefill kernel's form)


@dataclass
class KVBuffer:
    """Working KV of one request: rotated K and V for every layer; row j holds position j."""

    k: torch.Tensor  # [L, H_kv, C, D]
    v: torch.Tensor  # [L, H_kv, C, D]
    length: int = 0  # rows 0..length-1 are valid

    @property
    def capacity(self) -> int:
        return self.k.shape[2]


def resolve_device(device: str | torch.device) -> torch.device:
    """``"auto"``: CUDA where present, else the CPU; a CUDA device without CUDA is a ConfigError."""
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ConfigError(f"unknown device {device!r}: use auto, cpu or cuda") from exc
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"--device / device={str(device)!r}: no CUDA here (torch.cuda.is_available() is false)")
    if device.type not in ("cpu", "cuda"):
        raise ConfigError(f"device {str(device)!r}: cachedrag runs on cpu or cuda")
    return device


class ModelRunner:
    """Layer-wise forward over a supported HF causal LM (Llama, Mistral, Qwen2, Qwen3)."""

    def __init__(self, model, tokenizer=None, kernel_backend: str = "auto", skinny_linear: bool = True, *,
                 dtype=None, weights: str = "dense", kv_store_dtype=None, fast: bool = True,
                 threads: int | None = None, block_causal: bool = True, compile: bool = False,
                 compile_cache_dir=None, decode_attention: str = "auto", decode_step: str = "auto",
                 prefill_attention: str = "auto", prefill_pairs: str = "scores"):
        """``kernel_backend``: ``"auto"`` uses the Triton kernels (``cachedrag.kernels``) on CUDA
        and torch elsewhere; ``"torch"`` / ``"triton"`` force one (``"triton"`` on CPU needs
        ``TRITON_INTERPRET=1``; used by the equivalence tests).

        ``dtype`` (``"float32"``/``"bfloat16"``, default: the model's), ``weights`` (``"dense"``,
        ``"int8"`` or ``"int4"`` weight-only, both computing in bfloat16) and ``kv_store_dtype`` (dtype of chunk
        caches handed to stores; default ``dtype``) form ``self.numerics`` (``model/weights.py``);
        the model is cast to ``dtype`` in place when it differs. ``fast``: projections run on fused
        weights in the fastest CPU layout of the format (``LayerWeights``); False runs the HF
        modules' own weights (the reference path; int8/int4 need ``fast``). ``skinny_linear`` (only
        without ``fast``): few-row projections take the ``W @ x^T`` layout (``model/linear.py``).
        ``threads``: torch's intra-op thread count for this process (default: the cores this
        process may run on, see ``default_threads``); set once here, never more than the cores.
        ``block_causal``: a partial prefill's scattered query rows attend in blocks, each to the
        keys up to its last position only (``causal_blocks``); False: one call over every key
        under the full mask (the reference path).
        ``compile``: run the decode step's static-shape parts (norms, projections, RoPE, MLP) from
        AOTInductor packages built once and cached on disk (``model/compiled.py``; float32 dense,
        int8 and int4 weights; the first build takes ~20-30 s, later loads ~2 s); attention stays
        eager. Off: the eager fast step (what the batched server step mirrors), unchanged.
        ``compile_cache_dir``: where those packages live (default ``cache_home()/aoti``).
        ``decode_attention``: the one-token step's attention over the KV. ``"kernel"``: the split-K
        C++ kernel (``model/attention.py``: both threads on every head, each K/V row read once for
        the query heads sharing it; compiled at first use and cached on disk); ``"sdpa"``: torch's
        SDPA (the reference); ``"auto"`` (default): the kernel where it builds (fast CPU path), else
        SDPA, the reason in ``decode_attention_note``. The resolved choice is ``self.decode_attention``.
        ``decode_step``: how the one-token step runs. ``"fused"``: every layer and the LM head in one
        native call (``model/fused_decode.py``: float32/bfloat16 dense and int8 weights, the split-K
        attention; built with the attention kernel); ``"torch"``: op by op (``_decode_layer``, or the
        ``compile=True`` packages; the reference); ``"cuda-graph"``: a CUDA runner's step replayed
        from a graph captured once per KV buffer (``model/cuda_graph.py``; buffer capacities then
        round up to ``GRAPH_ROWS``); ``"auto"`` (default): on CUDA the graph step (unless
        ``compile=True``), on CPU fused where it applies and neither ``compile=True`` nor
        ``decode_attention="sdpa"`` asks for the torch step, the reason otherwise in
        ``decode_step_note``. The resolved choice is ``self.decode_step_kind``.
        ``prefill_attention``: a prefill's attention (any sorted set of query positions over the
        request's KV, causal by position). ``"kernel"``: the C++ kernel of ``model/attention.py``
        (AVX-512 CPUs; 1.3-1.6x faster than SDPA per layer); ``"sdpa"``: torch's SDPA with the
        block-causal plan (the reference); ``"auto"`` (default): the kernel where it builds, on CPU
        with torch kernels, else SDPA (the reason in ``prefill_attention_note``). Layers with a
        sliding window, and float32 calls of fewer than ``_KERNEL_MIN_ROWS`` rows, keep SDPA.
        ``prefill_pairs``: with bfloat16 K/V and queries on an AVX512-BF16 CPU, which of the kernel's
        products multiply bf16 pairs (``vdpbf16ps``; ``model/attention.py``'s ``prefill_attention``):
        ``"scores"`` (default: exact products, the widened path's accuracy), ``"scores+values"``
        (the probabilities rounded to bf16 for the value products, as GPU flash attention does:
        ~4% faster prefills, a little less accurate), ``"none"`` (every element widened to float32).
        """
        if kernel_backend not in ("auto", "torch", "triton"):
            raise ValueError(f"kernel_backend must be 'auto', 'torch' or 'triton', got {kernel_backend!r}")
        config = model.config
        self.architecture = check_architecture(
            getattr(config, "architectures", None) or [type(model).__name__], type(model).__name__,
            getattr(config, "model_type", None),
        )
        if type(model).__name__ != self.architecture:
            check_architecture([type(model).__name__], type(model).__name__)
        param = next(model.parameters())
        try:
            self.numerics = Numerics(dtype=dtype if dtype is not None or weights in QUANTIZED else param.dtype,
                                     weights=weights, kv_store_dtype=kv_store_dtype)
        except ValidationError as exc:
            raise ConfigError("; ".join(e["msg"].removeprefix("Value error, ") for e in exc.errors())) from exc
        if weights in QUANTIZED and not fast:
            raise ConfigError(f"{weights} weights run on the fast path only (fast=True)")
        if weights == "int8-dynamic" and (not vnni_available() or torch.backends.quantized.engine not in ("x86", "fbgemm")):
            raise ConfigError("int8-dynamic weights need fbgemm on a CPU with VNNI (avx512_vnni / avx_vnni); "
                              "use weights='int8'")
        fast_weights = None
        if fast and packable(model) and self.numerics.weights == "int4":  # quantise the weights as loaded (fp32
            fast_weights = self._fast_weights(model)  # from the GGUF: its Q4_1 levels), before the cast below
        if param.dtype != self.numerics.torch_dtype:
            model.to(self.numerics.torch_dtype)
        self.threads = set_threads(threads)
        self.model = model
        self.tokenizer = tokenizer
        self.config = config
        self.layers = model.model.layers
        self.n_layers = len(self.layers)
        attn0 = self.layers[0].self_attn
        self.head_dim = attn0.head_dim
        self.n_heads = config.num_attention_heads
        self.n_kv_heads = config.num_key_value_heads
        self.scaling = float(attn0.scaling)
        self.rotary = Rotary.from_model(model)
        if self.rotary.head_dim != self.head_dim:
            raise UnsupportedModelError(f"rotary dim {self.rotary.head_dim} != head dim {self.head_dim}")
        self.max_context = int(getattr(config, "max_position_embeddings", 2048))
        self.windows = [self._sliding_window(i) for i in range(self.n_layers)]
        param = next(model.parameters())
        self.dtype = param.dtype
        self.device = param.device
        self.kernel_backend = self._pick_backend(kernel_backend)
        self.project = linear if skinny_linear else reference_linear
        self.block_causal = block_causal
        self.fast_layers: list[LayerWeights] | None = None
        self.fast_head: PackedLinear | None = None
        if fast and packable(model):
            self.fast_layers, self.fast_head = fast_weights or self._fast_weights(model)
        elif weights in QUANTIZED:
            raise UnsupportedModelError(f"{weights} weights need Llama-family linear projections in every layer")
        self._decode_dtype = self.numerics.decode_dtype
        self._decode_norms = self._norm_weights() if self._decode_fast else None
        self._row_norms: RowNorms | None | bool = False  # False: not looked up yet (row_norms)
        self.decode_attention, self.decode_attention_note, self._attn_kernel = self._pick_decode_attention(decode_attention)
        self.compiled = None
        if compile:
            from cachedrag.model.compiled import CompiledDecode

            self.compiled = CompiledDecode(self, compile_cache_dir)
        self.cuda_graphs = None
        self.decode_step_kind, self.decode_step_note, self.fused = self._pick_decode_step(decode_step)
        if self.decode_step_kind == "cuda-graph":
            from cachedrag.model.cuda_graph import CudaGraphDecode

            self.cuda_graphs = CudaGraphDecode(self)
        self.prefill_attention, self.prefill_attention_note, self._prefill_kernel = self._pick_prefill_attention(
            prefill_attention)
        if prefill_pairs not in PAIRS:
            raise ConfigError(f"prefill_pairs must be one of {', '.join(PAIRS)}, got {prefill_pairs!r}")
        self.prefill_pairs = prefill_pairs

    def _fast_weights(self, model) -> tuple[list[LayerWeights], PackedLinear]:
        """Every layer's fused projections and the LM head in the numerics' fast layout. With int4
        weights the LM head stays bf16: the default GGUF keeps it (the tied embedding) at Q8_0, and
        int4 there moved the next-token distribution ~25x more than int4 projections did
        (teacher-forced KL vs fp32 0.045 vs 0.0018 nats, docs/speed.md) for 2.3 ms per token."""
        try:
            layers = [LayerWeights(layer, self.numerics) for layer in model.model.layers]
            head = model.lm_head
            head_numerics = self.numerics
            if self.numerics.weights == "int4":
                head_numerics = self.numerics.model_copy(update={"weights": "dense"})
            return layers, PackedLinear(head.weight, getattr(head, "bias", None), head_numerics)
        except ValueError as exc:  # a shape the weight format cannot take (int4 groups)
            raise UnsupportedModelError(str(exc)) from exc

    def _norm_weights(self) -> list[tuple[torch.Tensor, torch.Tensor, float, float]]:
        """Per layer (input norm weight, post-attention norm weight, their eps) in the form
        ``_rms_norm_rows`` takes for the decode stream's dtype (float32: ``[w, 0]``), plus the
        final norm's as the last entry: built once, not looked up per step."""
        dt = self._decode_dtype

        def prep(norm) -> torch.Tensor:
            w = norm.weight.detach().to(dt)  # [Dm]
            return torch.cat([w, torch.zeros_like(w)]) if dt == torch.float32 else w  # [2*Dm] or [Dm]

        out = [(prep(layer.input_layernorm), prep(layer.post_attention_layernorm),
                float(layer.input_layernorm.variance_epsilon), float(layer.post_attention_layernorm.variance_epsilon))
               for layer in self.layers]
        norm = self.model.model.norm
        w, eps = prep(norm), float(norm.variance_epsilon)
        out.append((w, w, eps, eps))
        return out

    @classmethod
    def from_pretrained(cls, name_or_path: str | None = None, *, dtype=None, weights: str = "dense",
                        kv_store_dtype=None, threads: int | None = None, warmup: bool = True,
                        device: str = "auto", **kwargs) -> "ModelRunner":
        """Load a model (``None``: the embedded default) and build its runner; with ``warmup``,
        run one representative prefill and decode now so the first request pays no one-time cost.
        ``device``: ``"auto"`` (default: CUDA where present, else the CPU), ``"cpu"``, ``"cuda"``
        or ``"cuda:N"``."""
        from cachedrag.model.loader import load_model

        device = resolve_device(device)

        name = dtype_name(dtype) if dtype is not None else ("bfloat16" if weights in QUANTIZED else "float32")
        load_dtype = DTYPES["float32"] if weights == "int4" else DTYPES[name]  # int4 quantises the fp32 values
        model, tokenizer = load_model(name_or_path, dtype=load_dtype, device=device)
        runner = cls(model, tokenizer, dtype=name, weights=weights, kv_store_dtype=kv_store_dtype, threads=threads,
                     **kwargs)
        if warmup:
            runner.warmup()
        return runner

    @property
    def weight_bytes(self) -> int:
        """Bytes read per decode step by the projections and the LM head (the decode speed limit)."""
        if self.fast_layers is None:
            return sum(m.weight.numel() * m.weight.element_size() for m in self.model.modules()
                       if isinstance(m, torch.nn.Linear))
        return sum(lw.nbytes for lw in self.fast_layers) + self.fast_head.nbytes

    @torch.inference_mode()
    def warmup(self, prompt_tokens: int = 1024, decode_steps: int = 4) -> float:
        """Run one prefill of ``prompt_tokens`` and a few decode and verification steps, so that
        one-time costs (kernel selection and JIT, allocator growth, page faults of the weights)
        are paid at load instead of by the first request. Returns the seconds it took."""
        start = time.perf_counter()
        n = max(8, min(prompt_tokens, self.max_context - decode_steps - 8))
        vocab = self.model.get_input_embeddings().weight.shape[0]
        ids = torch.arange(n) % max(1, vocab - 1) + 1  # [n]
        kv = self.new_kv(n + decode_steps + 8)
        self.prefill(ids, kv=kv)
        for step in range(decode_steps):
            self.decode_step(int(ids[step]), n + step, kv)
        self.prefill(ids[:4], positions=torch.arange(n + decode_steps, n + decode_steps + 4), kv=kv, all_logits=True)
        return time.perf_counter() - start

    def _pick_decode_attention(self, requested: str):
        """``(choice, note, kernel module or None)`` for the one-token step's attention."""
        if requested not in ("auto", "kernel", "sdpa"):
            raise ConfigError(f"decode_attention must be 'auto', 'kernel' or 'sdpa', got {requested!r}")
        if requested == "sdpa":
            return "sdpa", "", None
        if self._decode_norms is None or self.device.type != "cpu":
            if requested == "kernel":
                raise ConfigError("decode_attention='kernel' needs the fast CPU decode path (fast=True, torch kernels, "
                                  "Llama-family layers without q/k norms)")
            return "sdpa", "not the fast CPU decode path", None
        from cachedrag.model import attention

        module = attention.kernel()
        if module is None:
            if requested == "kernel":
                raise ConfigError(f"decode_attention='kernel': the kernel is {attention.kernel_status()}")
            return "sdpa", f"kernel {attention.kernel_status()}", None
        return "kernel", "", module

    def _pick_prefill_attention(self, requested: str):
        """``(choice, note, kernel module or None)`` for a prefill's attention."""
        if requested not in ("auto", "kernel", "sdpa"):
            raise ConfigError(f"prefill_attention must be 'auto', 'kernel' or 'sdpa', got {requested!r}")
        if requested == "sdpa":
            return "sdpa", "", None
        reason = None
        if self.device.type != "cpu" or self.kernel_backend != "torch":
            reason = f"not the CPU torch path ({self.device.type}, {self.kernel_backend} kernels)"
        elif self.head_dim not in (64, 128) or self.n_heads // self.n_kv_heads > 8:
            reason = f"head dim {self.head_dim} / {self.n_heads // self.n_kv_heads} query heads per KV head"
        elif self.dtype not in (torch.float32, torch.bfloat16):
            reason = f"dtype {dtype_name(self.dtype)}"
        module = None
        if reason is None:
            from cachedrag.model import attention

            module = attention.prefill_module()
            if module is None:
                reason = f"kernel {attention.kernel_status()}" if attention.kernel() is None else "built without AVX-512"
        if reason is not None:
            if requested == "kernel":
                raise ConfigError(f"prefill_attention='kernel': {reason}")
            return "sdpa", reason, None
        return "kernel", "", module

    def _pick_decode_step(self, requested: str):
        """``(choice, note, FusedDecode or None)`` for the one-token step."""
        if requested not in DECODE_STEPS:
            raise ConfigError(f"decode_step must be one of {', '.join(DECODE_STEPS)}, got {requested!r}")
        if requested == "torch":
            return "torch", "", None
        if self.device.type == "cuda":
            if requested == "fused":
                raise ConfigError("decode_step='fused' is the CPU step; on CUDA use 'cuda-graph' or 'torch'")
            if self.compiled is not None:
                return "torch", "compile=True (the compiled torch step)", None
            return "cuda-graph", "", None
        if requested == "cuda-graph":
            raise ConfigError(f"decode_step='cuda-graph' needs a CUDA runner (this one is on {self.device.type})")
        from cachedrag.model.fused_decode import FusedDecode, unsupported_reason

        reason = unsupported_reason(self)
        if reason is None and self.compiled is not None:
            reason = "compile=True (the compiled torch step)"
        if reason is None and self.decode_attention != "kernel":
            reason = f"decode_attention={self.decode_attention!r} ({self.decode_attention_note or 'asked for'})"
        if reason is not None:
            if requested == "fused":
                raise ConfigError(f"decode_step='fused' needs the fast CPU step with the attention kernel: {reason}")
            return "torch", reason, None
        return "fused", "", FusedDecode(self)

    def _pick_backend(self, requested: str) -> str:
        if requested != "auto":
            return requested
        if self.device.type == "cuda":
            from cachedrag.kernels import triton_available

            if triton_available():
                return "triton"
        return "torch"

    # ------------------------------------------------------------------ setup helpers
    def _sliding_window(self, i: int) -> int | None:
        attn = self.layers[i].self_attn
        if hasattr(attn, "sliding_window"):  # Qwen2/Qwen3: set per layer from layer_types
            return attn.sliding_window
        if self.architecture == "MistralForCausalLM":
            return getattr(self.config, "sliding_window", None)
        return None

    def new_kv(self, capacity: int, fill: float | None = 0.0) -> KVBuffer:
        """An empty working buffer for ``capacity`` positions (prompt + new tokens), every value
        ``fill``; ``fill=None`` leaves the memory uninitialised, for callers that write every row
        before reading it (the engine: zeroing 2 x 30 MB took ~4.5 ms of every request's TTFT)."""
        if capacity > self.max_context:
            raise ContextWindowError(
                f"request needs {capacity} positions but the model's context window is {self.max_context} tokens"
            )
        if self.cuda_graphs is not None:  # capacities in steps of GRAPH_ROWS, K and V in one block: the
            capacity = min(self.max_context, -(-capacity // GRAPH_ROWS) * GRAPH_ROWS)  # next request of the
            kv = torch.empty((2, self.n_layers, self.n_kv_heads, capacity, self.head_dim), dtype=self.dtype,
                             device=self.device)  # [2, L, H_kv, C, D]; size gets this block back, and its graph
            k, v = kv[0], kv[1]  # [L, H_kv, C, D] each
        else:
            shape = (self.n_layers, self.n_kv_heads, capacity, self.head_dim)
            k = torch.empty(shape, dtype=self.dtype, device=self.device)  # [L, H_kv, C, D]
            v = torch.empty(shape, dtype=self.dtype, device=self.device)  # [L, H_kv, C, D]
        if fill is not None:
            k.fill_(fill)
            v.fill_(fill)
        return KVBuffer(k=k, v=v)

    # ------------------------------------------------------------------ per-layer pieces
    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        assert input_ids.dim() == 1, f"input_ids must be [T], got {tuple(input_ids.shape)}"
        return self.model.model.embed_tokens(input_ids.to(self.device))  # [T, Dm]

    def qkv(self, i: int, hidden: torch.Tensor, with_q: bool = True, weights=None):
        """Raw projections of layer ``i``: q ``[H_q, T, D]`` (None unless ``with_q``), k ``[H_kv, T, D]``
        (pre-RoPE), v ``[H_kv, T, D]``. ``weights``: another set of this layer's fused projections
        (``LayerWeights``' interface, e.g. ``model/scoring.py``'s bf16 copies) instead of the runner's."""
        layer = self.layers[i]
        attn = layer.self_attn
        x = self._input_norm(i, hidden)  # [T, Dm]
        t = x.shape[0]
        lw = self._projections(i, weights)
        if lw is not None:
            q, k, v = lw.qkv(x).split([lw.q_out, lw.kv_out, lw.kv_out], dim=-1)  # [T, H*D] each
            q = q.view(t, -1, self.head_dim) if with_q else None  # [T, H_q, D]
            k = k.view(t, -1, self.head_dim)  # [T, H_kv, D]
            v = v.view(t, -1, self.head_dim)  # [T, H_kv, D]
            if hasattr(attn, "q_norm"):
                k = attn.k_norm(k)
                q = attn.q_norm(q) if q is not None else None
            q = q.transpose(0, 1) if q is not None else None
            return q, k.transpose(0, 1), v.transpose(0, 1)  # [H, T, D] each
        k = self.project(attn.k_proj, x).view(t, -1, self.head_dim)  # [T, H_kv, D]
        v = self.project(attn.v_proj, x).view(t, -1, self.head_dim)  # [T, H_kv, D]
        q = self.project(attn.q_proj, x).view(t, -1, self.head_dim) if with_q else None  # [T, H_q, D]
        if hasattr(attn, "q_norm"):  # Qwen3 normalises q/k per head before RoPE
            k = attn.k_norm(k)
            q = attn.q_norm(q) if q is not None else None
        q = q.transpose(0, 1) if q is not None else None
        return q, k.transpose(0, 1), v.transpose(0, 1)  # [H, T, D] each

    def attention_mask(self, i: int, positions: torch.Tensor, kv_len: int) -> torch.Tensor:
        """Bool ``[T_q, kv_len]``: key j visible to query at ``positions[r]`` iff j <= pos (and within the window)."""
        keys = torch.arange(kv_len, device=self.device)  # [T_k]
        pos = positions.to(self.device)[:, None]  # [T_q, 1]
        mask = keys[None, :] <= pos  # [T_q, T_k]
        window = self.windows[i]
        if window is not None:
            mask &= keys[None, :] > pos - window
        return mask

    def causal_blocks(self, positions: torch.Tensor, kv_len: int,
                      hidden_keys: torch.Tensor | None = None) -> CausalBlocks | None:
        """The block-causal plan of a partial prefill's sorted query ``positions`` ``[T]`` over
        ``kv_len`` keys (for every layer without a sliding window), or None where one call is as
        cheap: a query never sees keys past its own position, so a block of sorted rows needs only
        the keys up to its last position; SDPA's CPU kernel does not skip masked key blocks by
        itself (a partial prefill of 27% of 1.3k tokens: 4.2 vs 6.3 ms per layer, probe).
        Results equal the single call to float rounding (the softmax sums fewer exact zeros).
        ``hidden_keys``: bool ``[kv_len]``, keys no query may see (rows a pass leaves out; they
        must hold finite values, e.g. zeros): always a plan then, with those keys masked too
        (sliding-window layers ignore the plan; on the Triton backend `attend` serves it with SDPA)."""
        t = positions.shape[0]
        if hidden_keys is not None:
            pass  # always a plan: ``attend`` takes the SDPA path for it, also on the Triton backend
        elif not self.block_causal or self.kernel_backend == "triton" or t < 2:
            return None
        pos = positions.to(self.device)
        last = pos[torch.arange(_CAUSAL_ROWS - 1, t + _CAUSAL_ROWS - 1, _CAUSAL_ROWS).clamp_max(t - 1)]  # [B]
        bounds = [(r * _CAUSAL_ROWS, min(t, (r + 1) * _CAUSAL_ROWS), min(kv_len, n + 1))
                  for r, n in enumerate(last.tolist())]
        if hidden_keys is None and sum((e - s) * n for s, e, n in bounds) > _CAUSAL_GAIN * t * kv_len:
            return None
        keys = torch.arange(kv_len, device=self.device)  # [T_k]
        masks = [torch.zeros(e - s, n, dtype=self.dtype, device=self.device).masked_fill_(
            keys[None, :n] > pos[s:e, None], float("-inf")) for s, e, n in bounds]  # [rows, n] each
        if hidden_keys is not None:
            hidden = hidden_keys.to(self.device)  # [T_k]
            masks = [m.masked_fill_(hidden[None, :m.shape[1]], float("-inf")) for m in masks]
        return CausalBlocks(bounds, masks, None if hidden_keys is None else hidden.to(torch.uint8).contiguous())

    def attend(self, i: int, q: torch.Tensor, positions: torch.Tensor, kv: KVBuffer, kv_len: int,
               blocks: CausalBlocks | None = None) -> torch.Tensor:
        """Rotated queries ``[H_q, T_q, D]`` attend to buffer rows ``[0, kv_len)``; returns ``[T_q, H_q*D]``.
        ``blocks``: ``causal_blocks(positions, kv_len)``, used on layers without a sliding window."""
        if self.kernel_backend == "triton" and self.windows[i] is None and (blocks is None or blocks.hidden is None):
            from cachedrag.kernels import selective_attention  # (hidden keys: the masked SDPA blocks below)

            out = selective_attention(q, kv.k[i], kv.v[i], positions, kv_len=kv_len, scale=self.scaling,
                                      backend="triton", validate=False).out  # [H_q, T_q, D]
            return out.transpose(0, 1).reshape(q.shape[1], -1)  # [T_q, H_q*D]
        hidden = _NO_HIDDEN if blocks is None or blocks.hidden is None else blocks.hidden
        out = self._kernel_attention(i, q, kv.k[i], kv.v[i], positions, kv_len, hidden)  # [T_q, H_q*D] or None
        if out is not None:
            return out
        if self._leading_causal(i, positions, kv_len):  # rows 0..T_q-1: SDPA's causal mode skips masked blocks
            t = q.shape[1]
            out = F.scaled_dot_product_attention(
                q.unsqueeze(0), kv.k[i, :, :t].unsqueeze(0), kv.v[i, :, :t].unsqueeze(0), is_causal=True,
                scale=self.scaling, enable_gqa=self.n_heads != self.n_kv_heads,
            )  # [1, H_q, T_q, D]
            return out[0].transpose(0, 1).reshape(t, -1)  # [T_q, H_q*D]
        if blocks is not None and self.windows[i] is None:
            out = torch.empty(q.shape[1], self.n_heads, self.head_dim, dtype=q.dtype, device=q.device)  # [T_q, H_q, D]
            for (s, e, n), mask in zip(blocks.bounds, blocks.masks):
                part = F.scaled_dot_product_attention(
                    q[None, :, s:e], kv.k[i, None, :, :n], kv.v[i, None, :, :n], attn_mask=mask, scale=self.scaling,
                    enable_gqa=self.n_heads != self.n_kv_heads,
                )  # [1, H_q, rows, D]
                out[s:e] = part[0].transpose(0, 1)
            return out.view(q.shape[1], -1)  # [T_q, H_q*D]
        k = kv.k[i, :, :kv_len]  # [H_kv, T_k, D]
        v = kv.v[i, :, :kv_len]  # [H_kv, T_k, D]
        mask = self.attention_mask(i, positions, kv_len)  # [T_q, T_k]
        out = F.scaled_dot_product_attention(
            q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), attn_mask=mask, scale=self.scaling,
            enable_gqa=self.n_heads != self.n_kv_heads,
        )  # [1, H_q, T_q, D]
        return out[0].transpose(0, 1).reshape(q.shape[1], -1)  # [T_q, H_q*D]

    def _kernel_attention(self, i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                          kv_len: int, hidden: torch.Tensor) -> torch.Tensor | None:
        """The prefill kernel's attention ``[T_q, H_q*D]`` of queries ``[H_q, T_q, D]`` over ``k``/``v``
        ``[H_kv, C, D]`` where it takes layer ``i`` (no sliding window; bf16 queries, or at least
        ``_KERNEL_MIN_ROWS`` float32 rows), else None. ``hidden``: uint8 ``[kv_len]`` or empty."""
        if (self._prefill_kernel is None or self.windows[i] is not None
                or (q.dtype != torch.bfloat16 and q.shape[1] < _KERNEL_MIN_ROWS)):
            return None
        return self._prefill_kernel.prefill_attention(q, k, v, positions.to(torch.int64), kv_len, self.scaling,
                                                      hidden, PAIRS[self.prefill_pairs])  # [T_q, H_q*D]

    def _leading_causal(self, i: int, positions: torch.Tensor, kv_len: int) -> bool:
        """True when the queries are exactly positions ``0..T_q-1`` (sorted, as every caller passes
        them) and layer ``i`` has no window shorter than them: then the absolute-position mask is
        SDPA's own causal mask over the first ``T_q`` rows, which its fused CPU kernel computes
        block-sparse (~35% less attention time at 1.3k tokens, results bitwise equal; tests).
        Full prefill and a request with nothing cached take this path."""
        t = positions.shape[0]
        if t < 2 or t > kv_len or (self.windows[i] is not None and self.windows[i] < t):
            return False
        return int(positions[0]) == 0 and int(positions[-1]) == t - 1

    def _projections(self, i: int, weights=None):
        """Layer ``i``'s fused projections: ``weights`` when given (another set, e.g. ``model/scoring.py``'s
        bf16 copies), else the runner's fast layers; None on the reference path (the HF modules)."""
        if weights is not None:
            return weights
        return self.fast_layers[i] if self.fast_layers is not None else None

    def finish_layer(self, i: int, residual: torch.Tensor, attn_out: torch.Tensor, weights=None) -> torch.Tensor:
        """Output projection, residual and MLP of layer ``i``: ``[T, Dm]`` (``weights`` as in ``qkv``)."""
        if self.row_kernels:  # the residual add and the norm in one kernel
            h, mlp = self.finish_row(i, residual, attn_out, weights)  # [T, Dm] each
            return h + mlp
        layer = self.layers[i]
        lw = self._projections(i, weights)
        o = lw.o(attn_out) if lw is not None else self.project(layer.self_attn.o_proj, attn_out)  # [T, Dm]
        h = residual + o  # [T, Dm]
        x = layer.post_attention_layernorm(h)  # [T, Dm]
        return h + (lw.mlp(x) if lw is not None else gated_mlp(layer.mlp, x, self.project))  # [T, Dm]

    def _input_norm(self, i: int, hidden: torch.Tensor) -> torch.Tensor:
        """Layer ``i``'s input norm of ``hidden`` ``[T, Dm]``: one kernel where ``row_kernels``, else the HF module."""
        if self.row_kernels:
            from cachedrag.kernels import rmsnorm

            w, eps = self.row_norms().inputs[i]
            return rmsnorm(hidden, w, eps, backend="triton").out  # [T, Dm]
        return self.layers[i].input_layernorm(hidden)

    # ------------------------------------------------------------------ the CUDA-graph step's fused rows
    @property
    def row_kernels(self) -> bool:
        """Fused row kernels on the Triton backend, when every norm is a plain RMSNorm (``row_norms``):
        the CUDA-graph step (``model/cuda_graph.py``) runs its layers as ``write_row`` / ``finish_row`` /
        ``logits_row``, and prefill layers take their norms (the post-attention one with its residual
        add) and RoPE with the K/V row writes from the same kernels (``kernels/cachedrag/kernels/rmsnorm.py``,
        ``kernels/cachedrag/kernels/rope_rows.py``): ~20 elementwise launches fewer per layer, ~10 ms of GPU time of an
        8B reuse request (docs/gpu.md)."""
        return self.kernel_backend == "triton" and self.row_norms() is not None

    def row_norms(self) -> RowNorms | None:
        """The model's norms for the row kernels, or None where one is not ``plain_rms_norm``'s form
        (then the graph step runs ``write_layer`` / ``finish_layer``'s ops). Looked up once."""
        if self._row_norms is False:
            plans = []
            for layer in self.layers:
                attn = layer.self_attn
                qk = None
                if hasattr(attn, "q_norm"):
                    qk = (plain_rms_norm(attn.q_norm), plain_rms_norm(attn.k_norm))
                    qk = None if None in qk else qk
                    if qk is None:
                        plans = None
                        break
                plans.append((plain_rms_norm(layer.input_layernorm), plain_rms_norm(layer.post_attention_layernorm),
                              qk))
            final = plain_rms_norm(self.model.model.norm)
            ok = plans is not None and final is not None and all(a is not None and b is not None for a, b, _ in plans)
            self._row_norms = RowNorms([a for a, _, _ in plans], [b for _, b, _ in plans], [q for _, _, q in plans],
                                       final) if ok else None
        return self._row_norms

    def write_row(self, i: int, hidden: torch.Tensor, delta: torch.Tensor | None, position: torch.Tensor,
                  kv: KVBuffer, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``write_layer`` for the one row of a decode step, in fused kernels (``row_kernels``):
        ``h = hidden + delta`` (``delta``: the previous layer's MLP output from ``finish_row``, its residual
        add deferred to here; None for the first layer) and the input norm in one launch, the q/k/v
        projection, then q and k rotated to ``position`` (``[1]`` int64 on the device; rows of ``cos``/``sin``
        ``[C, D]``) with the K/V row written into the buffer in one more. Returns ``(q [H_q, 1, D], h [1, Dm])``.
        Equal to ``finish_layer``'s add + ``write_layer`` to float rounding (tests); nothing reads the device."""
        from cachedrag.kernels import rmsnorm, rope_rows

        norms = self.row_norms()
        w, eps = norms.inputs[i]
        normed = rmsnorm(hidden, w, eps, residual=delta, backend="triton")  # [1, Dm] each
        h = hidden if delta is None else normed.hidden  # [1, Dm]
        x = normed.out  # [1, Dm]
        attn = self.layers[i].self_attn
        lw = self._projections(i)
        if lw is not None:
            q, k, v = lw.qkv(x).split([lw.q_out, lw.kv_out, lw.kv_out], dim=-1)  # [1, H*D] each
        else:
            q, k, v = (self.project(m, x) for m in (attn.q_proj, attn.k_proj, attn.v_proj))  # [1, H*D] each
        q = q.view(1, -1, self.head_dim)  # [1, H_q, D]
        k = k.view(1, -1, self.head_dim)  # [1, H_kv, D]
        v = v.view(1, -1, self.head_dim)  # [1, H_kv, D]
        if norms.qk[i] is not None:  # Qwen3: per-head RMSNorm of q and k before RoPE
            (wq, eq), (wk, ek) = norms.qk[i]
            q = rmsnorm(q, wq, eq, backend="triton").out  # [1, H_q, D]
            k = rmsnorm(k, wk, ek, backend="triton").out  # [1, H_kv, D]
        q = rope_rows(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), cos, sin, position, kv.k[i], kv.v[i],
                      backend="triton").q  # [H_q, 1, D]; the K/V row written
        return q, h

    def finish_row(self, i: int, h: torch.Tensor, attn_out: torch.Tensor,
                   weights=None) -> tuple[torch.Tensor, torch.Tensor]:
        """``finish_layer`` in fused kernels, its last residual add deferred: output projection,
        ``h2 = h + o`` with the post-attention norm in one launch, the MLP. Returns ``(h2, mlp_out)``
        ``[T, Dm]`` each: the layer's output is ``h2 + mlp_out``, added by the next ``write_row`` or by
        ``logits_row`` (the decode step), or by ``finish_layer`` (``weights`` as there)."""
        from cachedrag.kernels import rmsnorm

        layer = self.layers[i]
        lw = self._projections(i, weights)
        o = lw.o(attn_out) if lw is not None else self.project(layer.self_attn.o_proj, attn_out)  # [T, Dm]
        w, eps = self.row_norms().posts[i]
        normed = rmsnorm(o, w, eps, residual=h, backend="triton")  # [T, Dm] each
        x = normed.out  # [T, Dm]
        mlp = lw.mlp(x) if lw is not None else gated_mlp(layer.mlp, x, self.project)  # [T, Dm]
        return normed.hidden, mlp

    def logits_row(self, h: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        """``logits(h + delta)`` with the add and the final norm in one launch: ``[1, V]`` float32."""
        from cachedrag.kernels import rmsnorm

        w, eps = self.row_norms().final
        return self._head(rmsnorm(delta, w, eps, residual=h, backend="triton").out)  # [1, V]

    def write_rotated(self, kv: KVBuffer, raw_k: torch.Tensor, v: torch.Tensor, start: int) -> None:
        """Write a cached segment (raw K ``[L, H_kv, T, D]``, V) into buffer rows ``start..start+T``,
        K rotated to those positions (fused Triton re-rotation on the kernel backend)."""
        t = raw_k.shape[2]
        raw_k = raw_k.to(self.dtype)  # stored chunk caches may be in another dtype (kv_store_dtype)
        positions = torch.arange(start, start + t, device=self.device)  # [T]
        kv.v[:, :, start:start + t] = v
        if self.kernel_backend == "triton":
            from cachedrag.kernels import rerotate

            flat_out = kv.k.view(-1, kv.capacity, self.head_dim)  # [L*H_kv, C, D]
            rerotate(raw_k.reshape(-1, t, self.head_dim), positions, self.rotary.inv_freq_on(self.device),
                     out=flat_out, out_rows=positions, backend="triton", validate=False)
            return
        self.rotary.apply_into(raw_k, positions, kv.k[:, :, start:start + t])  # [L, H_kv, T, D]

    def write_rotated_layer(self, kv: KVBuffer, layer: int, raw_k: torch.Tensor, v: torch.Tensor, start: int) -> None:
        """One layer of a cached segment (raw K ``[H_kv, T, D]``, V) into rows ``start..start+T``."""
        t = raw_k.shape[1]
        raw_k = raw_k.to(self.dtype)  # stored chunk caches may be in another dtype (kv_store_dtype)
        positions = torch.arange(start, start + t, device=self.device)  # [T]
        kv.v[layer, :, start:start + t] = v
        if self.kernel_backend == "triton":
            from cachedrag.kernels import rerotate

            rerotate(raw_k, positions, self.rotary.inv_freq_on(self.device), out=kv.k[layer], out_rows=positions,
                     backend="triton", validate=False)
            return
        self.rotary.apply_into(raw_k, positions, kv.k[layer, :, start:start + t])  # [H_kv, T, D]

    def write_rotated_segments(self, kv: KVBuffer, layer: int, parts: list[tuple[torch.Tensor, torch.Tensor, int]],
                               rows: torch.Tensor | None = None) -> torch.Tensor | None:
        """``write_rotated_layer`` for several cached segments ``parts`` = ``[(raw K [H_kv, T_i, D],
        V [H_kv, T_i, D], start_i)]`` of one layer. On the Triton backend in one re-rotation launch
        and one V copy over the concatenated rows (a launch per segment and layer made a 20-chunk
        8B request host-bound on the GPU: docs/gpu.md); ``rows``: their buffer rows ``[sum T_i]``
        on the device, the same for every layer of a request (returned, pass it back next layer).
        Elsewhere segment by segment. Equal to the per-segment writes (tests)."""
        if self.kernel_backend != "triton" or len(parts) < 2:
            for raw_k, v, start in parts:
                self.write_rotated_layer(kv, layer, raw_k, v, start)
            return rows
        from cachedrag.kernels import rerotate

        if rows is None:  # [sum T_i], no wait for the GPU
            rows = device_tensor([p for k, _, start in parts for p in range(start, start + k.shape[1])], self.device)
        raw = torch.cat([k.to(self.dtype) for k, _, _ in parts], dim=1)  # [H_kv, sum T_i, D]
        kv.v[layer].index_copy_(1, rows, torch.cat([v for _, v, _ in parts], dim=1).to(kv.v.dtype))  # rows of [H_kv, C, D]
        rerotate(raw, rows, self.rotary.inv_freq_on(self.device), out=kv.k[layer], out_rows=rows, backend="triton",
                 validate=False)
        return rows

    def forward_layer(
        self, i: int, hidden: torch.Tensor, positions: torch.Tensor, kv: KVBuffer, kv_len: int,
        raw_out: dict | None = None, rope: tuple[torch.Tensor, torch.Tensor] | None = None,
        blocks: CausalBlocks | None = None, out_rows: slice | None = None, weights=None,
    ) -> torch.Tensor:
        """Compute layer ``i`` for the tokens at ``positions`` (sorted, absolute) only.

        Their fresh K (rotated) and V overwrite buffer rows ``positions``; every other row of
        ``[0, kv_len)`` must already hold valid K/V (cached, re-rotated, or computed earlier).
        With ``raw_out``, stores ``raw_out["k"]`` (pre-RoPE) and ``raw_out["v"]`` ``[H_kv, T, D]``
        and ``raw_out["q"]`` (rotated) ``[H_q, T, D]``. ``rope``: ``rotary.cos_sin(positions)``
        computed once for all layers of a pass (computed here when omitted); ``blocks``:
        ``causal_blocks(positions, kv_len)``, likewise once per pass (omitted: one attention call).
        ``out_rows``: only these rows' outputs are wanted (a pass's last layer, where only the
        last position's hidden state feeds the logits): every row's K/V is still written, but
        attention, output projection and MLP run for these rows only; returns ``[len(out_rows), Dm]``.
        ``weights``: this layer's projections from another set than the runner's (see ``qkv``).
        """
        assert hidden.shape[0] == positions.shape[0], "one hidden row per position"
        q = self.write_layer(i, hidden, positions, kv, raw_out, rope, weights=weights)  # [H_q, T, D]
        if out_rows is not None:
            q, positions, hidden, blocks = q[:, out_rows], positions[out_rows], hidden[out_rows], None
        attn = self.attend(i, q, positions, kv, kv_len, blocks)  # [T, H_q*D]
        return self.finish_layer(i, hidden, attn, weights=weights)

    def write_layer(self, i: int, hidden: torch.Tensor, positions: torch.Tensor, kv: KVBuffer,
                    raw_out: dict | None = None, rope: tuple[torch.Tensor, torch.Tensor] | None = None,
                    weights=None) -> torch.Tensor:
        """The first half of ``forward_layer``: q/k/v of the rows at ``positions``, their rotated K
        and V written into the buffer (``raw_out`` as there); returns the rotated queries
        ``[H_q, T, D]``. Alone, it serves a pass that needs a layer's queries and K/V but not its
        output (the question pre-pass's last scoring layer)."""
        q, k_raw, v = self.qkv(i, hidden, weights=weights)  # [H_q, T, D], [H_kv, T, D], [H_kv, T, D]
        if rope is None:
            rope = self.rotary.cos_sin(positions, q.dtype, self.device)  # [T, D] each
        rows = positions.to(self.device)
        if self.row_kernels and q.dtype == rope[0].dtype == kv.k.dtype and rows.dtype == torch.int64:
            from cachedrag.kernels import rope_rows  # q and k rotated, the K/V rows written: one kernel

            table = torch.arange(rows.shape[0], device=self.device)  # [T] this call's rows of ``rope``
            q = rope_rows(q, k_raw, v, rope[0], rope[1], rows, kv.k[i], kv.v[i], table_rows=table,
                          backend="triton").q  # [H_q, T, D]
        else:
            q = self.rotary.apply(q, positions, rope)  # [H_q, T, D]
            k = self.rotary.apply(k_raw, positions, rope)  # [H_kv, T, D]
            kv.k[i].index_copy_(1, rows, k)  # rows of [H_kv, C, D]
            kv.v[i].index_copy_(1, rows, v)
        if raw_out is not None:
            raw_out["k"], raw_out["v"], raw_out["q"] = k_raw, v, q
        return q

    def kv_deviation(self, i: int, hidden: torch.Tensor, positions: torch.Tensor, kv: KVBuffer,
                     rope: tuple[torch.Tensor, torch.Tensor] | None = None, on: str = "v") -> torch.Tensor:
        """How far layer ``i``'s K/V computed from ``hidden`` (the layer's input for the tokens at
        ``positions``) are from what buffer rows ``positions`` hold: ``[T]`` float32, the squared
        L2 distance summed over dims, averaged over KV heads, of V (``on="v"``), rotated K
        (``"k"``) or both added (``"kv"``).

        CacheBlend's token selection: with the cached K/V of a reused chunk in the buffer and
        ``hidden`` computed fresh through layers ``< i``, the tokens with the largest deviation
        are those whose cache misses most of the new context. Reads the buffer, writes nothing.
        """
        if on not in ("v", "k", "kv"):
            raise ValueError(f"kv_deviation: on must be 'v', 'k' or 'kv', got {on!r}")
        _, k_raw, v = self.qkv(i, hidden, with_q=False)  # [H_kv, T, D] each
        rows = positions.to(self.device)
        dev = torch.zeros(v.shape[:2], dtype=torch.float32, device=self.device)  # [H_kv, T]
        if "k" in on:
            if rope is None:
                rope = self.rotary.cos_sin(positions, k_raw.dtype, self.device)  # [T, D] each
            k = self.rotary.apply(k_raw, positions, rope)  # [H_kv, T, D]
            dev += (k - kv.k[i].index_select(1, rows)).float().pow(2).sum(-1)  # [H_kv, T]
        if "v" in on:
            dev += (v - kv.v[i].index_select(1, rows)).float().pow(2).sum(-1)  # [H_kv, T]
        return dev.mean(0)  # [T]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm + LM head: ``[T, Dm] -> [T, V]`` (float32)."""
        if self.row_kernels:
            from cachedrag.kernels import rmsnorm

            w, eps = self.row_norms().final
            x = rmsnorm(hidden, w, eps, backend="triton").out  # [T, Dm]
        else:
            x = self.model.model.norm(hidden)  # [T, Dm]
        return self._head(x)

    def _head(self, x: torch.Tensor) -> torch.Tensor:
        """The LM head of normalised rows ``[T, Dm] -> [T, V]`` (float32)."""
        if self.fast_head is not None:
            return self.fast_head(x).float()
        return self.project(self.model.lm_head, x).float()

    # ------------------------------------------------------------------ whole passes
    @torch.inference_mode()
    def prefill(
        self, input_ids: torch.Tensor, positions: torch.Tensor | None = None, kv: KVBuffer | None = None,
        kv_len: int | None = None, all_logits: bool = False, weights: Sequence | None = None,
    ) -> torch.Tensor:
        """Run all layers for ``input_ids`` at ``positions`` (default ``0..T-1``) against ``kv``.

        Returns logits of the last token ``[V]`` (or ``[T, V]`` with ``all_logits``). With
        ``kv=None`` a fresh buffer is made and kept in ``self.last_kv``. ``weights``: every layer's
        projections from another set (``forward_layer``'s ``weights``, e.g. ``model/scoring.py``'s
        bf16 copies); the LM head stays the runner's.
        """
        if positions is None:
            positions = torch.arange(input_ids.shape[0])
        positions = positions.to(self.device)
        if kv is None:
            kv = self.new_kv(int(positions.max()) + 1)
            self.last_kv = kv
        kv_len = kv_len if kv_len is not None else int(positions.max()) + 1
        hidden = self.embed(input_ids)  # [T, Dm]
        rope = self.rotary.cos_sin(positions, self.dtype, self.device)  # [T, D] each, shared by all layers
        blocks = self.causal_blocks(positions, kv_len)
        for i in range(self.n_layers):
            hidden = self.forward_layer(i, hidden, positions, kv, kv_len, rope=rope, blocks=blocks,
                                        weights=weights[i] if weights is not None else None)
        kv.length = max(kv.length, kv_len)
        return self.logits(hidden if all_logits else hidden[-1:])[0 if not all_logits else slice(None)]

    @torch.inference_mode()
    def decode_step(self, token_id: int, position: int, kv: KVBuffer) -> torch.Tensor:
        """One autoregressive step: token at ``position`` attends to rows ``[0, position]``; logits ``[V]``."""
        if position >= kv.capacity:
            raise ContextWindowError(f"position {position} exceeds the request buffer ({kv.capacity})")
        if self.fused is not None:  # the whole step in one native call (model/fused_decode.py)
            return self.fused.step(token_id, position, kv)
        if self.compiled is not None:  # compile=True: AOTInductor segments, attention eager (model/compiled.py)
            if torch.get_num_threads() == self.compiled.threads:
                return self.compiled.step(token_id, position, kv)
            self.compiled.eager_steps += 1  # thread count changed since the build: the eager step (counted)
        if self.cuda_graphs is not None:  # CUDA: the step replayed from a graph captured per buffer
            return self.cuda_graphs.step(token_id, position, kv)
        ids = torch.tensor([token_id], device=self.device)
        pos = torch.tensor([position], device=self.device)
        hidden = self.embed(ids)  # [1, Dm]
        if self._decode_norms is not None:  # the one-token fast path (``_decode_fast``, fixed at construction)
            hidden = hidden.to(self._decode_dtype)  # [1, Dm] the stream's dtype (float32 for int8-dynamic)
            rope = self.rotary.cos_sin(pos, self._decode_dtype, self.device)  # [1, D] each
            for i in range(self.n_layers):
                hidden = self._decode_layer(i, hidden, position, kv, rope)
            kv.length = max(kv.length, position + 1)
            w, _, eps, _ = self._decode_norms[-1]
            return self.fast_head(_rms_norm_rows(hidden, w, eps)).float()[0]  # [V]
        rope = self.rotary.cos_sin(pos, self.dtype, self.device)  # [1, D] each
        for i in range(self.n_layers):
            hidden = self.forward_layer(i, hidden, pos, kv, position + 1, rope=rope)
        kv.length = max(kv.length, position + 1)
        return self.logits(hidden)[0]  # [V]

    @property
    def _decode_fast(self) -> bool:
        """The one-token path below applies: fused weights, RMSNorm layers, no q/k norms, torch attention."""
        if self.fast_layers is None or self.kernel_backend != "torch":
            return False
        layer = self.layers[0]
        return (not hasattr(layer.self_attn, "q_norm") and hasattr(layer.input_layernorm, "variance_epsilon")
                and hasattr(layer.post_attention_layernorm, "variance_epsilon"))

    def _decode_layer(self, i: int, hidden: torch.Tensor, position: int, kv: KVBuffer, rope) -> torch.Tensor:
        """``forward_layer`` for one token at ``position`` with half the ops: RMSNorm as one LayerNorm
        kernel (``_rms_norm_rows``), q and k rotated in one pass, the K/V row written by index, and no mask (every row ``<= position``
        is visible; a sliding window becomes a slice). Equal to ``forward_layer`` to float rounding
        (tests); per-op overhead, not arithmetic, dominates a decode step of a small model.

        Attention is ``_attend_row``: by default the split-K kernel (``model/attention.py``), which
        shares each K/V row among the G = H_q / H_kv query heads AND splits the keys over the threads
        (grouping heads alone, as G query rows of one SDPA call, was slower inside the step: 3 heads
        split worse over 2 threads than 9; docs/speed.md rounds 3 and 7). The residual stream is in
        ``numerics.decode_dtype`` (float32 for int8-dynamic, whose kernel takes and returns float32;
        K/V rows are cast on write; the kernel reads the float32 q against bf16 K/V as it is)."""
        lw = self.fast_layers[i]
        w1, w2, eps1, eps2 = self._decode_norms[i]
        x = _rms_norm_rows(hidden, w1, eps1)  # [1, Dm]
        qkv = lw.qkv(x)[0]  # [Oq + 2*Okv]
        n_qk = self.n_heads + self.n_kv_heads
        qk = qkv[: lw.q_out + lw.kv_out].view(n_qk, 1, self.head_dim)  # [H_q + H_kv, 1, D]
        qk = qk * rope[0] + rotate_half(qk) * rope[1]  # [H_q + H_kv, 1, D] RoPE at position
        kv.k[i, :, position] = qk[self.n_heads:, 0]  # [H_kv, D]
        kv.v[i, :, position] = qkv[lw.q_out + lw.kv_out:].view(self.n_kv_heads, self.head_dim)  # [H_kv, D]
        out = self._attend_row(i, qk[: self.n_heads, 0], position, kv)  # [1, H_q*D]
        h = hidden + lw.o(out.to(hidden.dtype))  # [1, Dm]
        return h + lw.mlp(_rms_norm_rows(h, w2, eps2))  # [1, Dm]

    def _attend_row(self, i: int, q: torch.Tensor, position: int, kv: KVBuffer) -> torch.Tensor:
        """The one query row per head ``q [H_q, D]`` (rotated, the stream's dtype) at ``position``
        over layer ``i``'s K/V rows up to it (a sliding window becomes a start row): ``[1, H_q*D]``.
        The split-K kernel (``decode_attention="kernel"``: float32 arithmetic, q as given, K/V read in
        the buffer's dtype) or SDPA with ``enable_gqa`` (q cast to the KV dtype). The batched server
        step calls it per request, or the kernel's ``decode_attention_batch`` (each row bit for bit
        this call), so one row there is this step bit for bit."""
        window = self.windows[i]
        start = 0 if window is None else max(0, position + 1 - window)
        if self._attn_kernel is not None:
            return self._attn_kernel.decode_attention(q, kv.k[i], kv.v[i], start, position + 1, self.scaling,
                                                      0).view(1, -1)  # [1, H_q*D]
        k = kv.k[i, :, start:position + 1]  # [H_kv, T_k, D]
        v = kv.v[i, :, start:position + 1]  # [H_kv, T_k, D]
        out = F.scaled_dot_product_attention(q[None, :, None].to(k.dtype), k[None], v[None], scale=self.scaling,
                                             enable_gqa=self.n_heads != self.n_kv_heads)  # [1, H_q, 1, D]
        return out.reshape(1, -1)  # [1, H_q*D]

    # ------------------------------------------------------------------ attention metadata
    def segment_attention_mass(
        self, i: int, q: torch.Tensor, positions: torch.Tensor, kv: KVBuffer, kv_len: int, bounds: list[int],
        reference: bool = False, hidden_keys: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attention mass of each query to each key segment, averaged over heads: ``[T_q, S]``.

        ``bounds`` are S+1 increasing row boundaries ``[b0=0, ..., bS=kv_len]``. With at most
        ``head_dim`` segments (chunk metadata: a handful) it is one fused attention call whose
        values are the segments' indicator columns (``_segment_mass_fused``); with more (per-token
        masses of a few question rows) or ``reference=True``, the softmax is materialised in
        blocks of query rows so no full ``T x T`` matrix is ever held (the reference path; the
        Triton selective-attention kernel yields the same sums as a by-product on CUDA).
        ``hidden_keys``: bool ``[kv_len]``, keys left out of every query's softmax (as
        ``causal_blocks``'); computed on the blockwise path.
        """
        reference = reference or hidden_keys is not None
        if self.kernel_backend == "triton" and self.windows[i] is None and not reference:
            from cachedrag.kernels import selective_attention
            from cachedrag.kernels.selective_attention import MAX_SEGMENTS

            if len(bounds) - 1 <= MAX_SEGMENTS:  # the kernel's per-segment accumulators; more: the paths below
                mass = selective_attention(q, kv.k[i, :, :kv_len], kv.v[i, :, :kv_len], positions, scale=self.scaling,
                                           segment_bounds=bounds, backend="triton", validate=False).segment_mass
                return mass / self.n_heads  # [T_q, S], summed over heads by the kernel -> mean
        if not reference and len(bounds) - 1 <= self.head_dim:
            return self._segment_mass_fused(i, q, positions, kv, kv_len, bounds)
        k = kv.k[i, :, :kv_len]  # [H_kv, T_k, D]
        group = self.n_heads // self.n_kv_heads
        per_key = list(bounds) == list(range(kv_len + 1))  # one segment per key: the mass is the probability
        b = None if per_key else device_tensor(bounds, self.device)  # [S+1]
        out = []
        for start in range(0, q.shape[1], _ATTN_BLOCK):
            qb = q[:, start:start + _ATTN_BLOCK]  # [H_q, b, D]
            scores = torch.matmul(qb.reshape(self.n_kv_heads, group * qb.shape[1], -1), k.transpose(1, 2))
            scores = scores.reshape(self.n_heads, qb.shape[1], kv_len).float() * self.scaling  # [H_q, b, T_k]
            mask = self.attention_mask(i, positions[start:start + _ATTN_BLOCK], kv_len)  # [b, T_k]
            if hidden_keys is not None:
                mask &= ~hidden_keys.to(self.device)[None, :]  # [b, T_k]
            probs = scores.masked_fill(~mask, float("-inf")).softmax(-1).mean(0)  # [b, T_k]
            if per_key:
                out.append(probs)  # [b, T_k]
                continue
            csum = F.pad(probs.cumsum(-1), (1, 0))  # [b, T_k+1]
            out.append(csum[:, b[1:]] - csum[:, b[:-1]])  # [b, S]
        return torch.cat(out, 0)  # [T_q, S]

    def _segment_mass_fused(self, i: int, q: torch.Tensor, positions: torch.Tensor, kv: KVBuffer, kv_len: int,
                            bounds: list[int]) -> torch.Tensor:
        """``segment_attention_mass`` as attention over indicator values: with ``V[j, s] = 1`` iff key
        ``j`` lies in segment ``s``, the attention output of a query is its mass per segment. SDPA's
        fused CPU kernel never materialises the ``[H, T_q, T_k]`` probabilities, so this costs one
        attention call (~5x less than the blockwise softmax at 1.3k tokens, measured); the prefill
        kernel's where ``attend`` would take it. Values are padded to ``head_dim`` columns (SDPA's
        fast CPU kernel wants equal q/k/v head sizes, the kernel a head dim of 64 or 128).
        Equal to the reference to float rounding (tests); bf16 runners get masses rounded to bf16."""
        k = kv.k[i, :, :kv_len]  # [H_kv, T_k, D]
        n_seg = len(bounds) - 1
        edges = torch.tensor(bounds[1:-1], device=self.device)  # [S-1]
        seg = torch.bucketize(torch.arange(kv_len, device=self.device), edges, right=True)  # [T_k] segment of each key
        ind = seg[:, None] == torch.arange(self.head_dim, device=self.device)[None, :]  # [T_k, D], columns >= S empty
        values = ind.to(k.dtype).expand(self.n_kv_heads, kv_len, self.head_dim)  # [H_kv, T_k, D]
        out = self._kernel_attention(i, q, k, values, positions, kv_len, _NO_HIDDEN)  # [T_q, H_q*D] or None
        if out is not None:
            return out.view(q.shape[1], self.n_heads, self.head_dim)[:, :, :n_seg].float().mean(1)  # [T_q, S]
        if self._leading_causal(i, positions, kv_len):  # keys past row T_q-1 are invisible to every query
            t = positions.shape[0]
            out = F.scaled_dot_product_attention(
                q.unsqueeze(0), k[:, :t].unsqueeze(0), values[:, :t].unsqueeze(0), is_causal=True,
                scale=self.scaling, enable_gqa=self.n_heads != self.n_kv_heads,
            )  # [1, H_q, T_q, D]
        else:
            mask = self.attention_mask(i, positions, kv_len)  # [T_q, T_k]
            out = F.scaled_dot_product_attention(
                q.unsqueeze(0), k.unsqueeze(0), values.unsqueeze(0), attn_mask=mask, scale=self.scaling,
                enable_gqa=self.n_heads != self.n_kv_heads,
            )  # [1, H_q, T_q, D]
        return out[0, :, :, :n_seg].float().mean(0)  # [T_q, S]
