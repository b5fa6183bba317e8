"""What Gemma 3's decoder layers add to the Llama-family runner.

Owns: ``LayerRotary`` (RoPE whose frequencies differ per layer: Gemma 3's local sliding-window
layers rotate with ``rope_local_base_freq``, its global layers with ``rope_theta`` and their own
scaling), ``rotary_of`` (a model's rotary, per layer where its config has ``layer_types``),
``has_sandwich_norms`` / ``sandwich_finish`` (the output projection and MLP between Gemma's
four norms: ``h = x + post_attn_norm(o(attn))``, ``h + post_ff_norm(mlp(pre_ff_norm(h)))``) and
``softcap`` (the final logit soft-capping, where a config sets it).

The rest of Gemma 3 needs nothing of its own: the ``(1 + w)`` RMSNorms, the scaled embedding and
the per-head q/k norms are the Hugging Face modules the runner calls, the GELU-tanh MLP is
``LayerWeights``' ``act``, the attention scale is the module's ``scaling``
(``query_pre_attn_scalar``), and sliding windows are ``ModelRunner.windows``.

Tables: ``LayerRotary.cos_sin`` returns ``(cos, sin)`` ``[T, K*D]``, the K distinct frequency sets
side by side, so code that narrows a table by rows keeps working; ``table_for(i, table)`` takes
layer ``i``'s ``[T, D]`` columns (``Rotary.table_for`` returns its table as it is).
"""

from __future__ import annotations

import torch

from cachedrag.errors import UnsupportedModelError
from cachedrag.model.linear import gated_mlp
from cachedrag.model.rope import SUPPORTED_ROPE_TYPES, Rotary


class LayerRotary:
    """RoPE per layer: ``kinds`` (one ``Rotary`` per distinct frequency set) and ``layer_kind[i]``."""

    def __init__(self, kinds: list[Rotary], layer_kind: list[int]):
        assert kinds and all(r.head_dim == kinds[0].head_dim for r in kinds), "one head dim for every layer"
        self.kinds, self.layer_kind = kinds, layer_kind
        self.head_dim = kinds[0].head_dim
        self.attention_scaling = 1.0 if all(r.attention_scaling == 1.0 for r in kinds) else None

    @classmethod
    def from_model(cls, model) -> "LayerRotary":
        config, rotary = model.config, model.model.rotary_emb
        types = list(config.layer_types)
        order = sorted(set(types))
        kinds = []
        for kind in order:
            params = (getattr(config, "rope_parameters", None) or {}).get(kind) or {}
            rope_type = params.get("rope_type", "default")
            if rope_type not in SUPPORTED_ROPE_TYPES:
                raise UnsupportedModelError(f"rotary variant {rope_type!r} of {kind} layers is not supported; "
                                            f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
            kinds.append(Rotary(getattr(rotary, f"{kind}_inv_freq").detach().to("cpu"),
                                getattr(rotary, f"{kind}_attention_scaling", 1.0)))
        return cls(kinds, [order.index(t) for t in types])

    def for_layer(self, i: int) -> Rotary:
        return self.kinds[self.layer_kind[i]]

    def inv_freq_on(self, device):
        raise UnsupportedModelError("per-layer rotary frequencies: use for_layer(i).inv_freq_on")

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype, device):
        """``(cos, sin)`` ``[T, K*D]``: every frequency set's table side by side."""
        tables = [r.cos_sin(positions, dtype, device) for r in self.kinds]  # K x ([T, D], [T, D])
        return torch.cat([c for c, _ in tables], -1), torch.cat([s for _, s in tables], -1)  # [T, K*D] each

    def table_for(self, i: int, table):
        """Layer ``i``'s ``[T, D]`` columns of a ``cos_sin`` table (a ``[T, D]`` table is passed through)."""
        if table is None or table[0].shape[-1] == self.head_dim:
            return table
        lo = self.layer_kind[i] * self.head_dim
        return table[0][..., lo:lo + self.head_dim], table[1][..., lo:lo + self.head_dim]  # [T, D] each

    def apply(self, x: torch.Tensor, positions: torch.Tensor, table=None) -> torch.Tensor:
        if table is None or table[0].shape[-1] != self.head_dim:
            raise UnsupportedModelError("per-layer rotary: resolve the table with table_for(i, table) first")
        return self.kinds[0].apply(x, positions, table)  # the arithmetic is the table's

    def apply_into(self, x: torch.Tensor, positions: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``Rotary.apply_into`` for every layer of ``x`` ``[L, H, T, D]``, each with its own frequencies."""
        assert x.dim() == 4 and x.shape[0] == len(self.layer_kind), "apply_into takes all layers [L, H, T, D]"
        for i in range(x.shape[0]):
            self.for_layer(i).apply_into(x[i], positions, out[i])  # [H, T, D]
        return out


def rotary_of(model):
    """``LayerRotary`` where the model's rotary embedding keeps a frequency set per layer type
    (Gemma 3), else ``Rotary.from_model``."""
    rotary = getattr(model.model, "rotary_emb", None)
    types = getattr(model.config, "layer_types", None)
    if types and rotary is not None and not hasattr(rotary, "inv_freq"):
        return LayerRotary.from_model(model)
    return Rotary.from_model(model)


def has_sandwich_norms(model) -> bool:
    """True for layers with norms after attention and around the MLP (Gemma 2/3)."""
    layer = model.model.layers[0]
    return hasattr(layer, "pre_feedforward_layernorm") and hasattr(layer, "post_feedforward_layernorm")


def gemma_features(model) -> tuple[bool, float | None]:
    """``(sandwich norms, final logit soft-cap)`` of a model; attention-logit soft-capping (which the
    runner does not compute) is refused."""
    if getattr(model.config, "attn_logit_softcapping", None):
        raise UnsupportedModelError("attention logit soft-capping (attn_logit_softcapping) is not supported")
    return has_sandwich_norms(model), getattr(model.config, "final_logit_softcapping", None)


def sandwich_finish(runner, i: int, residual: torch.Tensor, attn_out: torch.Tensor, lw) -> torch.Tensor:
    """Gemma's second half of layer ``i``: ``[T, Dm]`` (``lw``: fused projections, None on the reference path)."""
    layer = runner.layers[i]
    o = lw.o(attn_out) if lw is not None else runner.project(layer.self_attn.o_proj, attn_out)  # [T, Dm]
    h = residual + layer.post_attention_layernorm(o)  # [T, Dm]
    x = layer.pre_feedforward_layernorm(h)  # [T, Dm]
    m = lw.mlp(x) if lw is not None else gated_mlp(layer.mlp, x, runner.project)  # [T, Dm]
    return h + layer.post_feedforward_layernorm(m)  # [T, Dm]


def softcap(logits: torch.Tensor, cap: float | None) -> torch.Tensor:
    """``cap * tanh(logits / cap)`` where ``cap`` is set (Gemma's final logit soft-capping)."""
    return logits if not cap else torch.tanh(logits / cap) * cap
