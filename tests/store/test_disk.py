"""DiskTier: atomic files, restart, hard budget in real bytes, bad files, disk errors."""

from __future__ import annotations

import errno
import logging
import os
import random
import warnings

import pytest

from cachedrag.store.codec import encode
from cachedrag.store.disk import DiskTier
from cachedrag.store.disk_files import temp_name
from tests.store.helpers import NS, disk_bytes_on_disk, key_of, make_entry


def tier_at(path, budget=1 << 20, **kw) -> DiskTier:
    kw.setdefault("fsync", False)
    return DiskTier(path, budget, namespace=NS, **kw)


def test_round_trip_layout_and_restart(tmp_path):
    tier = tier_at(tmp_path, fsync=True)
    for i in range(5):
        assert tier.put(key_of(i), make_entry(i))
    k = key_of(3)
    assert (tmp_path / k[:2] / f"{k}.safetensors").is_file()
    assert tier.get(k).equal(make_entry(3))
    used = tier.used_bytes
    tier.close()
    again = tier_at(tmp_path)  # a new process on the same directory
    assert sorted(again.keys()) == sorted(key_of(i) for i in range(5))
    assert again.used_bytes == used
    for i in range(5):
        assert again.get(key_of(i)).equal(make_entry(i))


def test_no_partial_file_is_ever_visible(tmp_path, monkeypatch):
    tier = tier_at(tmp_path)
    seen: list[list[str]] = []
    real_replace = os.replace

    def spying_replace(src, dst):
        # at the moment of the rename, the final name does not exist yet; only the temp does
        seen.append(sorted(p.name for p in (tmp_path / key_of(1)[:2]).iterdir()))
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", spying_replace)
    assert tier.put(key_of(1), make_entry(1))
    assert len(seen) == 1 and all(n.endswith(".tmp") for n in seen[0])
    assert [p.name for p in (tmp_path / key_of(1)[:2]).iterdir()] == [f"{key_of(1)}.safetensors"]


def test_crash_mid_write_leaves_a_temp_file_that_restart_cleans(tmp_path):
    tier = tier_at(tmp_path)
    tier.put(key_of(1), make_entry(1))
    tier.close()
    shard = tmp_path / key_of(2)[:2]
    shard.mkdir(exist_ok=True)
    blob = encode(key_of(2), make_entry(2), NS)
    (shard / temp_name(key_of(2))).write_bytes(blob[: len(blob) // 2])  # the crash
    foreign = shard / f".{key_of(2)}.abc123.tmp"  # someone else's temp file: not ours to delete
    foreign.write_bytes(b"theirs")
    again = tier_at(tmp_path)
    assert again.stats.temp_cleaned == 1
    assert [p.name for p in shard.glob("*.tmp")] == [foreign.name]
    assert again.keys() == [key_of(1)] and again.get(key_of(2)) is None


@pytest.mark.parametrize("validate", ["lazy", "header", "full"])
@pytest.mark.parametrize("damage", ["truncate", "flip", "foreign"])
def test_bad_files_are_counted_removed_and_missed(tmp_path, caplog, validate, damage):
    tier = tier_at(tmp_path)
    for i in range(3):
        tier.put(key_of(i), make_entry(i))
    path = tier.path(key_of(1))
    tier.close()
    blob = bytearray(path.read_bytes())
    if damage == "truncate":
        path.write_bytes(bytes(blob[: len(blob) - 17]))
    elif damage == "flip":
        blob[len(blob) - 40] ^= 0x04
        path.write_bytes(bytes(blob))
    else:
        path.write_bytes(encode(key_of(1), make_entry(1, namespace="othermodel"), "othermodel"))
    with caplog.at_level(logging.WARNING):
        again = tier_at(tmp_path, validate=validate)
        assert again.get(key_of(1)) is None
    counter = "foreign" if damage == "foreign" else "corrupt"
    assert getattr(again.stats, counter) == 1
    assert not path.exists() and key_of(1) not in again.keys()
    assert again.get(key_of(0)).equal(make_entry(0)) and again.get(key_of(2)).equal(make_entry(2))
    assert again.used_bytes == disk_bytes_on_disk(tmp_path)[0]
    if validate == "lazy":  # found by the read, which is a miss
        assert again.stats.misses == 1
    else:  # found at start, never indexed
        assert again.stats.misses == 1 and again.stats.hits == 2


def test_budget_is_real_bytes_on_disk_under_random_workload(tmp_path):
    rng = random.Random(3)
    budget = 60_000
    tier = tier_at(tmp_path, budget)
    for step in range(300):
        i = rng.randrange(40)
        op = rng.random()
        if op < 0.55:
            tier.put(key_of(i), make_entry(i, tokens=rng.choice([4, 16, 48])))
        elif op < 0.85:
            got = tier.get(key_of(i))
            assert got is None or got.meta["seed"] == str(i)
        else:
            tier.remove(key_of(i))
        on_disk, files = disk_bytes_on_disk(tmp_path)
        assert on_disk <= budget, f"step {step}: {on_disk} bytes on disk > {budget}"
        assert tier.used_bytes == on_disk and files == len(tier.keys())
        assert tier.allocated_bytes() == on_disk  # the locked snapshot bench tiers samples
    assert tier.stats.evictions > 0


def test_budget_holds_during_the_write(tmp_path, monkeypatch):
    """The temp file being written is counted: used + in-flight never passes the budget."""
    budget = 3 * 4096 * 2
    tier = tier_at(tmp_path, budget)
    real_replace = os.replace

    def checking_replace(src, dst):
        assert disk_bytes_on_disk(tmp_path)[0] <= budget
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", checking_replace)
    for i in range(10):
        tier.put(key_of(i), make_entry(i, tokens=16))
    assert disk_bytes_on_disk(tmp_path)[0] <= budget


def test_entry_larger_than_budget_is_refused(tmp_path):
    tier = tier_at(tmp_path, 4096)
    assert not tier.put(key_of(1), make_entry(1, tokens=256))
    assert tier.stats.refused == 1 and disk_bytes_on_disk(tmp_path) == (0, 0)


def test_disk_full_skips_the_write_with_a_warning(tmp_path, monkeypatch):
    tier = tier_at(tmp_path)
    assert tier.put(key_of(1), make_entry(1))

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "replace", full)
    with pytest.warns(RuntimeWarning, match="skipped"):
        assert not tier.put(key_of(2), make_entry(2))
    assert tier.stats.skipped_writes == 1
    assert not list(tmp_path.rglob("*.tmp"))  # the temp file is cleaned up
    assert tier.used_bytes == disk_bytes_on_disk(tmp_path)[0]
    assert tier.get(key_of(1)).equal(make_entry(1))  # serving continues
    monkeypatch.undo()
    assert tier.put(key_of(2), make_entry(2))


def test_unwritable_directory_skips_the_write(tmp_path, monkeypatch):
    tier = tier_at(tmp_path)

    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(tier, "_open_temp", read_only)
    with pytest.warns(RuntimeWarning):
        assert not tier.put(key_of(1), make_entry(1))
    assert tier.stats.skipped_writes == 1 and tier.used_bytes == 0


def test_budget_shrunk_between_runs_evicts_at_start(tmp_path):
    tier = tier_at(tmp_path, 1 << 20)
    for i in range(6):
        tier.put(key_of(i), make_entry(i, tokens=16))
    one = tier.entry_bytes(key_of(0))
    tier.close()
    small = tier_at(tmp_path, 3 * one)
    assert len(small.keys()) == 3 and disk_bytes_on_disk(tmp_path)[0] <= small.budget_bytes


def test_foreign_files_in_the_directory_are_left_alone(tmp_path):
    (tmp_path / "README").write_text("not a cache file")
    (tmp_path / "ab").mkdir()
    (tmp_path / "ab" / "notes.txt").write_text("neither")
    tier = tier_at(tmp_path)
    assert tier.keys() == [] and tier.used_bytes == 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tier.put(key_of(1), make_entry(1))
    assert (tmp_path / "README").exists()
