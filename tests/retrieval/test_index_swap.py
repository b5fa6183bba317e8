"""Index directories under faults: a failed rename during the swap (injected through the
``_exchange`` / ``_rename`` seams) leaves the old complete index at the path; temp directories
of killed builds are cleaned by the next save (nothing else is touched); the manifest verifies
itself (emptied ``files``, an edited ``metric``, out-of-range ids are all refused)."""

from __future__ import annotations

import copy
import errno
import json
import subprocess
import sys

import numpy as np
import pytest

from cachedrag.errors import CorruptCacheError
from cachedrag.retrieval import index_files as index_mod
from cachedrag.retrieval.index import IndexManifest, load_index
from cachedrag.retrieval.index_files import BUILD_TAG


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def same(a, b) -> bool:
    return a.manifest == b.manifest and [c.id for c in a.chunks] == [c.id for c in b.chunks]


@pytest.fixture
def index(tiny_index):
    return copy.copy(tiny_index)  # save() sets .path: keep the session fixture's own


@pytest.fixture
def saved(index, tmp_path):
    out = tmp_path / "idx"
    index.save(out)
    return out, load_index(out)


@pytest.mark.parametrize("fail", ["exchange", "fallback_second_rename"])
def test_failed_rename_keeps_the_old_complete_index(index, saved, monkeypatch, fail):
    out, old = saved
    (out / "marker").write_text("old")  # tells the old directory from a new one
    calls = []
    real_rename = index_mod._rename

    def broken_exchange(a, b):
        raise OSError(errno.EIO if fail == "exchange" else errno.ENOSYS, "injected")

    def flaky_rename(src, dst):
        calls.append((src, dst))
        if len(calls) == 2:  # the fallback's second rename: new -> out
            raise OSError(errno.EIO, "injected")
        real_rename(src, dst)

    monkeypatch.setattr(index_mod, "_exchange", broken_exchange)
    monkeypatch.setattr(index_mod, "_rename", flaky_rename)
    with pytest.raises(OSError, match="injected"):
        index.save(out)
    assert (out / "marker").read_text() == "old"
    assert same(load_index(out), old)
    assert sorted(p.name for p in out.parent.iterdir()) == ["idx"]  # nothing of the build left
    monkeypatch.undo()
    index.save(out)  # and the next save works
    assert not (out / "marker").exists() and same(load_index(out), old)


def test_exchange_swaps_atomically(index, saved):
    out, old = saved
    (out / "marker").write_text("old")
    index.save(out)
    assert not (out / "marker").exists() and same(load_index(out), old)
    assert sorted(p.name for p in out.parent.iterdir()) == ["idx"]


def test_leftovers_of_killed_builds_are_cleaned_by_the_next_save(index, saved):
    out, old = saved
    pid = dead_pid()
    dead = out.parent / f".idx{BUILD_TAG}{pid}-0123456789ab"
    dead.mkdir()
    (dead / "vectors.npy").write_bytes(b"half")
    (out.parent / f".idx{BUILD_TAG}{pid}-0123456789ab.lock").write_text("")
    foreign = out.parent / ".idx.somebody-elses"
    foreign.mkdir()
    other_index_leftover = out.parent / f".other{BUILD_TAG}{pid}-0123456789ab"
    other_index_leftover.mkdir()
    index.save(out)
    names = sorted(p.name for p in out.parent.iterdir())
    assert names == sorted(["idx", foreign.name, other_index_leftover.name])


def test_a_build_killed_mid_fallback_swap_is_restored(index, saved):
    out, old = saved
    pid = dead_pid()
    base = out.parent / f".idx{BUILD_TAG}{pid}-0123456789ab"
    out.rename(f"{base}.old")  # the kill came between "out -> old" and "new -> out"
    with pytest.warns(RuntimeWarning, match="restored"):
        index_mod.clean_leftovers(out)
    assert same(load_index(out), old)
    assert sorted(p.name for p in out.parent.iterdir()) == ["idx"]


def edit_manifest(path, edit, reseal: bool) -> None:
    raw = json.loads((path / "manifest.json").read_text())
    edit(raw)
    if reseal:
        raw["manifest_sha256"] = IndexManifest.model_validate(raw).digest()
    (path / "manifest.json").write_text(json.dumps(raw))


@pytest.mark.parametrize("edit", ["empty_files", "metric", "drop_checksum"])
def test_manifest_edits_are_detected(saved, edit):
    out, _ = saved
    edits = {
        "empty_files": lambda m: m.update(files={}),
        "metric": lambda m: m.update(metric="l2" if m["metric"] == "ip" else "ip"),
        "drop_checksum": lambda m: m.pop("manifest_sha256"),
    }
    edit_manifest(out, edits[edit], reseal=False)
    with pytest.raises(CorruptCacheError):
        load_index(out)
    with pytest.raises(CorruptCacheError):
        load_index(out, verify=False)


def test_emptied_files_with_a_recomputed_checksum_are_still_refused(saved):
    out, _ = saved
    edit_manifest(out, lambda m: m.update(files={}), reseal=True)
    with pytest.raises(CorruptCacheError, match="file table"):
        load_index(out)


def test_out_of_range_ids_are_refused_at_load_not_crashing_a_search(saved):
    out, _ = saved
    ids = np.load(out / "ids.npy")
    ids[0] = len(ids) + 5
    np.save(out / "ids.npy", ids)
    digest = index_mod.file_sha256(out / "ids.npy")
    edit_manifest(out, lambda m: m["files"].update({"ids.npy": digest}), reseal=True)  # a thorough forger
    with pytest.raises(CorruptCacheError, match="permutation"):
        load_index(out)
