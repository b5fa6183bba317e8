from __future__ import annotations

import dataclasses

import pytest

from cachedrag.errors import ConfigError
from cachedrag.kvcache.config import CacheConfig


def test_defaults_are_valid():
    cfg = CacheConfig()
    assert cfg.max_variants == cfg.max_chunks * cfg.max_variants_per_chunk
    assert cfg.policy == "pgdsf"


@pytest.mark.parametrize(
    "field, value",
    [
        ("alpha", -0.1),
        ("alpha", float("nan")),
        ("alpha", "1"),
        ("cold_cci", 1.5),
        ("reuse_cfo_limit", 0.0),
        ("reuse_cfo_limit", 1.01),
        ("recompute_ratio", -0.01),
        ("recompute_ratio", 1.2),
        ("max_chunks", 0),
        ("max_chunks", 2.5),
        ("max_variants_per_chunk", 0),
        ("max_variants_per_chunk", True),
        ("cfo_floor", 0.0),
        ("focus_window", 0),
        ("focus_min_layers", 0),
        ("focus_mass_threshold", 0.0),
        ("focus_mass_threshold", 1.5),
        ("policy", "belady"),
        ("seed", -1),
        ("token_choice", "attention"),
        ("check_layer", 0),
        ("deviation_on", "q"),
    ],
)
def test_bad_values_name_the_field(field, value):
    with pytest.raises(ConfigError, match=field):
        CacheConfig(**{field: value})


@pytest.mark.parametrize("field, value", [("recompute_ratio", 0.0), ("recompute_ratio", 1.0), ("alpha", 0.0), ("focus_mass_threshold", 1.0),
                                         ("token_choice", "leading"), ("check_layer", 3)])
def test_boundary_values_accepted(field, value):
    assert getattr(CacheConfig(**{field: value}), field) == value


def test_policy_alias_is_canonicalised():
    assert CacheConfig(policy="Cache-Craft").policy == "cachecraft_fr"
    assert CacheConfig(policy="LRU").policy == "lru"


def test_replace_revalidates():
    with pytest.raises(ConfigError):
        dataclasses.replace(CacheConfig(), alpha=-1)


def test_from_dict_rejects_unknown_keys():
    assert CacheConfig.from_dict({"alpha": 2.0}).alpha == 2.0
    with pytest.raises(ConfigError, match="alhpa"):
        CacheConfig.from_dict({"alhpa": 2.0})
    assert CacheConfig.from_dict(CacheConfig(seed=3).to_dict()) == CacheConfig(seed=3)
