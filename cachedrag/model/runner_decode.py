"""The runner's one-token decode step: which step runs, and the torch step itself.

Owns: ``RunnerDecode`` (mixed into ``ModelRunner``): ``decode_step`` (a token at a position
attending to the buffer's rows up to it) through the fused native step (``fused_decode.py``), the
compiled segments (``compiled.py``), a replayed CUDA graph (``cuda_graph.py``), the fast torch
step (``_decode_layer``: one LayerNorm kernel per RMSNorm, q and k rotated in one pass, the K/V
row written by index) or ``forward_layer`` (the reference); the one-row attention (``_attend_row``:
the split-K kernel of ``attention.py`` or SDPA); the choices between them (``_pick_decode_attention``,
``_pick_decode_step``) and the decode norms' weights (``_norm_weights``).

Does not own: building the native library (``native.py``), batching requests (``server/batch.py``),
sampling (``generation.py``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from cachedrag.errors import ConfigError, ContextWindowError
from cachedrag.model import native
from cachedrag.model.kv_buffer import KVBuffer
from cachedrag.model.norms import rms_norm_rows
from cachedrag.model.rope import rotate_half

DECODE_STEPS = ("auto", "fused", "torch", "cuda-graph")


class RunnerDecode:
    """``ModelRunner``'s one-token step (module docstring)."""

    def _norm_weights(self) -> list[tuple[torch.Tensor, torch.Tensor, float, float]]:
        """Per layer (input norm weight, post-attention norm weight, their eps) in the form
        ``rms_norm_rows`` takes for the decode stream's dtype (float32: ``[w, 0]``), plus the
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
        module = native.kernel()
        if module is None:
            if requested == "kernel":
                raise ConfigError(f"decode_attention='kernel': the kernel is {native.kernel_status()}")
            return "sdpa", f"kernel {native.kernel_status()}", None
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

    def decode_batch(self, tokens, positions, kvs, fast: bool | None = None, packed: bool | None = None,
                     fused: bool | None = None) -> torch.Tensor:
        """One decode step for B requests as one forward: ``tokens[b]`` at ``positions[b]`` into
        ``kvs[b]``; returns logits ``[B, V]``, each row equal to ``decode_step`` on that request
        (``model/batch_decode.py``; ``fast`` / ``packed`` / ``fused`` force a path, for tests)."""
        from cachedrag.model.batch_decode import batched_decode_step

        return batched_decode_step(self, tokens, positions, kvs, fast=fast, packed=packed, fused=fused)

    def prepare_batch(self, max_batch: int) -> None:
        """Build what batched steps of up to ``max_batch`` requests use (packed weights, per-shape
        kernel setup) now, on the calling thread, so no request pays it (``batch_decode.prepare``)."""
        from cachedrag.model.batch_decode import prepare

        prepare(self, max_batch)

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
            return self.fast_head(rms_norm_rows(hidden, w, eps)).float()[0]  # [V]
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
        kernel (``rms_norm_rows``), q and k rotated in one pass, the K/V row written by index, and no mask (every row ``<= position``
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
        x = rms_norm_rows(hidden, w1, eps1)  # [1, Dm]
        qkv = lw.qkv(x)[0]  # [Oq + 2*Okv]
        n_qk = self.n_heads + self.n_kv_heads
        qk = qkv[: lw.q_out + lw.kv_out].view(n_qk, 1, self.head_dim)  # [H_q + H_kv, 1, D]
        qk = qk * rope[0] + rotate_half(qk) * rope[1]  # [H_q + H_kv, 1, D] RoPE at position
        kv.k[i, :, position] = qk[self.n_heads:, 0]  # [H_kv, D]
        kv.v[i, :, position] = qkv[lw.q_out + lw.kv_out:].view(self.n_kv_heads, self.head_dim)  # [H_kv, D]
        out = self._attend_row(i, qk[: self.n_heads, 0], position, kv)  # [1, H_q*D]
        h = hidden + lw.o(out.to(hidden.dtype))  # [1, Dm]
        return h + lw.mlp(rms_norm_rows(h, w2, eps2))  # [1, Dm]

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
