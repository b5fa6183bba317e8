"""TieredStore: placement by priority, demote before delete, swap-out-only-once, promotion on
reuse, tree-consistent placement, hard budgets after every operation, restarts, Redis sharing."""

from __future__ import annotations

import random

import pytest
from pydantic import ValidationError

from cachedrag.store.config import StoreConfig
from cachedrag.store.cpu import CPUTier
from cachedrag.store.disk import DiskTier
from cachedrag.store.tiered import TieredStore
from tests.store.helpers import NS, disk_bytes_on_disk, key_of, make_entry

SIZE = make_entry(0).nbytes


def store_of(tmp_path, cpu_entries=2, disk_bytes=1 << 20, **kw) -> TieredStore:
    cfg = StoreConfig(namespace=NS, cpu_bytes=cpu_entries * SIZE, disk_dir=tmp_path, disk_bytes=disk_bytes,
                      disk_fsync=False, **kw)
    return TieredStore.from_config(cfg)


def assert_ok(store: TieredStore, tmp_path=None) -> None:
    assert store.check_invariants() == []
    if tmp_path is not None:
        disk = store.tier("disk")
        assert disk_bytes_on_disk(tmp_path)[0] == disk.used_bytes <= disk.budget_bytes


def test_round_trip_and_where(tmp_path):
    store = store_of(tmp_path)
    assert store.put(key_of(1), make_entry(1))
    assert store.where(key_of(1)) == "cpu" and store.contains(key_of(1))
    assert store.get(key_of(1)).equal(make_entry(1))
    assert store.get(key_of(2)) is None and store.where(key_of(2)) is None
    assert store.stats.hits == 1 and store.stats.misses == 1
    assert store.remove(key_of(1)) and not store.contains(key_of(1))
    assert_ok(store, tmp_path)


def test_demote_before_delete(tmp_path):
    store = store_of(tmp_path, cpu_entries=2)
    for i in range(5):
        assert store.put(key_of(i), make_entry(i))
        assert_ok(store, tmp_path)
    assert [store.where(key_of(i)) for i in range(5)] == ["disk", "disk", "disk", "cpu", "cpu"]
    assert store.stats.demotions == 3 and store.stats.drops == 0
    for i in range(5):
        assert store.get(key_of(i), promote=False).equal(make_entry(i))


def test_priority_decides_the_tier(tmp_path):
    store = store_of(tmp_path, cpu_entries=2)
    store.put(key_of(0), make_entry(0), priority=5)
    store.put(key_of(1), make_entry(1), priority=5)
    store.put(key_of(2), make_entry(2), priority=1)  # less valuable than both: goes to disk directly
    assert store.where(key_of(2)) == "disk" and store.stats.demotions == 0
    store.put(key_of(3), make_entry(3), priority=9)  # more valuable: demotes the oldest priority-5 entry
    assert store.where(key_of(3)) == "cpu" and store.where(key_of(0)) == "disk"
    assert store.set_priority(key_of(2), 7) and store.priority(key_of(2)) == 7
    assert_ok(store, tmp_path)


def test_held_entries_stay_in_the_fast_tier(tmp_path):
    store = store_of(tmp_path, cpu_entries=2)
    store.put(key_of(0), make_entry(0))
    store.put(key_of(1), make_entry(1))
    store.hold({key_of(0)})  # a waiting request will read 0: the newer 1 is demoted instead
    store.put(key_of(2), make_entry(2))
    assert [store.where(key_of(i)) for i in range(3)] == ["cpu", "disk", "cpu"]
    store.hold(())
    store.put(key_of(3), make_entry(3))
    assert store.where(key_of(0)) == "disk"  # the oldest again, without the hold
    assert_ok(store, tmp_path)


def test_delete_only_when_no_tier_takes_it(tmp_path):
    with store_of(tmp_path, cpu_entries=1) as probe:
        disk_one = probe.tier("disk").prepare(key_of(0), make_entry(0)).nbytes
    store = store_of(tmp_path, cpu_entries=1, disk_bytes=2 * disk_one)
    for i in range(4):
        store.put(key_of(i), make_entry(i), priority=i)
        assert_ok(store, tmp_path)
    assert store.where(key_of(0)) is None and store.stats.drops == 1  # lowest priority left the store
    assert [store.where(key_of(i)) for i in (1, 2, 3)] == ["disk", "disk", "cpu"]
    assert not store.put(key_of(9), make_entry(9), priority=-1)  # worth less than everything
    assert store.stats.puts_refused == 1
    assert not store.put(key_of(8), make_entry(8, tokens=512))  # larger than every budget
    assert_ok(store, tmp_path)


def test_swap_out_only_once(tmp_path):
    store = store_of(tmp_path, cpu_entries=2)
    disk = store.tier("disk")
    store.put(key_of(0), make_entry(0))
    store.put(key_of(1), make_entry(1))
    store.put(key_of(2), make_entry(2))  # demotes 0: one disk write
    assert disk.stats.puts == 1 and store.where(key_of(0)) == "disk"
    assert store.get(key_of(0)).equal(make_entry(0))  # promoted; demotes 1 (second write), disk keeps 0's copy
    assert store.where(key_of(0)) == "cpu" and disk.stats.puts == 2
    assert disk.contains(key_of(0))
    store.put(key_of(3), make_entry(3))  # demotes 2: third write
    store.put(key_of(4), make_entry(4))  # demotes 0 again: no write, the copy is on disk
    assert store.where(key_of(0)) == "disk"
    assert disk.stats.puts == 3 and store.stats.demotion_writes_saved == 1
    assert store.get(key_of(0), promote=False).equal(make_entry(0))
    assert_ok(store, tmp_path)


def test_promotion_on_reuse_returns_the_fast_copy(tmp_path):
    store = store_of(tmp_path, cpu_entries=1)
    store.put(key_of(0), make_entry(0))
    store.put(key_of(1), make_entry(1))
    assert store.where(key_of(0)) == "disk"
    got = store.get(key_of(0))
    assert store.where(key_of(0)) == "cpu" and store.where(key_of(1)) == "disk"
    assert got is store.tier("cpu").peek(key_of(0)) and got.equal(make_entry(0))
    assert store.stats.promotions == 1
    store.get(key_of(1), promote=False)
    assert store.where(key_of(1)) == "disk"


def test_children_leave_before_parents(tmp_path):
    store = store_of(tmp_path, cpu_entries=2)
    root, kid = key_of("root"), key_of("kid")
    store.put(root, make_entry(10), priority=0)  # the parent is the least valuable...
    store.put(kid, make_entry(11), priority=1, parent=root)
    store.put(key_of(1), make_entry(1), priority=5)  # ...yet the child is demoted first
    assert store.where(root) == "cpu" and store.where(kid) == "disk"
    assert_ok(store, tmp_path)
    store.put(key_of(2), make_entry(2), priority=5)
    assert store.where(root) == "disk" and store.where(kid) == "disk"
    assert_ok(store, tmp_path)


def test_parents_are_promoted_with_their_children(tmp_path):
    store = store_of(tmp_path, cpu_entries=2)
    root, kid = key_of("root"), key_of("kid")
    store.put(root, make_entry(10), priority=3)
    store.put(kid, make_entry(11), priority=3, parent=root)
    store.put(key_of(1), make_entry(1), priority=4)
    store.put(key_of(2), make_entry(2), priority=4)
    assert store.where(root) == "disk" and store.where(kid) == "disk"
    store.set_priority(root, 9)
    store.set_priority(kid, 9)
    assert store.get(kid).equal(make_entry(11))
    assert store.where(root) == "cpu" and store.where(kid) == "cpu"
    assert_ok(store, tmp_path)


def test_put_of_a_child_lifts_its_parent(tmp_path):
    store = store_of(tmp_path, cpu_entries=2)
    root = key_of("root")
    store.put(root, make_entry(10), priority=2)
    store.put(key_of(1), make_entry(1), priority=5)
    store.put(key_of(2), make_entry(2), priority=5)
    assert store.where(root) == "disk"
    store.set_priority(root, 9)
    store.put(key_of("kid"), make_entry(11), priority=8, parent=root)
    assert store.where(root) == "cpu" and store.where(key_of("kid")) == "cpu"
    assert_ok(store, tmp_path)


def test_a_parent_put_after_its_children_lands_no_slower_than_them(tmp_path):
    store = store_of(tmp_path, cpu_entries=2)
    root, kid = key_of("root"), key_of("kid")
    store.put(kid, make_entry(11), priority=5, parent=root)  # the child arrives first
    store.put(key_of(1), make_entry(1), priority=6)
    assert store.where(kid) == "cpu"
    assert not store.put(root, make_entry(10), priority=1)  # cpu is worth more, and disk would be slower than kid
    assert store.where(root) is None and store.stats.puts_refused == 1
    assert store.put(root, make_entry(10), priority=5.5)  # outranks the child: takes its place, child demoted
    assert store.where(root) == "cpu" and store.where(kid) in ("cpu", "disk")
    assert_ok(store, tmp_path)


def test_existing_key_is_not_rewritten_unless_replaced(tmp_path):
    store = store_of(tmp_path)
    store.put(key_of(1), make_entry(1))
    assert store.put(key_of(1), make_entry(2), priority=4)
    assert store.get(key_of(1)).equal(make_entry(1)) and store.priority(key_of(1)) == 4
    assert store.stats.puts_existing == 1
    assert store.put(key_of(1), make_entry(2), replace=True)
    assert store.get(key_of(1)).equal(make_entry(2))


def run_random_workload(store: TieredStore, rng: random.Random, steps: int, check) -> None:
    parents: dict[int, int] = {}
    for step in range(steps):
        i = rng.randrange(40)
        op = rng.random()
        if op < 0.45:
            if i > 0 and rng.random() < 0.5:
                parents[i] = rng.randrange(i)
            store.put(key_of(i), make_entry(i, tokens=rng.choice([4, 8, 16])), priority=rng.randrange(5),
                      parent=key_of(parents[i]) if i in parents else None, replace=rng.random() < 0.1)
        elif op < 0.8:
            got = store.get(key_of(i), promote=rng.random() < 0.8)
            assert got is None or got.meta["seed"] == str(i)
        elif op < 0.9:
            store.set_priority(key_of(i), rng.randrange(5))
        else:
            store.remove(key_of(i))
        problems = store.check_invariants()
        assert problems == [], f"step {step}: {problems}"
        check(step)


@pytest.mark.parametrize("seed", [11, 12, 13])
def test_random_workload_keeps_budgets_and_tree_after_every_operation(tmp_path, seed):
    store = store_of(tmp_path, cpu_entries=3, disk_bytes=40_000)

    def check(step: int) -> None:
        assert disk_bytes_on_disk(tmp_path)[0] == store.tier("disk").used_bytes <= 40_000, f"step {step}"

    run_random_workload(store, random.Random(seed), 300, check)
    stats = store.stats_dict()
    assert stats["store"]["demotions"] > 0 and stats["store"]["promotions"] > 0 and stats["store"]["drops"] > 0


@pytest.mark.redis
def test_random_workload_over_three_tiers(tmp_path, redis_server, redis_prefix):
    store = TieredStore.from_config(StoreConfig(
        namespace=NS, cpu_bytes=2 * SIZE, disk_dir=tmp_path, disk_bytes=20_000, disk_fsync=False,
        redis_url=redis_server.url, redis_bytes=30_000, redis_prefix=redis_prefix))
    redis_tier = store.tier("redis")

    def check(step: int) -> None:
        assert disk_bytes_on_disk(tmp_path)[0] <= 20_000, f"step {step}"
        assert redis_tier.used_bytes <= 30_000, f"step {step}"

    run_random_workload(store, random.Random(21), 200, check)
    assert redis_tier.stats.puts > 0


def test_corrupt_file_in_a_store_is_a_miss_and_the_index_heals(tmp_path):
    store = store_of(tmp_path, cpu_entries=1)
    store.put(key_of(0), make_entry(0))
    store.put(key_of(1), make_entry(1))
    path = store.tier("disk").path(key_of(0))
    path.write_bytes(path.read_bytes()[:-10])
    assert store.get(key_of(0)) is None
    assert store.tier("disk").stats.corrupt == 1 and store.stats.stale_index == 1
    assert not store.contains(key_of(0))
    assert_ok(store, tmp_path)


def test_write_through_and_restart(tmp_path):
    store = store_of(tmp_path, cpu_entries=4, write_through=True)
    for i in range(3):
        store.put(key_of(i), make_entry(i))
    assert all(store.tier("disk").contains(key_of(i)) for i in range(3))
    store.close()
    again = store_of(tmp_path, cpu_entries=4)
    assert sorted(again.keys()) == sorted(key_of(i) for i in range(3))
    assert again.get(key_of(1)).equal(make_entry(1)) and again.where(key_of(1)) == "cpu"
    assert_ok(again, tmp_path)


def test_flush_persists_volatile_entries(tmp_path):
    store = store_of(tmp_path, cpu_entries=4)
    for i in range(3):
        store.put(key_of(i), make_entry(i))
    assert store.flush() == 3 and store.flush() == 0
    store.close()
    again = store_of(tmp_path, cpu_entries=4)
    assert again.get(key_of(2)).equal(make_entry(2))


def test_tiers_built_directly(tmp_path):
    cpu = CPUTier(2 * SIZE, namespace=NS)
    disk = DiskTier(tmp_path, 1 << 20, namespace=NS, fsync=False)
    store = TieredStore([cpu, disk], namespace=NS)
    assert not cpu.self_evict and not disk.self_evict  # the store chooses victims
    store.put_many([(key_of(i), make_entry(i)) for i in range(3)])
    assert store.get_many([key_of(0), key_of(7)])[1] is None
    assert store.contains_many([key_of(2), key_of(7)]) == [True, False]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({}, "no tier"),
        ({"cpu_bytes": -1}, "greater than or equal"),
        ({"disk_dir": "/tmp/x"}, "disk_bytes is 0"),
        ({"disk_bytes": 10}, "disk_dir is not"),
        ({"redis_url": "redis://x"}, "redis_bytes is 0"),
        ({"cpu_bytes": 1, "bogus": 1}, "Extra inputs"),
    ],
)
def test_config_is_validated(kwargs, message):
    with pytest.raises(ValidationError, match=message):
        StoreConfig(namespace=NS, **kwargs)


def test_mismatched_namespace_is_a_config_error(tmp_path):
    from cachedrag.errors import ConfigError

    with pytest.raises(ConfigError):
        TieredStore([CPUTier(SIZE, namespace="other")], namespace=NS)


@pytest.mark.redis
def test_two_stores_share_entries_through_redis(redis_server, redis_prefix, tmp_path):
    def make() -> TieredStore:
        return TieredStore.from_config(StoreConfig(namespace=NS, cpu_bytes=2 * SIZE, redis_url=redis_server.url,
                                                   redis_bytes=1 << 20, redis_prefix=redis_prefix, write_through=True))

    a, b = make(), make()
    assert a.put(key_of(1), make_entry(1))
    assert a.tier("redis").contains(key_of(1))
    assert b.where(key_of(1)) == "redis"
    assert b.get(key_of(1)).equal(make_entry(1))  # found by probing the shared tier, then promoted
    assert b.where(key_of(1)) == "cpu"
    for i in range(2, 6):  # b's cpu overflows into redis, a sees those too
        b.put(key_of(i), make_entry(i))
    assert a.get(key_of(2)).equal(make_entry(2))
    assert a.check_invariants() == [] and b.check_invariants() == []
    assert b.where(key_of(2)) == "redis" and b.where(key_of(5)) == "cpu"
    assert a.remove(key_of(2)) and a.remove(key_of(5))  # removes the shared copies
    assert b.get(key_of(2)) is None and b.stats.stale_index == 1  # b's index heals
    assert b.get(key_of(5)).equal(make_entry(5))  # b's cpu copy is its own
    b.remove(key_of(5))
    assert not a.contains(key_of(5)) and b.check_invariants() == []


def test_a_parent_lost_from_a_fast_tier_does_not_leave_the_tree_inconsistent(tmp_path):
    """A parent's disk copy found damaged (removed) while its only other copy is in a slower tier:
    the child may now be faster than the parent; the store drops that link instead of reporting
    a violation forever."""
    from cachedrag.store.cpu import MemoryTier

    slow = MemoryTier(1 << 20, namespace=NS, device="cpu", name="slow")
    slow.shared = True  # stands in for Redis: probed on a miss, evicts on its own
    store = TieredStore([CPUTier(1 << 20, namespace=NS), slow], namespace=NS, write_through=False)
    assert store.put(key_of(0), make_entry(0))
    assert store.put(key_of(1), make_entry(1), parent=key_of(0))
    slow.put(key_of(0), make_entry(0))  # another process wrote the parent to the shared tier
    store.get(key_of(0), promote=False)
    store._read(key_of(0))  # noqa: SLF001 (index learns of the shared copy)
    store.tier("cpu").remove(key_of(0))  # the fast copy is lost behind the store's back
    assert store.get(key_of(0), promote=False) is not None  # served from the slow tier
    assert store.check_invariants() == []
