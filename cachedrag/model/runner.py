"""RoPE-decoupled forward pass over a Hugging Face causal LM's weights.

Owns: driving the decoder layers ourselves (gpt-fast / nano-vllm style) while reusing the HF
modules (projections, norms, MLP, rotary frequencies), and the per-request working KV buffer.
The primitive every reuse mode builds on is :meth:`ModelRunner.forward_layer`: compute only a
chosen subset of token positions, write their fresh (rotated) K/V into the buffer rows of
those absolute positions, and attend to the whole buffer under an absolute-position causal
mask. Raw (pre-RoPE) K is exposed so chunk caches can be stored position-free.

This module holds construction (numerics, fast weights, which kernels run), the per-layer pieces
(q/k/v, ``write_layer``, ``finish_layer``, ``forward_layer``, ``kv_deviation``, logits) and the
prefill pass. ``ModelRunner`` takes the rest from one module per technique: attention over the
buffer (``runner_attention.py``), the one-token decode step (``runner_decode.py``), cached
segments re-rotated into the buffer (``runner_cached.py``) and the Triton row kernels of the
CUDA-graph step (``runner_rows.py``).

Does not own: what to reuse or recompute (``cachedrag.kvcache``), where caches live
(``cachedrag.store``), or sampling (``generation.py``).

Layout: working K/V are ``[L, H_kv, C, D]`` with row ``j`` = absolute position ``j``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
from pydantic import ValidationError

from cachedrag.errors import ConfigError, ContextWindowError, UnsupportedModelError
from cachedrag.model.attention import PAIRS
from cachedrag.model.gemma import gemma_features, rotary_of, sandwich_finish, softcap
from cachedrag.model.hardware import default_threads, resolve_device, set_threads
from cachedrag.model.kv_buffer import KVBuffer
from cachedrag.model.linear import gated_mlp, linear, reference_linear
from cachedrag.model.loader import check_architecture
from cachedrag.model.norms import RowNorms, plain_rms_norm, rms_norm, rms_norm_rows
from cachedrag.model.runner_attention import CausalBlocks, RunnerAttention
from cachedrag.model.runner_cached import RunnerCachedWrites
from cachedrag.model.runner_decode import DECODE_STEPS, RunnerDecode
from cachedrag.model.runner_rows import RunnerRows
from cachedrag.model.weight_views import pack_layers, release_head
from cachedrag.model.weights import (DTYPES, QUANTIZED, LayerWeights, Numerics, PackedLinear, dtype_name, head_numerics,
                                     pack_head, packable, vnni_available)

# Names other modules import from here (their old home).
_rms_norm, _rms_norm_rows = rms_norm, rms_norm_rows
__all__ = ["DECODE_STEPS", "GRAPH_ROWS", "CausalBlocks", "KVBuffer", "ModelRunner", "RowNorms", "default_threads",
           "plain_rms_norm", "resolve_device", "set_threads"]

GRAPH_ROWS = 256  # a CUDA-graph runner's buffer capacities are multiples of this (graphs are per buffer)


def _architecture(model) -> str:
    """The model's supported architecture name (``UnsupportedModelError`` otherwise)."""
    config = model.config
    architecture = check_architecture(
        getattr(config, "architectures", None) or [type(model).__name__], type(model).__name__,
        getattr(config, "model_type", None),
    )
    if type(model).__name__ != architecture:
        check_architecture([type(model).__name__], type(model).__name__)
    return architecture


def _numerics(model, dtype, weights: str, kv_store_dtype, fast: bool) -> Numerics:
    """The runner's ``Numerics`` (``model/weights.py``), validated; ``ConfigError`` otherwise."""
    param = next(model.parameters())
    try:
        numerics = Numerics(dtype=dtype if dtype is not None or weights in QUANTIZED else param.dtype,
                            weights=weights, kv_store_dtype=kv_store_dtype)
    except ValidationError as exc:
        raise ConfigError("; ".join(e["msg"].removeprefix("Value error, ") for e in exc.errors())) from exc
    if weights in QUANTIZED and not fast:
        raise ConfigError(f"{weights} weights run on the fast path only (fast=True)")
    if weights == "int8-dynamic" and (not vnni_available() or torch.backends.quantized.engine not in ("x86", "fbgemm")):
        raise ConfigError("int8-dynamic weights need fbgemm on a CPU with VNNI (avx512_vnni / avx_vnni); "
                          "use weights='int8'")
    return numerics


class ModelRunner(RunnerAttention, RunnerDecode, RunnerCachedWrites, RunnerRows):
    """Layer-wise forward over a supported HF causal LM (Llama, Mistral, Qwen2, Qwen3).

    Arguments: ``kernel_backend``: ``"auto"`` uses the Triton kernels (``cachedrag.kernels``) on CUDA
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
    native call (``model/fused_decode.py``: float32/bfloat16 dense, int8 and int4 weights, the split-K
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
    ``prepacked``: every layer's ``LayerWeights`` and the LM head's ``PackedLinear`` already built (a
    GGUF load packs them layer by layer, ``model/gguf.py``); used instead of packing ``model``'s weights.
    ``head_weights``: ``"auto"`` (default): the LM head as ``weights.head_numerics`` says (int8 rows for
    int4 runners); ``"dense"``: in ``dtype`` (the reference; the head changes logits, never KV).
    ``release_weights``: int8/int4 weights are the model's only copy: its projections then read them
    (``model/weight_views.py``); for a model this runner alone uses (``from_pretrained``, a GGUF load).
    ``prefill_pairs``: with bfloat16 K/V and queries on an AVX512-BF16 CPU, which of the kernel's
    products multiply bf16 pairs (``vdpbf16ps``; ``model/attention.py``'s ``prefill_attention``):
    ``"scores"`` (default: exact products, the widened path's accuracy), ``"scores+values"``
    (the probabilities rounded to bf16 for the value products, as GPU flash attention does:
    ~4% faster prefills, a little less accurate), ``"none"`` (every element widened to float32).
    """

    load_report = None  # what loading took (``model/gguf.py``'s ``LoadReport``), where the loader measured it

    def __init__(self, model, tokenizer=None, kernel_backend: str = "auto", skinny_linear: bool = True, *,
                 dtype=None, weights: str = "dense", kv_store_dtype=None, fast: bool = True,
                 threads: int | None = None, block_causal: bool = True, compile: bool = False,
                 compile_cache_dir=None, decode_attention: str = "auto", decode_step: str = "auto",
                 prefill_attention: str = "auto", prefill_pairs: str = "scores", prepacked: tuple | None = None,
                 head_weights: str = "auto", release_weights: bool = False):
        """The runner over ``model`` (cast in place to ``dtype`` when it differs; arguments: the class
        docstring)."""
        if kernel_backend not in ("auto", "torch", "triton"):
            raise ValueError(f"kernel_backend must be 'auto', 'torch' or 'triton', got {kernel_backend!r}")
        if head_weights not in ("auto", "dense"):
            raise ConfigError(f"head_weights must be 'auto' or 'dense', got {head_weights!r}")
        self.head_weights = head_weights
        self.architecture = _architecture(model)
        self.numerics = _numerics(model, dtype, weights, kv_store_dtype, fast)
        fast_weights, can_pack = prepacked if fast else None, fast and (prepacked is not None or packable(model))
        if fast_weights is None and can_pack and self.numerics.weights == "int4":  # quantise the weights as loaded (fp32
            fast_weights = self._fast_weights(model, release_weights)  # from the GGUF: its Q4_1 levels), before the cast below
        if next(model.parameters()).dtype != self.numerics.torch_dtype:
            model.to(self.numerics.torch_dtype)
        self.threads = set_threads(threads)
        self._read_model(model, tokenizer)
        self.kernel_backend = self._pick_backend(kernel_backend)
        self.project = linear if skinny_linear else reference_linear
        self.block_causal = block_causal
        self.fast_layers: list[LayerWeights] | None = None
        self.fast_head: PackedLinear | None = None
        if can_pack:
            self.fast_layers, self.fast_head = fast_weights or self._fast_weights(model, release_weights)
            if head_weights == "dense" and self.fast_head.kind in ("int8", "int4"):  # a prepacked quantised head
                self.fast_head = pack_head(model.lm_head, head_numerics(self.numerics, dense=True))
        elif weights in QUANTIZED:
            raise UnsupportedModelError(f"{weights} weights need Llama-family linear projections in every layer")
        self._pick_paths(decode_attention, decode_step, prefill_attention, prefill_pairs, compile, compile_cache_dir)

    def _read_model(self, model, tokenizer) -> None:
        """The model, its layers, shapes, rotary frequencies, windows, dtype and device."""
        config = model.config
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
        self.rotary = rotary_of(model)  # per layer for Gemma 3 (model/gemma.py)
        if self.rotary.head_dim != self.head_dim:
            raise UnsupportedModelError(f"rotary dim {self.rotary.head_dim} != head dim {self.head_dim}")
        self.max_context = int(getattr(config, "max_position_embeddings", 2048))
        self.windows = [self._sliding_window(i) for i in range(self.n_layers)]
        self.sandwich_norms, self.final_softcap = gemma_features(model)  # Gemma's four norms, logit soft-capping
        param = next(model.parameters())
        self.dtype = param.dtype
        self.device = param.device

    def _pick_paths(self, decode_attention: str, decode_step: str, prefill_attention: str, prefill_pairs: str,
                    compile: bool, compile_cache_dir) -> None:
        """Which decode attention, decode step and prefill attention run (each with its note)."""
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

    def _fast_weights(self, model, release: bool) -> tuple[list[LayerWeights], PackedLinear]:
        """Every layer's fused projections and the LM head in the numerics' fast layout (the head's:
        ``weights.head_numerics``, dense with ``head_weights="dense"``); ``release``: quantised
        layers' and head's HF weights are released (``model/weight_views.py``)."""
        try:
            layers = pack_layers(model.model.layers, self.numerics, release)
        except ValueError as exc:  # a shape the weight format cannot take (int4 groups)
            raise UnsupportedModelError(str(exc)) from exc
        head = pack_head(model.lm_head, head_numerics(self.numerics, dense=self.head_weights == "dense"))
        return layers, release_head(model, head) if release else head

    @classmethod
    def from_pretrained(cls, name_or_path: str | None = None, *, dtype=None, weights: str = "dense",
                        kv_store_dtype=None, threads: int | None = None, warmup: bool = True,
                        device: str = "auto", **kwargs) -> "ModelRunner":
        """Load a model (``None``: the embedded default) and build its runner; with ``warmup``,
        run one representative prefill and decode now so the first request pays no one-time cost.
        ``device``: ``"auto"`` (default: CUDA where present, else the CPU), ``"cpu"``, ``"cuda"``
        or ``"cuda:N"``."""
        from cachedrag.model.loader import load_for_runner

        model, tokenizer, name, kwargs["prepacked"], report = load_for_runner(
            name_or_path, dtype, weights, kv_store_dtype, resolve_device(device), kwargs.get("fast", True))
        kwargs.setdefault("release_weights", True)  # the runner alone holds the model it loaded
        runner = cls(model, tokenizer, dtype=name, weights=weights, kv_store_dtype=kv_store_dtype, threads=threads,
                     **kwargs)
        runner.load_report = report
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
        vocab = self.model.get_input_embeddings().num_embeddings
        ids = torch.arange(n) % max(1, vocab - 1) + 1  # [n]
        kv = self.new_kv(n + decode_steps + 8)
        self.prefill(ids, kv=kv)
        for step in range(decode_steps):
            self.decode_step(int(ids[step]), n + step, kv)
        self.prefill(ids[:4], positions=torch.arange(n + decode_steps, n + decode_steps + 4), kv=kv, all_logits=True)
        return time.perf_counter() - start

    def _pick_backend(self, requested: str) -> str:
        if requested != "auto":
            return requested
        if self.device.type == "cuda":
            from cachedrag.kernels import triton_available

            if triton_available():
                return "triton"
        return "torch"

    # ------------------------------------------------------------------ setup helpers
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

    def _projections(self, i: int, weights=None):
        """Layer ``i``'s fused projections: ``weights`` when given (another set, e.g. ``model/scoring.py``'s
        bf16 copies), else the runner's fast layers; None on the reference path (the HF modules)."""
        if weights is not None:
            return weights
        return self.fast_layers[i] if self.fast_layers is not None else None

    def finish_layer(self, i: int, residual: torch.Tensor, attn_out: torch.Tensor, weights=None) -> torch.Tensor:
        """Output projection, residual and MLP of layer ``i``: ``[T, Dm]`` (``weights`` as in ``qkv``)."""
        if self.sandwich_norms:
            return sandwich_finish(self, i, residual, attn_out, self._projections(i, weights))  # [T, Dm]
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
        rope = self.rotary.table_for(i, rope)  # layer i's frequencies (Gemma 3's local and global layers differ)
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
            k = self.rotary.apply(k_raw, positions, self.rotary.table_for(i, rope))  # [H_kv, T, D]
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
            return softcap(self.fast_head(x).float(), self.final_softcap)
        return softcap(self.project(self.model.lm_head, x).float(), self.final_softcap)

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
