"""Thread safety: many threads of random get/put/remove/prefetch/open_layers; every entry read is
verified against its checksum and its expected tensors (a whole entry or a miss, never torn)."""

from __future__ import annotations

import hashlib
import random
import threading

import pytest

from cachedrag.store.config import StoreConfig
from cachedrag.store.cpu import CPUTier
from cachedrag.store.disk import DiskTier
from cachedrag.store.entry import KVEntry
from cachedrag.store.tiered import TieredStore
from tests.store.helpers import NS, disk_bytes_on_disk, key_of, make_entry

pytestmark = pytest.mark.timeout(120)

N_KEYS = 24
THREADS = 8
OPS = 400


def checksummed(seed: int) -> KVEntry:
    entry = make_entry(seed, tokens=4 + seed % 3 * 4)
    entry.meta["sha"] = digest(entry)
    return entry


def digest(entry: KVEntry) -> str:
    h = hashlib.sha256()
    for name in sorted(entry.tensors):
        h.update(entry.tensors[name].contiguous().view(-1).numpy().tobytes())
    return h.hexdigest()


# two versions per key (replace=True switches between them): a reader must see one of them whole
EXPECTED = {(i, v): checksummed(i + 1000 * v) for i in range(N_KEYS) for v in (0, 1)}


def verify(i: int, got: KVEntry | None) -> None:
    if got is None:
        return
    assert digest(got) == got.meta["sha"], "torn or damaged entry"
    assert any(got.equal(EXPECTED[(i, v)]) for v in (0, 1)), "entry of another key"


def hammer(fn, threads: int = THREADS) -> None:
    errors: list[BaseException] = []

    def run(seed: int) -> None:
        try:
            fn(random.Random(seed))
        except BaseException as exc:  # collected and re-raised in the main thread
            errors.append(exc)

    workers = [threading.Thread(target=run, args=(s,)) for s in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    if errors:
        raise errors[0]


def test_tiered_store_under_concurrent_random_ops(tmp_path):
    size = EXPECTED[(0, 0)].nbytes
    store = TieredStore.from_config(StoreConfig(namespace=NS, cpu_bytes=5 * size, disk_dir=tmp_path,
                                                disk_bytes=50_000, disk_fsync=False, prefetch_workers=2))

    def ops(rng: random.Random) -> None:
        for _ in range(OPS):
            i = rng.randrange(N_KEYS)
            op = rng.random()
            if op < 0.35:
                v = rng.randrange(2)
                parent = key_of(i // 2) if i >= 2 and rng.random() < 0.3 else None
                store.put(key_of(i), EXPECTED[(i, v)], priority=rng.randrange(4), parent=parent,
                          replace=rng.random() < 0.2)
            elif op < 0.75:
                verify(i, store.get(key_of(i), promote=rng.random() < 0.7))
            elif op < 0.82:
                store.remove(key_of(i))
            elif op < 0.9:
                store.prefetch([key_of(rng.randrange(N_KEYS)) for _ in range(3)])
            else:
                loader = store.open_layers(key_of(i), "cpu", depth=2)
                if loader is not None:
                    with loader:
                        entry = loader.entry(timeout=30)
                    assert entry is not None, f"loader failed: {loader.error}"  # open fds outlive evictions
                    verify(i, entry)
            assert store.tier("cpu").used_bytes <= store.tier("cpu").budget_bytes

    hammer(ops)
    store._prefetcher.shutdown()
    assert store.check_invariants() == []
    assert disk_bytes_on_disk(tmp_path)[0] == store.tier("disk").used_bytes <= 50_000
    for i in range(N_KEYS):
        verify(i, store.get(key_of(i)))
    tiers = store.stats_dict()["tiers"]
    assert tiers["disk"]["corrupt"] == 0 and tiers["disk"]["skipped_writes"] == 0
    store.close()


@pytest.mark.parametrize("kind", ["cpu", "disk"])
def test_single_tier_under_concurrent_random_ops(tmp_path, kind):
    size = EXPECTED[(0, 0)].nbytes
    tier = CPUTier(6 * size, namespace=NS) if kind == "cpu" else DiskTier(tmp_path, 40_000, namespace=NS, fsync=False)

    def ops(rng: random.Random) -> None:
        for _ in range(OPS):
            i = rng.randrange(N_KEYS)
            op = rng.random()
            if op < 0.4:
                tier.put(key_of(i), EXPECTED[(i, rng.randrange(2))])
            elif op < 0.9:
                verify(i, tier.get(key_of(i)))
            else:
                tier.remove(key_of(i))
            assert tier.used_bytes <= tier.budget_bytes

    hammer(ops)
    assert tier.used_bytes == sum(tier.entry_bytes(k) for k in tier.keys())
    if kind == "disk":
        assert disk_bytes_on_disk(tmp_path)[0] == tier.used_bytes
        assert tier.stats.corrupt == 0
