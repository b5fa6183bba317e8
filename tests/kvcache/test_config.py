from __future__ import annotations

import dataclasses

import pytest

from cachedrag.errors import ConfigError
from cachedrag.kvcache.config import MOVED, CacheConfig, ExactFallback, FocusConfig, RowPrecision


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
        ("focus.window", 0),
        ("focus.min_layers", 0),
        ("focus.mass_threshold", 0.0),
        ("focus.mass_threshold", 1.5),
        ("precision.question", "float16"),
        ("precision.recompute", "float16"),
        ("precision.fresh", "int8"),
        ("precision.leading_fresh", None),
        ("exact.tie_guard", -0.1),
        ("exact.tie_guard", float("inf")),
        ("exact.tie_guard_decode", -1.0),
        ("exact.repeats", -1),
        ("exact.repeats", 1.5),
        ("exact.repeats_when", "idle"),
        ("exact.repeat_memory", 0),
        ("policy", "belady"),
        ("seed", -1),
        ("token_choice", "attention"),
        ("check_layer", 0),
        ("deviation_on", "q"),
    ],
)
def test_bad_values_name_the_field(field, value):
    with pytest.raises(ConfigError, match=f"CacheConfig.{field}"):
        _build(field, value)


def _build(field: str, value) -> CacheConfig:
    """A CacheConfig with ``field`` (``GROUP.FIELD`` for a group's) set to ``value``."""
    group, _, name = field.rpartition(".")
    return CacheConfig(**{group: {name: value}}) if group else CacheConfig(**{name: value})


def _get(cfg: CacheConfig, field: str):
    group, _, name = field.rpartition(".")
    return getattr(getattr(cfg, group), name) if group else getattr(cfg, name)


@pytest.mark.parametrize("field, value", [("recompute_ratio", 0.0), ("recompute_ratio", 1.0), ("alpha", 0.0),
                                         ("focus.mass_threshold", 1.0), ("token_choice", "leading"),
                                         ("check_layer", 3), ("exact.tie_guard_decode", float("inf")),
                                         ("exact.repeats", 0), ("precision.leading_fresh", "bfloat16")])
def test_boundary_values_accepted(field, value):
    assert _get(_build(field, value), field) == value


def test_at_most_25_fields_with_one_group_per_mechanism():
    names = [f.name for f in dataclasses.fields(CacheConfig)]
    assert len(names) <= 25, names
    cfg = CacheConfig()
    assert (type(cfg.precision), type(cfg.exact), type(cfg.focus)) == (RowPrecision, ExactFallback, FocusConfig)
    assert len(dataclasses.fields(RowPrecision)) == 4 and len(dataclasses.fields(ExactFallback)) == 5


def test_group_from_a_mapping_is_validated_and_keeps_the_other_defaults():
    cfg = CacheConfig(exact={"repeats": 0}, precision={"recompute": "float32"})
    assert cfg.exact == ExactFallback(repeats=0) and cfg.precision == RowPrecision(recompute="float32")
    with pytest.raises(ConfigError, match=r"CacheConfig.exact: unknown setting\(s\) \['tie_gaurd'\]"):
        CacheConfig(exact={"tie_gaurd": 0.2})
    with pytest.raises(ConfigError, match="CacheConfig.focus must be a FocusConfig or a mapping"):
        CacheConfig(focus=3)


def test_replace_merges_a_group_mapping_into_the_current_group():
    base = CacheConfig(exact={"repeats": 0, "tie_guard": 0.1}, alpha=2.0)
    cfg = base.replace(exact={"tie_guard": 0.25}, recompute_ratio=0.5)
    assert cfg.exact == ExactFallback(repeats=0, tie_guard=0.25)  # repeats kept
    assert (cfg.alpha, cfg.recompute_ratio) == (2.0, 0.5)
    assert base.replace(exact=ExactFallback()).exact == ExactFallback()  # a group object replaces it whole
    with pytest.raises(ConfigError, match="precision.fresh"):
        base.replace(precision={"fresh": "float16"})


@pytest.mark.parametrize("old", sorted(MOVED))
def test_a_former_flat_name_is_one_line_naming_its_new_place(old):
    with pytest.raises(ConfigError) as info:
        CacheConfig.from_dict({old: 1})
    message = str(info.value)
    assert "\n" not in message and f"CacheConfig.{old} is now CacheConfig.{MOVED[old]}" in message
    with pytest.raises(ConfigError, match=f"CacheConfig.{old} is now"):
        CacheConfig().replace(**{old: 1})


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
    nested = CacheConfig(seed=3, exact={"tie_guard": 0.25}, focus={"window": 5})
    assert nested.to_dict()["exact"]["tie_guard"] == 0.25
    assert CacheConfig.from_dict(nested.to_dict()) == nested
