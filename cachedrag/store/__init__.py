"""Tiered chunk-cache store: GPU -> CPU -> disk -> Redis tiers behind one API.

Owns: where chunk KV caches live and how they move between tiers (placement by priority,
demote before delete, swap-out-only-once, tree-consistent placement, promotion on reuse,
prefetch and layer-wise preloading). Does not own: which chunks to cache or their
priorities (the engine and ``cachedrag.kvcache`` decide; the store executes).

    from cachedrag.store import KVEntry, StoreConfig, TieredStore

    store = TieredStore.from_config(StoreConfig(namespace=ns, cpu_bytes=1 << 30,
                                                disk_dir="/ssd/cache", disk_bytes=20 << 30))
    store.put(key, KVEntry({"k": k, "v": v}, {"namespace": ns}), priority=p, parent=prefix_key)
    store.prefetch(keys)                                  # as soon as the chunks are known
    with store.open_layers(key, "cuda", depth) as loader:  # depth = preload_depth(L, t_p, t_l)
        k0, v0 = loader.layer(0)                           # [H_kv, T, D] each

Submodules load lazily (``import cachedrag.store.policy`` needs no torch).
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "KVEntry": "cachedrag.store.entry",
    "Tier": "cachedrag.store.base",
    "TierStats": "cachedrag.store.base",
    "CPUTier": "cachedrag.store.cpu",
    "MemoryTier": "cachedrag.store.cpu",
    "GPUTier": "cachedrag.store.gpu",
    "DiskTier": "cachedrag.store.disk",
    "RedisTier": "cachedrag.store.redis_tier",
    "start_redis_server": "cachedrag.store.redis_server",
    "find_redis_server": "cachedrag.store.redis_server",
    "RedisServer": "cachedrag.store.redis_server",
    "RedisUnavailableError": "cachedrag.store.redis_server",
    "StoreConfig": "cachedrag.store.config",
    "TieredStore": "cachedrag.store.tiered",
    "StoreStats": "cachedrag.store.placement",
    "PlacementPolicy": "cachedrag.store.policy",
    "LayerLoader": "cachedrag.store.preload",
    "PrefetchHandle": "cachedrag.store.preload",
    "preload_depth": "cachedrag.store.preload",
    "encode": "cachedrag.store.codec",
    "decode": "cachedrag.store.codec",
    "ChecksumError": "cachedrag.store.codec",
    "ForeignEntryError": "cachedrag.store.codec",
    "FormatError": "cachedrag.store.codec",
    "TruncatedEntryError": "cachedrag.store.codec",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> object:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'cachedrag.store' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    return __all__
