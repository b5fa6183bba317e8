"""The chunk KV cache entry that every tier stores.

Owns: ``KVEntry`` (named tensors + string metadata), its shape/dtype contract, byte size and
device moves. Does not own: serialization (``codec``), placement (``policy``/``tiered``).

Contract (the engine produces these):

- ``tensors["k"]``: raw (pre-RoPE) keys ``[L, H_kv, T, D]``; ``tensors["v"]``: values
  ``[L, H_kv, T, D]``; same shape and dtype, fp32 / fp16 / bf16.
- Optional extra tensors (e.g. ``"token_inter": [T]``), float32, any shape. Any other
  4-d tensor whose first dimension is ``L`` is "layered": it is loaded layer by layer
  together with ``k`` and ``v``.
- ``meta``: ``str -> str``, opaque to the store except ``meta["namespace"]`` (the model
  fingerprint digest; an entry of another namespace is foreign).

Entries handed out by a tier share storage with it: treat them as read-only and
``clone()`` before writing into them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

KV_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
EXTRA_DTYPES = (torch.float32,)
NAMESPACE_KEY = "namespace"
RESERVED_NAMES = ("__metadata__",)


@dataclass
class KVEntry:
    """One chunk's KV cache: named tensors plus opaque string metadata."""

    tensors: dict[str, torch.Tensor]
    meta: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise ``ValueError`` when the entry breaks the shape/dtype contract."""
        if "k" not in self.tensors or "v" not in self.tensors:
            raise ValueError(f"KVEntry needs tensors 'k' and 'v', got {sorted(self.tensors)}")
        k, v = self.tensors["k"], self.tensors["v"]
        if k.dim() != 4 or tuple(k.shape) != tuple(v.shape):
            raise ValueError(f"k and v must both be [L, H_kv, T, D]; got {tuple(k.shape)} and {tuple(v.shape)}")
        if k.dtype not in KV_DTYPES or v.dtype != k.dtype:
            raise ValueError(f"k/v dtype must be one of fp32/fp16/bf16 and equal; got {k.dtype}, {v.dtype}")
        for name, t in self.tensors.items():
            if not isinstance(name, str) or not name or name in RESERVED_NAMES:
                raise ValueError(f"bad tensor name {name!r}")
            if name not in ("k", "v") and not self._is_layered(t) and t.dtype not in EXTRA_DTYPES:
                raise ValueError(f"extra tensor {name!r} must be float32, got {t.dtype}")
            if t.device != k.device:
                raise ValueError(f"tensor {name!r} is on {t.device}, k is on {k.device}")
        for mk, mv in self.meta.items():
            if not isinstance(mk, str) or not isinstance(mv, str):
                raise ValueError(f"meta must map str -> str; got {mk!r}: {mv!r}")

    def _is_layered(self, t: torch.Tensor) -> bool:
        k = self.tensors["k"]
        return t.dim() == 4 and t.shape[0] == k.shape[0] and t.dtype in KV_DTYPES

    # ---- shape facts -------------------------------------------------------------------
    @property
    def k(self) -> torch.Tensor:
        return self.tensors["k"]  # [L, H_kv, T, D]

    @property
    def v(self) -> torch.Tensor:
        return self.tensors["v"]  # [L, H_kv, T, D]

    @property
    def n_layers(self) -> int:
        return int(self.k.shape[0])

    @property
    def n_tokens(self) -> int:
        return int(self.k.shape[2])

    @property
    def device(self) -> torch.device:
        return self.k.device

    @property
    def namespace(self) -> str | None:
        return self.meta.get(NAMESPACE_KEY)

    @property
    def nbytes(self) -> int:
        """Sum of tensor bytes: what memory-tier budgets count."""
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def layered_names(self) -> tuple[str, ...]:
        """Tensors with a leading layer axis (``k``, ``v`` and any other ``[L, ...]`` 4-d tensor), sorted."""
        return tuple(sorted(n for n, t in self.tensors.items() if n in ("k", "v") or self._is_layered(t)))

    def extra_names(self) -> tuple[str, ...]:
        """Tensors without a layer axis (e.g. ``token_inter`` ``[T]``), sorted."""
        layered = set(self.layered_names())
        return tuple(sorted(n for n in self.tensors if n not in layered))

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(k_l, v_l)``, each ``[H_kv, T, D]`` (views, no copy)."""
        return self.k[layer], self.v[layer]  # [H_kv, T, D] each

    # ---- copies ------------------------------------------------------------------------
    def to(self, device: torch.device | str, *, non_blocking: bool = False, pin_memory: bool = False) -> KVEntry:
        """A copy on ``device`` (``pin_memory`` pins a CPU copy). Always copies."""
        device = torch.device(device)
        out: dict[str, torch.Tensor] = {}
        for name, t in self.tensors.items():
            if device.type == "cpu" and pin_memory:
                dst = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)  # same shape as t
                dst.copy_(t, non_blocking=non_blocking)
            else:
                dst = t.to(device, non_blocking=non_blocking, copy=True).contiguous()
            out[name] = dst
        return KVEntry(out, dict(self.meta))

    def clone(self) -> KVEntry:
        """A private, writable copy on the same device."""
        return KVEntry({n: t.clone() for n, t in self.tensors.items()}, dict(self.meta))

    def equal(self, other: KVEntry) -> bool:
        """Same tensor names, dtypes, shapes, values (bitwise, on CPU) and meta."""
        if self.meta != other.meta or set(self.tensors) != set(other.tensors):
            return False
        for name, t in self.tensors.items():
            o = other.tensors[name]
            if t.dtype != o.dtype or t.shape != o.shape:
                return False
            if not torch.equal(t.detach().cpu().reshape(-1).view(torch.uint8), o.detach().cpu().reshape(-1).view(torch.uint8)):
                return False
        return True

    @classmethod
    def from_layers(
        cls,
        layers: list[dict[str, torch.Tensor]],
        extras: dict[str, torch.Tensor],
        meta: dict[str, str],
    ) -> KVEntry:
        """Reassemble an entry from per-layer tensors (``[H_kv, T, D]`` each) plus extras."""
        names = layers[0].keys()
        tensors = {n: torch.stack([lay[n] for lay in layers]) for n in names}  # [L, H_kv, T, D]
        tensors.update(extras)
        return cls(tensors, dict(meta))
