"""Cache-Craft chunk variants: attention metadata and the reuse scores computed from it.

Owns: ``AttentionMetadata`` (plain floats the tensor side measured when a chunk's KV was
computed in some context) and the pure scoring functions: CCI, prefix overlap beta, order
penalty, beta', CFO, the recompute count and the choice of recompute tokens.

Does not own: measuring attention (the model runner), storing variants (``index.py``), or
deciding per request (``planner.py``).

Definitions. A *variant* of chunk X is X's KV computed in one context: behind the system
prefix and the chunks ``prefix_keys = (P1, ..., Pm)`` of that request. Attention masses are
measured from X's tokens (averaged over layers, heads and X's query tokens; each query row of
softmax sums to 1), split by destination:

  inter[Pj]  mass to chunk Pj;       inter = sum_j inter[Pj]
  intra      mass to X itself
  (sink)     mass to the system prefix: not recorded here. The system prefix sits at the
             same place with the same tokens in every context, so attention to it never goes
             stale and it neither adds to nor dilutes the context impact.

Only ratios are used, so the masses may be given in any common scale (raw sums or means).

  CCI   = inter / (inter + intra)                      (0 when both are 0)
        The share of X's attention outside the sink that went to other chunks: how much X's KV
        absorbed its context and so how wrong it can be in another one. Equals
        sigmoid(ln(inter / intra)), a monotone map of Cache-Craft's inter/intra ratio, in [0, 1].
  beta  = sum_{Pj in new prefix} inter[Pj] / inter    (1 when inter = 0)
        Prefix overlap: the share of X's original inter-attention that went to chunks that are
        again in front of X in the new request.
  gamma = normalised Kendall tau distance between the relative order of the common prior
        chunks in ``prefix_keys`` and in the new prefix: discordant pairs / C(c, 2) for c common
        chunks (0 when c < 2; 1 for a reversed order).
  beta' = beta x (1 - gamma)
  CFO   = clip(alpha x CCI x (1 - beta'), 0, 1)       the fraction of X's tokens to recompute.

Cold variants: a variant computed right after the system prefix (``prefix_keys == ()``) has
no inter-attention to measure, so its CCI says nothing about how X reacts to context. Reused
again right after the system prefix its context is identical (CFO = 0); reused behind other
chunks CCI is taken as ``cold_cci`` and beta' as 0 (nothing of the new context was seen).

Recompute count = ceil(CFO x n_tokens). Token choice = the ``count`` tokens with the largest
``token_inter`` (the fraction of the token's own attention that went to prior chunks: the
most contextualised tokens), ties broken by position (earlier first), returned sorted. For a
cold variant every ``token_inter`` is 0, so the choice is the chunk's first tokens, which the
prototype found best (KL 0.025 vs 0.064 for random at 15%). This is ``token_choice="inter"``;
the planner also offers ``"leading"`` (first tokens) and ``"deviation"`` (CacheBlend: chosen
by the engine at run time from measured K/V deviation, see ``CacheConfig.token_choice``).
"""

from __future__ import annotations

import math
import random
from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any


def _finite_nonneg(name: str, value: float) -> float:
    v = float(value)
    if not math.isfinite(v) or v < 0:
        raise ValueError(f"AttentionMetadata.{name} must be finite and >= 0, got {value!r}")
    return v


@dataclass(frozen=True, eq=False)
class AttentionMetadata:
    """How a chunk's KV was computed, measured as plain floats.

    prefix_keys: ordered keys of the chunks before it in that request (system prefix excluded).
    inter: prior chunk key -> attention mass from this chunk's tokens to that chunk.
        Keys must be in ``prefix_keys``; a prior chunk may be missing (mass 0).
    intra: attention mass from this chunk's tokens to itself.
    token_inter: per token of the chunk, the fraction of that token's attention that went to
        prior chunks (any sequence of floats; ``array('f')`` keeps 10k variants small).
    question: optional mass from the question tokens to this chunk (diagnostics).

    The token ranking (``token_order``) is computed on first use and cached.
    """

    prefix_keys: tuple[str, ...]
    inter: Mapping[str, float]
    intra: float
    token_inter: Sequence[float]
    question: float | None = None
    _cache: dict[str, Any] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        prefix = tuple(self.prefix_keys)
        object.__setattr__(self, "prefix_keys", prefix)
        known = set(prefix)
        inter = {}
        for k, v in self.inter.items():
            if k not in known:
                raise ValueError(f"AttentionMetadata.inter: key {k[:12]!r} is not in prefix_keys")
            inter[k] = _finite_nonneg(f"inter[{k[:12]!r}]", v)
        object.__setattr__(self, "inter", MappingProxyType(inter))
        object.__setattr__(self, "intra", _finite_nonneg("intra", self.intra))
        if len(self.token_inter) == 0:
            raise ValueError("AttentionMetadata.token_inter needs one value per token (chunk is empty)")
        if self.question is not None:
            object.__setattr__(self, "question", _finite_nonneg("question", self.question))
        self._cache["inter_total"] = sum(inter.values())

    @classmethod
    def standalone(cls, n_tokens: int, intra: float = 1.0) -> AttentionMetadata:
        """Metadata of a chunk computed right after the system prefix (no prior chunks)."""
        return cls(prefix_keys=(), inter={}, intra=intra, token_inter=[0.0] * n_tokens)

    @property
    def n_tokens(self) -> int:
        return len(self.token_inter)

    @property
    def inter_total(self) -> float:
        return self._cache["inter_total"]

    @property
    def is_cold(self) -> bool:
        """Computed with no prior chunk: context impact unmeasured."""
        return not self.prefix_keys

    @property
    def token_order(self) -> Sequence[int]:
        """Token indices by descending ``token_inter``, ties by ascending position (cached)."""
        order = self._cache.get("token_order")
        if order is None:
            ti = self.token_inter
            order = array("I", sorted(range(len(ti)), key=lambda i: (-ti[i], i)))
            self._cache["token_order"] = order
        return order


@dataclass(frozen=True)
class ReuseScore:
    """All terms of one (variant, new prefix) evaluation; ``cfo`` is what the planner uses."""

    cci: float
    beta: float
    order_penalty: float
    beta_prime: float
    cfo: float
    cold: bool = False


def context_impact(meta: AttentionMetadata) -> float:
    """CCI = inter / (inter + intra) (0 when both are 0)."""
    inter = meta.inter_total
    denom = inter + meta.intra
    return inter / denom if denom > 0 else 0.0


def kendall_tau_distance(old_order: Sequence[str], new_order: Sequence[str]) -> float:
    """Normalised Kendall tau distance between the orders of the items common to both.

    discordant pairs / C(c, 2) over the c common items (first occurrence counts): 0 for the
    same relative order, 1 for the reverse, 0 when fewer than 2 items are common.
    """
    new_pos: dict[str, int] = {}
    for i, k in enumerate(new_order):
        new_pos.setdefault(k, i)
    seen: set[str] = set()
    ranks: list[int] = []
    for k in old_order:
        if k in new_pos and k not in seen:
            seen.add(k)
            ranks.append(new_pos[k])
    c = len(ranks)
    if c < 2:
        return 0.0
    discordant = sum(1 for i in range(c) for j in range(i + 1, c) if ranks[i] > ranks[j])
    return discordant / (c * (c - 1) / 2)


def prefix_overlap(meta: AttentionMetadata, new_prefix: Sequence[str]) -> float:
    """beta: share of the original inter-attention that went to chunks in ``new_prefix``."""
    inter = meta.inter_total
    if inter <= 0:
        return 1.0
    present = set(new_prefix)
    return min(1.0, sum(v for k, v in meta.inter.items() if k in present) / inter)


def score(
    meta: AttentionMetadata,
    new_prefix: Sequence[str],
    *,
    alpha: float = 1.0,
    cold_cci: float = 0.15,
) -> ReuseScore:
    """Evaluate reusing ``meta``'s variant behind the chunks ``new_prefix`` (system excluded).

    See the module docstring for the formulas.
    """
    if meta.is_cold:
        if not new_prefix:
            return ReuseScore(cci=0.0, beta=1.0, order_penalty=0.0, beta_prime=1.0, cfo=0.0, cold=True)
        cfo = min(1.0, max(0.0, alpha * cold_cci))
        return ReuseScore(cci=cold_cci, beta=0.0, order_penalty=0.0, beta_prime=0.0, cfo=cfo, cold=True)
    cci = context_impact(meta)
    beta = prefix_overlap(meta, new_prefix)
    gamma = kendall_tau_distance(meta.prefix_keys, new_prefix)
    beta_prime = beta * (1.0 - gamma)
    cfo = min(1.0, max(0.0, alpha * cci * (1.0 - beta_prime)))
    return ReuseScore(cci=cci, beta=beta, order_penalty=gamma, beta_prime=beta_prime, cfo=cfo)


def cfo(meta: AttentionMetadata, new_prefix: Sequence[str], **kwargs: Any) -> float:
    """CFO of reusing ``meta``'s variant behind ``new_prefix``; kwargs as in ``score``."""
    return score(meta, new_prefix, **kwargs).cfo


def recompute_count(fraction: float, n_tokens: int) -> int:
    """ceil(fraction x n_tokens), robust to float noise (0.1 x 30 gives 3, not 4), in [0, n]."""
    if fraction <= 0 or n_tokens <= 0:
        return 0
    return min(n_tokens, math.ceil(round(fraction * n_tokens, 9)))


def select_tokens(meta: AttentionMetadata, count: int) -> tuple[int, ...]:
    """The ``count`` most contextualised tokens (top ``token_inter``, ties by position), sorted."""
    if count <= 0:
        return ()
    if count >= meta.n_tokens:
        return tuple(range(meta.n_tokens))
    return tuple(sorted(meta.token_order[:count]))


def select_leading_tokens(n_tokens: int, count: int) -> tuple[int, ...]:
    """The chunk's first ``count`` tokens (``token_choice="leading"``)."""
    return tuple(range(max(0, min(count, n_tokens))))


def select_random_tokens(n_tokens: int, count: int, rng: random.Random) -> tuple[int, ...]:
    """``count`` distinct token indices drawn by ``rng``, sorted (the ``random`` mode)."""
    if count <= 0:
        return ()
    if count >= n_tokens:
        return tuple(range(n_tokens))
    return tuple(sorted(rng.sample(range(n_tokens), count)))
