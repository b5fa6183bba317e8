"""Engine configuration, validated once.

Owns: ``EngineConfig``, the settings of ``CachedEngine`` that are not policy thresholds
(those live in ``cachedrag.kvcache.config.CacheConfig``, embedded here as ``cache``) and not
tier budgets of a custom store (``cachedrag.store``).
"""

from __future__ import annotations

import math
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from cachedrag.kvcache.config import CacheConfig
from cachedrag.model.lookup import LookupConfig

ModeName = Literal["full", "prefix", "naive", "random", "cachedrag"]
FidelityName = Literal["exact", "faithful", "guarded", "balanced", "fast"]

#: What each fidelity level sets (calibrated on the measured frontier, docs/notes/fidelity.md):
#: the reuse mode, the policy fields of ``cache`` it owns (groups nested, as ``CacheConfig.replace``
#: takes them), and order-aware exact reuse.
FIDELITY_PRESETS: dict[str, dict] = {
    # no approximation: exact-prefix reuse only, in the retrieved order (answers = full prefill)
    "exact": {"mode": "prefix", "cache": {}, "order_aware": False, "early_termination": False},
    # non-prefix reuse, 27% recomputed, chosen by the question's attention fused with each chunk's own
    # inter-chunk attention (question+inter), early termination off: the first ratio past teacher-forced top-1
    # 0.98 and ROUGE-L 0.90 vs full prefill on bench ttft (0.981 / 0.908, first token 1.00), at x_prefix 2.07 in
    # the same run once the reuse path's question pre-pass ran in bfloat16 (1.88 on the reference path; 1.89 / 1.93
    # in earlier runs; 0.2: 2.40, TF 0.972, ROUGE-L 0.863); bench fidelity: KL a quarter of the order noise,
    # so order-aware off (docs/notes/fidelity.md)
    # (round 10: the recomputed rows' matmuls in bfloat16, CacheConfig.precision.recompute's default, keep those figures
    # at x_prefix 2.51 / 1.96 on bench ttft's two streams, 1.99 / 1.80 with float32 repairs in the same runs)
    # (round 20: the missed chunks behind a reused one on the same bfloat16 copies, CacheConfig.precision.fresh's default,
    # keep the fidelity figures; x_prefix 2.73 -> 2.89, 1.98 -> 2.40 on stdlib seeds 0 / 1, 1.62 -> 2.00 on info seed 0)
    "balanced": {"mode": "cachedrag", "cache": {"token_choice": "question+inter", "recompute_ratio": 0.27},
                 "order_aware": False, "early_termination": False},
    # "balanced" with the gap tie guard at 0.25 nats: a request whose approximate first token is that near a tie
    # is prefilled again exactly. Round 18 (docs/notes/fidelity.md): it caught every first-token flip on twelve probed
    # streams of two corpora (24 of 24; the trend check, calibrated on one corpus, caught 15), and took bench
    # ttft's first-token agreement to 1.000 on six streams where the default had 0.833-1.000
    "guarded": {"mode": "cachedrag", "cache": {"token_choice": "question+inter", "recompute_ratio": 0.27,
                                               "exact": {"tie_guard": 0.25}},
                "order_aware": False, "early_termination": False},
    # "guarded" plus the guard during decoding at every token (CacheConfig.exact.tie_guard_decode=inf): an approximate
    # answer moves onto an exact prefill of the prompt and its first token before its second token, so it is full
    # prefill's answer whenever its (guarded) first token is. Round 22 (docs/notes/fidelity.md): 62 of 62 gold answers
    # equal to full prefill's at 4x its TTFT (at 0.25 nats: 47 of 62, a decisive token moved first); every answer
    # of bench ttft's streams at the guarded row's TTFT; the answers take longer (one more exact prefill each).
    # Round 26: only the (guarded) first token reads the approximate prefill, so the missed chunks before the first
    # reused one run on the bfloat16 copies too (precision.leading_fresh): first token and answers unchanged on the four
    # streams, median TTFT x prefix 1.61 -> 2.09 on info seed 1 (2.12 -> 2.29 on stdlib seed 1) in the same runs
    "faithful": {"mode": "cachedrag", "cache": {"token_choice": "question+inter", "recompute_ratio": 0.27,
                                                "exact": {"tie_guard": 0.25, "tie_guard_decode": math.inf},
                                                "precision": {"leading_fresh": "bfloat16"}},
                 "order_aware": False, "early_termination": False},
    # 10% recompute (5x TTFT, KL 0.034) and cached orders served exactly (15x): both at about the order-noise floor
    "fast": {"mode": "cachedrag", "cache": {"token_choice": "question+inter", "recompute_ratio": 0.1},
             "order_aware": True, "early_termination": False},
}


class EngineConfig(BaseModel):
    """Settings of one ``CachedEngine``."""

    model_config = ConfigDict(arbitrary_types_allowed=True, frozen=True)

    fidelity: FidelityName | None = Field(
        None, description="'exact' | 'faithful' | 'guarded' | 'balanced' | 'fast': sets mode, the recompute policy, order_aware and "
                          "early_termination from "
                          "FIDELITY_PRESETS (the levels: docs/fidelity.md; calibrated in docs/notes/fidelity.md); None = the fields as given (their "
                          "defaults are the 'balanced' settings)")
    mode: ModeName = Field("cachedrag", description="default reuse mode of generate()")
    cache: CacheConfig = Field(default_factory=CacheConfig, description="policy thresholds (alpha, N x M, focus...)")
    cache_bytes: int = Field(2 << 30, ge=0, description="byte budget of the default in-memory chunk-cache store")
    metadata_layers: int = Field(3, ge=1, description="layers sampled (evenly) to measure inter/intra attention of fresh chunks")
    early_termination: bool = Field(
        False, description="stop recomputing unfocused chunks after the focus layer (Cache-Craft Alg. 1); off by "
                           "default: it costs fidelity at equal computed fraction (docs/notes/fidelity.md)")
    tenant_salt: str | None = Field(None, description="isolates this engine's caches from other tenants")
    layerwise_loading: bool = Field(
        True, description="with a store that supports it (TieredStore), load cached KV layer by layer during prefill")
    break_even_factor: float = Field(
        1.0, gt=0, description="wait for a cached segment's first layer at most this x its estimated recompute time")
    order_aware: bool = Field(
        False, description="when a cached knowledge-tree path holds the retrieved chunks (as a set), serve them in "
                           "that order: an exact prefix hit with no approximation (the order changes; stats say so)")
    lookup: LookupConfig = Field(
        default_factory=LookupConfig,
        description="prompt-lookup speculative greedy decoding (drafts copied from the prompt); max_draft=0 turns it off")

    @model_validator(mode="before")
    @classmethod
    def _apply_fidelity(cls, data):
        """A fidelity level overrides mode, order_aware, early_termination and the cache fields its preset names."""
        if not isinstance(data, dict) or data.get("fidelity") is None:
            return data
        name = data["fidelity"]
        if name not in FIDELITY_PRESETS:
            return data  # the Literal check reports it
        preset = FIDELITY_PRESETS[name]
        cache = data.get("cache")
        if cache is None:
            cache = CacheConfig()
        elif isinstance(cache, dict):
            cache = CacheConfig.from_dict(cache)
        cache = cache.replace(**preset["cache"]) if isinstance(cache, CacheConfig) else cache
        return {**data, "mode": preset["mode"], "order_aware": preset["order_aware"],
                "early_termination": preset["early_termination"], "cache": cache}

    @field_validator("cache", mode="before")
    @classmethod
    def _cache_from_dict(cls, value):
        if isinstance(value, dict):
            return CacheConfig.from_dict(value)
        return value
