"""What the engine's manager reads from the store when it rebuilds: header-only ``info`` /
``meta``, the small ``extras`` tensors, ``keys(shared=True)``, ``set_priority(parent=)`` and the
drop log (``drops_since``)."""

from __future__ import annotations

import json

import pytest
import torch

from cachedrag.store.config import StoreConfig
from cachedrag.store.cpu import CPUTier
from cachedrag.store.disk import DiskTier
from cachedrag.store.redis_tier import RedisTier
from cachedrag.store.tiered import TieredStore
from tests.store.helpers import NS, key_of, make_entry

SIZE = make_entry(0).nbytes


def check_info(tier, i: int) -> None:
    entry = make_entry(i)
    info = tier.info(key_of(i))
    assert info.meta == entry.meta == tier.meta(key_of(i))
    assert (info.nbytes, info.n_layers, info.n_tokens) == (entry.nbytes, entry.n_layers, entry.n_tokens)
    extras = tier.extras(key_of(i))
    assert set(extras) == {"token_inter"} and torch.equal(extras["token_inter"], entry.tensors["token_inter"])
    assert tier.info(key_of(99)) is None and tier.extras(key_of(99)) is None and tier.meta(key_of(99)) is None


def test_memory_tier_info_without_stats(tmp_path):
    tier = CPUTier(1 << 20, namespace=NS)
    tier.put(key_of(1), make_entry(1))
    check_info(tier, 1)
    assert tier.stats.hits == 0 and tier.stats.misses == 0


def test_disk_info_reads_the_header_only(tmp_path):
    tier = DiskTier(tmp_path, 1 << 20, namespace=NS, fsync=False)
    tier.put(key_of(1), make_entry(1))
    check_info(tier, 1)
    assert tier.stats.hits == 0
    # damage a K byte: the header (and extras) still verify, a full read does not
    path = tier.path(key_of(1))
    blob = bytearray(path.read_bytes())
    blob[-SIZE // 2] ^= 0xFF
    path.write_bytes(bytes(blob))
    assert tier.info(key_of(1)).n_tokens == 8
    assert tier.get(key_of(1)) is None and tier.stats.corrupt == 1 and tier.info(key_of(1)) is None


def test_disk_bad_header_or_extras_is_a_counted_miss(tmp_path):
    tier = DiskTier(tmp_path, 1 << 20, namespace=NS, fsync=False)
    for i in (1, 2):
        tier.put(key_of(i), make_entry(i))
    path = tier.path(key_of(1))
    path.write_bytes(path.read_bytes()[:20])  # truncated inside the header
    assert tier.info(key_of(1)) is None and tier.stats.corrupt == 1 and not tier.contains(key_of(1))
    blob = bytearray(tier.path(key_of(2)).read_bytes())
    header_len = int.from_bytes(blob[:8], "little")
    begin, _ = json.loads(blob[8:8 + header_len])["token_inter"]["data_offsets"]
    blob[8 + header_len + begin + 1] ^= 0xFF  # a token_inter byte
    tier.path(key_of(2)).write_bytes(bytes(blob))
    assert tier.info(key_of(2)) is not None  # the header is intact
    assert tier.extras(key_of(2)) is None and tier.stats.corrupt == 2 and not tier.contains(key_of(2))


@pytest.mark.redis
def test_redis_info_reads_the_header_only(redis_server, redis_prefix):
    tier = RedisTier(redis_server.url, 1 << 20, namespace=NS, prefix=redis_prefix)
    tier.put(key_of(1), make_entry(1))
    lru_before = redis_server.client().zscore(f"{redis_prefix}:__lru", tier.vkey(key_of(1)))
    check_info(tier, 1)
    assert redis_server.client().zscore(f"{redis_prefix}:__lru", tier.vkey(key_of(1))) == lru_before
    assert tier.stats.hits == 0
    redis_server.client().setrange(tier.vkey(key_of(1)), 12, b"\x00garbage")  # inside the header
    assert tier.info(key_of(1)) is None and tier.stats.corrupt == 1 and not tier.contains(key_of(1))


@pytest.mark.redis
def test_store_reads_and_shared_keys(tmp_path, redis_server, redis_prefix):
    cfg = dict(namespace=NS, cpu_bytes=2 * SIZE, disk_dir=tmp_path, disk_bytes=1 << 20, disk_fsync=False,
               redis_url=redis_server.url, redis_bytes=1 << 20, redis_prefix=redis_prefix)
    store = TieredStore.from_config(StoreConfig(**cfg))
    other = TieredStore.from_config(StoreConfig(**{**cfg, "disk_dir": tmp_path / "other", "cpu_bytes": 0}))
    store.put(key_of(1), make_entry(1))  # cpu
    other.tier("redis").put(key_of(2), make_entry(2))  # only in Redis, written by another process
    assert store.keys() == [key_of(1)]
    assert sorted(store.keys(shared=True)) == sorted([key_of(1), key_of(2)])
    for i in (1, 2):
        check_info(store, i)
    assert store.stats.hits == 0 and store.where(key_of(2)) == "redis"


def test_set_priority_links_parents_and_drop_log(tmp_path):
    store = TieredStore.from_config(StoreConfig(namespace=NS, cpu_bytes=2 * SIZE, disk_dir=tmp_path,
                                                disk_bytes=3 * 4096 * 2, disk_fsync=False, disk_validate="lazy"))
    assert store.drops_since(0) == ([], 0, True)
    for i in range(3):
        store.put(key_of(i), make_entry(i), priority=i)
    assert not store.set_priority(key_of(9), 1.0)
    assert store.set_priority(key_of(2), 5.0, parent=key_of(0)) and store.priority(key_of(2)) == 5.0
    assert store.check_invariants() == []  # the parent was lifted next to its child
    for i in range(3, 12):  # more than the tiers hold: drops
        store.put(key_of(i), make_entry(i), priority=10 + i)
    keys, cursor, complete = store.drops_since(0)
    assert complete and cursor == store.stats.drops == len(keys) > 0
    assert all(not store.contains(k) for k in keys)
    assert store.drops_since(cursor) == ([], cursor, True)
    small = TieredStore([CPUTier(SIZE, namespace=NS)], namespace=NS, drop_log_size=2)
    for i in range(5):
        small.put(key_of(i), make_entry(i), priority=i)
    keys, cursor, complete = small.drops_since(0)
    assert cursor == 4 and len(keys) == 2 and not complete
