"""Memory tiers: round trips, copies, hard budgets, LRU self-eviction; the GPU tier skips cleanly."""

from __future__ import annotations

import random

import pytest
import torch

from cachedrag.errors import ConfigError
from cachedrag.store.codec import ForeignEntryError
from cachedrag.store.cpu import CPUTier
from tests.store.helpers import NS, key_of, make_entry

SIZE = make_entry(0).nbytes


def test_round_trip_and_copy_semantics():
    tier = CPUTier(10 * SIZE, namespace=NS)
    entry = make_entry(1)
    assert tier.put(key_of(1), entry)
    entry.k.add_(1.0)  # the caller's tensors are not the stored ones
    got = tier.get(key_of(1))
    assert got is not None and got.equal(make_entry(1))
    assert tier.contains(key_of(1)) and not tier.contains(key_of(2))
    assert tier.get(key_of(2)) is None
    assert tier.stats.hits == 1 and tier.stats.misses == 1
    assert tier.entry_bytes(key_of(1)) == SIZE and tier.used_bytes == SIZE
    assert tier.remove(key_of(1)) and not tier.remove(key_of(1))
    assert tier.used_bytes == 0


def test_batched_defaults():
    tier = CPUTier(10 * SIZE, namespace=NS)
    assert tier.put_many([(key_of(i), make_entry(i)) for i in range(3)]) == [True] * 3
    assert tier.contains_many([key_of(0), key_of(9)]) == [True, False]
    got = tier.get_many([key_of(2), key_of(9)])
    assert got[0].equal(make_entry(2)) and got[1] is None


def test_lru_self_eviction_and_refusal():
    tier = CPUTier(3 * SIZE, namespace=NS)
    for i in range(3):
        tier.put(key_of(i), make_entry(i))
    tier.get(key_of(0))  # 1 is now the least recently used
    assert tier.put(key_of(3), make_entry(3))
    assert sorted(tier.keys()) == sorted([key_of(0), key_of(2), key_of(3)])
    assert tier.stats.evictions == 1
    assert not tier.put(key_of(9), make_entry(9, tokens=64))  # larger than the budget
    assert tier.stats.refused == 1


def test_without_self_eviction_a_full_tier_refuses():
    tier = CPUTier(2 * SIZE, namespace=NS, self_evict=False)
    assert tier.put(key_of(0), make_entry(0)) and tier.put(key_of(1), make_entry(1))
    assert not tier.put(key_of(2), make_entry(2))
    assert tier.put(key_of(1), make_entry(1))  # replacing a key frees its old bytes first
    assert sorted(tier.keys()) == sorted([key_of(0), key_of(1)])


def test_foreign_entry_refused():
    tier = CPUTier(10 * SIZE, namespace=NS)
    with pytest.raises(ForeignEntryError):
        tier.put(key_of(1), make_entry(1, namespace="other"))


def test_bad_keys_rejected():
    tier = CPUTier(10 * SIZE, namespace=NS)
    for bad in ["", "x", "../etc", "ABCDEF", "a b"]:
        with pytest.raises(ValueError):
            tier.put(bad, make_entry(1))


def test_budget_holds_under_random_workload():
    rng = random.Random(7)
    tier = CPUTier(5 * SIZE + 100, namespace=NS)
    for _ in range(400):
        i = rng.randrange(30)
        op = rng.random()
        if op < 0.5:
            tier.put(key_of(i), make_entry(i, tokens=rng.choice([4, 8, 12])))
        elif op < 0.85:
            got = tier.get(key_of(i))
            assert got is None or got.meta["seed"] == str(i)
        else:
            tier.remove(key_of(i))
        assert tier.used_bytes <= tier.budget_bytes
        assert tier.used_bytes == sum(tier.entry_bytes(k) for k in tier.keys())


def test_gpu_tier_without_cuda_raises_a_clear_error():
    if torch.cuda.is_available():
        pytest.skip("CUDA present: the error path is for CPU-only machines")
    from cachedrag.store.gpu import GPUTier

    with pytest.raises(ConfigError, match="CUDA"):
        GPUTier(1 << 20, namespace=NS)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_tier_round_trip_and_budget():
    from cachedrag.store.gpu import GPUTier

    tier = GPUTier(2 * SIZE, namespace=NS)
    assert tier.put(key_of(1), make_entry(1)) and tier.put(key_of(2), make_entry(2))
    got = tier.get(key_of(1))
    assert got.device.type == "cuda" and got.to("cpu").equal(make_entry(1))
    assert tier.put(key_of(3), make_entry(3)) and tier.used_bytes <= tier.budget_bytes


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cpu_tier_pins_when_cuda_present():
    tier = CPUTier(2 * SIZE, namespace=NS)
    tier.put(key_of(1), make_entry(1))
    assert all(t.is_pinned() for t in tier.get(key_of(1)).tensors.values())
