"""The runner's attention over its working KV buffer: prefill attention of any sorted set of query
positions, causal by absolute position, and attention mass per key segment (chunk metadata).

Owns: ``RunnerAttention`` (mixed into ``ModelRunner``): ``attention_mask``, ``causal_blocks`` (the
block-causal plan of a partial prefill, ``CausalBlocks``), ``attend`` (Triton selective attention,
the native prefill kernel of ``attention.py``, SDPA's causal mode for leading rows, SDPA per causal
block, or one masked SDPA call: the reference), ``segment_attention_mass`` and the choice of the
prefill kernel (``_pick_prefill_attention``). Reads the runner's shapes (``n_heads``,
``n_kv_heads``, ``head_dim``, ``scaling``, ``windows``), ``device``, ``dtype``,
``kernel_backend`` and ``block_causal``.

Does not own: which rows a prefill computes, the one-token decode step's attention
(``runner_decode.py``), building the native library (``native.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from cachedrag.errors import ConfigError
from cachedrag.model import attention, native
from cachedrag.model.attention import PAIRS
from cachedrag.model.kv_buffer import KVBuffer
from cachedrag.model.transfer import device_tensor
from cachedrag.model.weights import dtype_name

_ATTN_BLOCK = 256  # query rows per block when attention weights are materialised for metadata
_CAUSAL_ROWS = 64  # query rows per block of the block-causal partial-prefill attention (probe: 64 best of 32-256)
_CAUSAL_GAIN = 0.8  # cut into blocks only when they visit at most this share of the single call's query-key pairs
_KERNEL_MIN_ROWS = 48  # float32 prefills of fewer query rows keep SDPA (probe: 25 rows 1.14 vs 1.02 ms, 64 rows 1.96 vs 2.31)
_NO_HIDDEN = torch.empty(0, dtype=torch.uint8)


@dataclass(frozen=True)
class CausalBlocks:
    """A sorted position set's query rows cut into blocks for ``ModelRunner.attend``: block ``b``
    (rows ``bounds[b][0]:bounds[b][1]``) sees keys ``[0, bounds[b][2])`` only (its last position
    + 1), under the additive mask ``masks[b]`` ``[rows, keys]`` (0 / -inf, in the compute dtype).
    Built once per position set (``ModelRunner.causal_blocks``) and shared by every layer."""

    bounds: list[tuple[int, int, int]]
    masks: list[torch.Tensor]
    hidden: torch.Tensor | None = None  # uint8 [kv_len]: keys no query may see (the prefill kernel's form)


class RunnerAttention:
    """``ModelRunner``'s attention over the working KV buffer (module docstring)."""

    def _sliding_window(self, i: int) -> int | None:
        attn = self.layers[i].self_attn
        if hasattr(attn, "sliding_window"):  # Qwen2/Qwen3: set per layer from layer_types
            return attn.sliding_window
        if self.architecture == "MistralForCausalLM":
            return getattr(self.config, "sliding_window", None)
        return None

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
            module = attention.prefill_module()
            if module is None:
                reason = f"kernel {native.kernel_status()}" if native.kernel() is None else "built without AVX-512"
        if reason is not None:
            if requested == "kernel":
                raise ConfigError(f"prefill_attention='kernel': {reason}")
            return "sdpa", reason, None
        return "kernel", "", module

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
