"""Engine configuration, validated once.

Owns: ``EngineConfig``, the settings of ``CachedEngine`` that are not policy thresholds
(those live in ``cachedrag.kvcache.config.CacheConfig``, embedded here as ``cache``) and not
tier budgets of a custom store (``cachedrag.store``).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from cachedrag.kvcache.config import CacheConfig
from cachedrag.model.lookup import LookupConfig

ModeName = Literal["full", "prefix", "naive", "random", "cachedrag"]


class EngineConfig(BaseModel):
    """Settings of one ``CachedEngine``."""

    model_config = ConfigDict(arbitrary_types_allowed=True, frozen=True)

    mode: ModeName = Field("cachedrag", description="default reuse mode of generate()")
    cache: CacheConfig = Field(default_factory=CacheConfig, description="policy thresholds (alpha, N x M, focus...)")
    cache_bytes: int = Field(2 << 30, ge=0, description="byte budget of the default in-memory chunk-cache store")
    metadata_layers: int = Field(3, ge=1, description="layers sampled (evenly) to measure inter/intra attention of fresh chunks")
    early_termination: bool = Field(True, description="stop recomputing unfocused chunks after the focus layer (Cache-Craft Alg. 1)")
    tenant_salt: str | None = Field(None, description="isolates this engine's caches from other tenants")
    layerwise_loading: bool = Field(
        True, description="with a store that supports it (TieredStore), load cached KV layer by layer during prefill")
    break_even_factor: float = Field(
        1.0, gt=0, description="wait for a cached segment's first layer at most this x its estimated recompute time")
    lookup: LookupConfig = Field(
        default_factory=LookupConfig,
        description="prompt-lookup speculative greedy decoding (drafts copied from the prompt); max_draft=0 turns it off")

    @field_validator("cache", mode="before")
    @classmethod
    def _cache_from_dict(cls, value):
        if isinstance(value, dict):
            return CacheConfig.from_dict(value)
        return value
