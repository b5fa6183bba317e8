"""RedisTier against a real redis-server: round trips, shared budget, TTL, bad values, two processes."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import pytest

from cachedrag.store.codec import encode
from cachedrag.store.redis_tier import RedisTier
from tests.store.helpers import NS, key_of, make_entry

pytestmark = pytest.mark.redis


def tier_of(server, prefix, budget=1 << 20, **kw) -> RedisTier:
    return RedisTier(server.url, budget, namespace=kw.pop("namespace", NS), prefix=prefix, **kw)


def test_round_trip_and_layout(redis_server, redis_prefix):
    tier = tier_of(redis_server, redis_prefix)
    assert tier.put(key_of(1), make_entry(1))
    assert tier.get(key_of(1)).equal(make_entry(1))
    assert tier.get(key_of(2)) is None
    client = redis_server.client()
    assert client.exists(f"{redis_prefix}:{NS}:{key_of(1)}")
    assert tier.keys() == [key_of(1)] and tier.contains(key_of(1))
    real = client.memory_usage(f"{redis_prefix}:{NS}:{key_of(1)}")
    assert tier.used_bytes == tier.entry_bytes(key_of(1)) == real + tier.overhead_bytes
    assert tier.remove(key_of(1)) and tier.used_bytes == 0 and not tier.contains(key_of(1))


def test_budget_is_enforced_lru_and_shared_by_clients(redis_server, redis_prefix):
    size = tier_of(redis_server, redis_prefix).prepare(key_of(0), make_entry(0)).nbytes
    budget = int(3.5 * size)
    a = tier_of(redis_server, redis_prefix, budget)
    b = tier_of(redis_server, redis_prefix, budget)  # another process would look the same
    a.put(key_of(0), make_entry(0))
    b.put(key_of(1), make_entry(1))
    a.put(key_of(2), make_entry(2))
    assert b.get(key_of(0)) is not None  # 1 is now the least recently used
    b.put(key_of(3), make_entry(3))
    assert a.used_bytes <= budget
    assert sorted(a.keys()) == sorted([key_of(0), key_of(2), key_of(3)])
    assert b.stats.evictions == 1
    assert not a.put(key_of(9), make_entry(9, tokens=512))  # larger than the whole budget
    assert a.stats.refused == 1 and a.used_bytes <= budget


def test_budget_holds_under_random_workload(redis_server, redis_prefix):
    import random

    rng = random.Random(5)
    budget = 30_000
    tiers = [tier_of(redis_server, redis_prefix, budget) for _ in range(2)]
    client = redis_server.client()
    for _ in range(150):
        tier = rng.choice(tiers)
        i = rng.randrange(25)
        if rng.random() < 0.6:
            tier.put(key_of(i), make_entry(i, tokens=rng.choice([4, 16, 32])))
        else:
            got = tier.get(key_of(i))
            assert got is None or got.meta["seed"] == str(i)
        real = sum(client.memory_usage(f"{redis_prefix}:{NS}:{k}") or 0 for k in tier.keys())
        assert real <= tier.used_bytes <= budget


def test_ttl_expires_and_uncharges(redis_server, redis_prefix):
    tier = tier_of(redis_server, redis_prefix, ttl_s=0.2)
    tier.put(key_of(1), make_entry(1))
    assert tier.get(key_of(1)) is not None
    time.sleep(0.35)
    assert tier.get(key_of(1)) is None
    assert tier.used_bytes == 0 and tier.keys() == []


@pytest.mark.parametrize("damage", ["truncate", "flip", "foreign"])
def test_bad_values_are_counted_removed_and_missed(redis_server, redis_prefix, damage):
    tier = tier_of(redis_server, redis_prefix)
    tier.put(key_of(1), make_entry(1))
    client = redis_server.client()
    vkey = tier.vkey(key_of(1))
    blob = bytearray(client.get(vkey))
    if damage == "truncate":
        bad = bytes(blob[:-9])
    elif damage == "flip":
        blob[-30] ^= 0x20
        bad = bytes(blob)
    else:
        bad = encode(key_of(1), make_entry(1, namespace="othermodel"), "othermodel")
    client.set(vkey, bad)
    assert tier.get(key_of(1)) is None
    assert getattr(tier.stats, "foreign" if damage == "foreign" else "corrupt") == 1
    assert not client.exists(vkey) and tier.used_bytes == 0


def test_lost_server_is_a_warning_not_a_crash(redis_prefix):
    tier = RedisTier("redis://127.0.0.1:1/0", 1 << 20, namespace=NS, prefix=redis_prefix)
    with pytest.warns(RuntimeWarning):
        assert not tier.put(key_of(1), make_entry(1))
    with pytest.warns(RuntimeWarning):
        assert tier.get(key_of(1)) is None
    assert tier.stats.skipped_writes == 1


def test_layer_source_reads_ranges(redis_server, redis_prefix):
    tier = tier_of(redis_server, redis_prefix)
    entry = make_entry(4, layers=6)
    tier.put(key_of(4), entry)
    source = tier.open_source(key_of(4))
    for l in (5, 0, 3):
        out = source.load_layer(l)
        assert out["k"].equal(entry.k[l]) and out["v"].equal(entry.v[l])
    assert source.load_extras()["token_inter"].equal(entry.tensors["token_inter"])
    assert tier.open_source(key_of(99)) is None


_CHILD = textwrap.dedent(
    """
    import sys, hashlib
    sys.path.insert(0, {helpers!r})
    from cachedrag.store.redis_tier import RedisTier
    from helpers import NS, key_of, make_entry
    url, prefix, role = sys.argv[1:4]
    tier = RedisTier(url, 1 << 20, namespace=NS, prefix=prefix)
    keys = [key_of(f"proc{{i}}") for i in range(3)]
    if role == "put":
        for i, k in enumerate(keys):
            assert tier.put(k, make_entry(100 + i, layers=5, tokens=12))
        print("PUT", len(keys))
    else:
        for i, k in enumerate(keys):
            got = tier.get(k)
            assert got is not None, "missing " + k
            assert got.equal(make_entry(100 + i, layers=5, tokens=12)), "different tensors"
            print("GOT", k, hashlib.sha256(got.k.numpy().tobytes()).hexdigest())
    """
)


def test_two_processes_share_one_server(redis_server, redis_prefix):
    from pathlib import Path

    root = str(Path(__file__).resolve().parents[2])
    code = _CHILD.format(helpers=str(Path(__file__).resolve().parent))
    put = subprocess.run([sys.executable, "-c", code, redis_server.url, redis_prefix, "put"],
                         capture_output=True, text=True, timeout=60, cwd=root)
    assert put.returncode == 0, put.stderr
    get = subprocess.run([sys.executable, "-c", code, redis_server.url, redis_prefix, "get"],
                         capture_output=True, text=True, timeout=60, cwd=root)
    assert get.returncode == 0, get.stderr
    assert get.stdout.count("GOT") == 3
    # and this (third) process sees the identical tensors too
    import hashlib

    tier = tier_of(redis_server, redis_prefix)
    for line in get.stdout.splitlines():
        _, key, digest = line.split()
        assert hashlib.sha256(tier.get(key).k.numpy().tobytes()).hexdigest() == digest
