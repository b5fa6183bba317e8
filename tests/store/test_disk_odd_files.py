"""DiskTier among odd things in its directory: only regular files with our names, in real
shard directories, are read, charged or deleted; sizes are checked before reading; one owner
per directory; a delete that fails on a read-only disk is not reported as done."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import warnings

import pytest

from cachedrag.errors import DirectoryInUseError
from cachedrag.store.config import StoreConfig
from cachedrag.store.disk import DiskTier
from cachedrag.store.disk_files import temp_name
from cachedrag.store.tiered import TieredStore
from tests.faults.helpers import tree
from tests.store.helpers import NS, disk_bytes_on_disk, key_of, make_entry


def tier_at(path, budget=1 << 20, **kw) -> DiskTier:
    kw.setdefault("fsync", False)
    return DiskTier(path, budget, namespace=NS, **kw)


def entry_path(root, i):
    k = key_of(i)
    (root / k[:2]).mkdir(exist_ok=True)
    return root / k[:2] / f"{k}.safetensors"


@pytest.mark.parametrize("validate", ["lazy", "header", "full"])
def test_odd_files_named_like_entries_are_left_alone(tmp_path, validate):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        first = tier_at(tmp_path)
        for i in range(3):
            assert first.put(key_of(i), make_entry(i))
        first.close()
    outside = tmp_path.parent / f"{tmp_path.name}-outside"
    outside.mkdir()
    (outside / "precious.tmp").write_bytes(b"not yours")
    os.symlink(tmp_path / "nowhere", entry_path(tmp_path, 10))  # dangling symlink
    os.mkfifo(entry_path(tmp_path, 11))  # a FIFO: opening it for reading would block
    with open(entry_path(tmp_path, 12), "wb") as f:  # a huge sparse file: 64 GiB apparent size
        f.truncate(64 << 30)
    assert not (tmp_path / key_of(13)[:2]).exists()
    os.symlink(outside, tmp_path / key_of(13)[:2])  # a symlinked shard: nothing behind it is ours
    (outside / f".{key_of(13)}.cachedrag-1-0123456789abcdef.tmp").write_bytes(b"named like ours, behind a link")
    (outside / f"{key_of(13)}.safetensors").write_bytes(b"behind a link")
    (entry_path(tmp_path, 14).parent / ".foreign.tmp").write_bytes(b"someone's temp")
    (entry_path(tmp_path, 14).parent / f".{key_of(14)}.abc123.tmp").write_bytes(b"looks like ours, is not")
    os.symlink(tmp_path / key_of(0)[:2] / f"{key_of(0)}.safetensors", entry_path(tmp_path, 15))  # to a real entry
    before = tree(tmp_path.parent)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        tier = tier_at(tmp_path, 1 << 20, validate=validate)  # must start, without hanging
        assert sorted(tier.keys()) == sorted(key_of(i) for i in range(3))
        for i in (10, 11, 12, 13, 14, 15):
            assert tier.get(key_of(i)) is None and tier.info(key_of(i)) is None
            assert tier.open_source(key_of(i)) is None
        assert tier.get(key_of(0)).equal(make_entry(0))
        assert tier.used_bytes <= tier.budget_bytes
    after = tree(tmp_path.parent)
    assert before == after  # nothing added, removed or changed
    tier.close()


def test_huge_sparse_file_replacing_an_entry_is_never_read(tmp_path, monkeypatch):
    tier = tier_at(tmp_path)
    for i in range(3):
        assert tier.put(key_of(i), make_entry(i))
    with open(tier.path(key_of(1)), "r+b") as f:  # grows behind our back
        f.truncate(64 << 30)
    reads = []
    real_pread = os.pread
    monkeypatch.setattr(os, "pread", lambda fd, n, off: reads.append(n) or real_pread(fd, n, off))
    assert tier.get(key_of(1)) is None
    assert max(reads, default=0) < 1 << 20  # never read whole
    assert tier.stats.corrupt == 1 and key_of(1) not in tier.keys()
    assert tier.get(key_of(0)).equal(make_entry(0)) and tier.get(key_of(2)).equal(make_entry(2))
    assert tier.used_bytes == disk_bytes_on_disk(tmp_path)[0]


def test_entry_path_replaced_by_a_symlink_or_fifo_is_a_miss_and_left_alone(tmp_path):
    tier = tier_at(tmp_path)
    for i in range(2):
        assert tier.put(key_of(i), make_entry(i))
    target = tmp_path.parent / f"{tmp_path.name}-target"
    target.write_bytes(b"not yours")
    os.replace(tier.path(key_of(0)), tmp_path / "moved-away")
    os.symlink(target, tier.path(key_of(0)))
    tier.path(key_of(1)).unlink()
    os.mkfifo(tier.path(key_of(1)))
    with pytest.warns(RuntimeWarning, match="not a regular file"):
        assert tier.get(key_of(0)) is None
    with pytest.warns(RuntimeWarning, match="not a regular file"):
        assert tier.get(key_of(1)) is None
    assert tier.keys() == [] and tier.used_bytes == 0
    assert os.path.islink(tier.path(key_of(0))) and target.read_bytes() == b"not yours"
    with pytest.warns(RuntimeWarning, match="skipped"):  # a write never replaces what is not ours
        assert not tier.put(key_of(0), make_entry(0))
    assert os.path.islink(tier.path(key_of(0)))


def test_never_writes_through_a_symlinked_shard(tmp_path):
    outside = tmp_path.parent / f"{tmp_path.name}-elsewhere"
    outside.mkdir()
    os.symlink(outside, tmp_path / key_of(5)[:2])
    tier = tier_at(tmp_path)
    with pytest.warns(RuntimeWarning, match="not a real directory"):
        assert not tier.put(key_of(5), make_entry(5))
    assert list(outside.iterdir()) == [] and tier.used_bytes == 0


def test_temp_names_are_unique_and_match_only_our_pattern():
    names = {temp_name(key_of(1)) for _ in range(100)}
    assert len(names) == 100 and all(n.startswith(f".{key_of(1)}.cachedrag-{os.getpid()}-") for n in names)


def test_a_second_owner_of_the_directory_is_refused(tmp_path):
    tier = tier_at(tmp_path)
    with pytest.raises(DirectoryInUseError, match="in use"):
        tier_at(tmp_path)
    cfg = StoreConfig(namespace=NS, disk_dir=tmp_path, disk_bytes=1 << 20)
    with pytest.raises(DirectoryInUseError):
        TieredStore.from_config(cfg)
    code = ("import sys; from cachedrag.store.disk import DiskTier\n"
            "from cachedrag.errors import DirectoryInUseError\n"
            f"try:\n    DiskTier({str(tmp_path)!r}, 1 << 20, namespace={NS!r})\n"
            "except DirectoryInUseError as e:\n    print('refused:', e); sys.exit(3)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 3 and "in use" in proc.stdout, proc.stderr[-2000:]
    tier.close()
    tier_at(tmp_path).close()  # released: the next owner starts


def test_remove_on_a_read_only_disk_is_not_reported_as_done(tmp_path, monkeypatch):
    store = TieredStore.from_config(StoreConfig(namespace=NS, cpu_bytes=1 << 20, disk_dir=tmp_path,
                                                disk_bytes=1 << 20, disk_fsync=False, write_through=True))
    assert store.put(key_of(1), make_entry(1))
    assert store.put(key_of(2), make_entry(2), parent=key_of(1))  # a child that stays in the CPU tier
    disk = store.tier("disk")
    assert disk.contains(key_of(1))

    def read_only(path):
        raise OSError(errno.EROFS, "Read-only file system", str(path))

    monkeypatch.setattr(disk, "_unlink", read_only)
    with pytest.warns(RuntimeWarning, match="still charged"):
        assert store.remove(key_of(1)) is False
    assert disk.contains(key_of(1)) and disk.path(key_of(1)).exists()
    assert disk.used_bytes == disk_bytes_on_disk(tmp_path)[0] > 0
    assert store.check_invariants() == []
    monkeypatch.undo()
    assert store.remove(key_of(1)) is True
    assert not disk.path(key_of(1)).exists() and disk.contains(key_of(2))
    assert disk.used_bytes == disk_bytes_on_disk(tmp_path)[0] == disk.entry_bytes(key_of(2))
    assert store.check_invariants() == []
    store.close()


def test_blocks_the_filesystem_maps_after_the_write_are_charged_not_taken_for_damage(tmp_path, monkeypatch):
    tier = tier_at(tmp_path)
    assert tier.put(key_of(0), make_entry(0))
    used = tier.used_bytes
    real_fstat = os.fstat

    def later_blocks(fd):  # delayed allocation: an extent block more once written back
        st = real_fstat(fd)
        return os.stat_result(list(st) + [st.st_atime, st.st_mtime, st.st_ctime], {"st_blocks": st.st_blocks + 8})

    monkeypatch.setattr(os, "fstat", later_blocks)
    assert tier.get(key_of(0)).equal(make_entry(0))
    assert tier.stats.corrupt == 0 and tier.used_bytes == used + 4096
