"""Rotary position embedding at arbitrary positions, and re-rotation of cached keys.

Owns: cos/sin tables for any position set, applying RoPE to raw (pre-RoPE) keys/queries,
and re-rotating keys from ``old_positions`` to ``new_positions``. Uses the model's own
``inv_freq`` and attention scaling so results match Hugging Face bit for bit in fp32.

Supported rotary variants: ``default``, ``linear`` and ``llama3`` (they only reshape
``inv_freq``). ``dynamic``/``yarn``/``longrope`` depend on sequence length or rescale
cos/sin, and partial rotary applies RoPE to part of the head only: all three are refused
with a clear error rather than silently mis-rotated.
"""

from __future__ import annotations

import torch

from cachedrag.errors import UnsupportedModelError

SUPPORTED_ROPE_TYPES: tuple[str, ...] = ("default", "linear", "llama3")


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """HF convention: ``cat(-x2, x1)`` over the last dim halves."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rope_type_of(config) -> str:
    """The rotary variant named by an HF config (``rope_parameters`` or legacy ``rope_scaling``)."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    return params.get("rope_type", params.get("type", "default")) or "default"


class Rotary:
    """RoPE for one model: ``inv_freq`` ``[D/2]`` (float32) and the attention scaling."""

    def __init__(self, inv_freq: torch.Tensor, attention_scaling: float = 1.0):
        assert inv_freq.dim() == 1, f"inv_freq must be 1-D, got {tuple(inv_freq.shape)}"
        self.inv_freq = inv_freq.float()  # [D/2]
        self.attention_scaling = float(attention_scaling)
        self.head_dim = 2 * inv_freq.shape[0]
        self._on_device: dict[torch.device, torch.Tensor] = {}

    def inv_freq_on(self, device: torch.device | str) -> torch.Tensor:
        """``inv_freq`` on ``device``, copied there once: a copy per call from host memory waits for
        the GPU (a re-rotation per chunk and layer made ~700 such waits per 8B request)."""
        device = torch.device(device)
        if device == self.inv_freq.device:
            return self.inv_freq
        on = self._on_device.get(device)
        if on is None:
            on = self._on_device[device] = self.inv_freq.to(device)  # [D/2]
        return on

    @classmethod
    def from_model(cls, model) -> "Rotary":
        config = model.config
        rope_type = rope_type_of(config)
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise UnsupportedModelError(
                f"rotary variant {rope_type!r} is not supported (it depends on sequence length or rescales "
                f"cos/sin, so cached keys cannot be re-rotated exactly); supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
            )
        partial = getattr(config, "partial_rotary_factor", 1.0) or 1.0
        if partial != 1.0:
            raise UnsupportedModelError(f"partial rotary embeddings (partial_rotary_factor={partial}) are not supported")
        rotary = model.model.rotary_emb
        return cls(rotary.inv_freq.detach().to("cpu"), getattr(rotary, "attention_scaling", 1.0))

    def for_layer(self, i: int) -> "Rotary":
        """The rotary of layer ``i``: this one for every layer (``model/gemma.py``'s ``LayerRotary`` differs)."""
        return self

    def table_for(self, i: int, table):
        """Layer ``i``'s part of a ``cos_sin`` table: all of it here (one frequency set for every layer)."""
        return table

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype, device: torch.device | str):
        """cos, sin ``[T, D]`` for integer ``positions`` ``[T]``, computed as HF does (fp32, then cast)."""
        inv_freq = self.inv_freq_on(device)  # [D/2]
        freqs = positions.to(device=device, dtype=torch.float32)[:, None] * inv_freq[None, :]  # [T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [T, D]
        cos = (emb.cos() * self.attention_scaling).to(dtype)  # [T, D]
        sin = (emb.sin() * self.attention_scaling).to(dtype)  # [T, D]
        return cos, sin

    def apply(self, x: torch.Tensor, positions: torch.Tensor,
              table: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """Rotate raw ``x`` ``[H, T, D]`` to ``positions`` ``[T]``; ``table`` = precomputed
        ``cos_sin(positions)`` (the same for every layer of a pass, so compute it once)."""
        assert x.shape[-2] == positions.shape[0], f"x has {x.shape[-2]} rows, positions {positions.shape[0]}"
        cos, sin = table if table is not None else self.cos_sin(positions, x.dtype, x.device)  # [T, D]
        return x * cos + rotate_half(x) * sin  # [H, T, D]

    def apply_into(self, x: torch.Tensor, positions: torch.Tensor, out: torch.Tensor,
                   table: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """``apply`` written straight into ``out`` (same shape as ``x``; e.g. rows of a KV buffer):
        the same ops in the same order, so bitwise equal (tests), with one temporary instead of
        five and no copy of the result (cached chunks are re-rotated into the buffer this way)."""
        assert out.shape == x.shape, f"out {tuple(out.shape)} != x {tuple(x.shape)}"
        assert x.shape[-2] == positions.shape[0], f"x has {x.shape[-2]} rows, positions {positions.shape[0]}"
        cos, sin = table if table is not None else self.cos_sin(positions, x.dtype, x.device)  # [T, D]
        torch.mul(x, cos, out=out)  # [..., T, D]
        return out.add_(rotate_half(x).mul_(sin))  # [..., T, D]

    def rerotate(self, k: torch.Tensor, old_positions: torch.Tensor, new_positions: torch.Tensor) -> torch.Tensor:
        """Keys rotated at ``old_positions`` -> rotated at ``new_positions`` (``[H, T, D]``).

        Each RoPE pair is a 2-D rotation by ``pos * inv_freq``, so rotating by the position
        delta equals undoing the old rotation and applying the new one (to fp rounding).
        Requires attention scaling 1 (true for every supported variant).
        """
        assert old_positions.shape == new_positions.shape, "old_positions and new_positions must match in length"
        assert self.attention_scaling == 1.0, "re-rotation by delta needs unscaled cos/sin"
        delta = new_positions.to(torch.int64) - old_positions.to(torch.int64)  # [T]
        return self.apply(k, delta)
