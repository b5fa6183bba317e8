"""The files of an index directory: layout, checksums, and the crash-safe save.

Owns: the layout constants (``MANIFEST``, the array and file names, the format and its version),
``file_sha256``, ``save_index`` (every file written and fsynced in a temp directory, then swapped
in) and ``clean_leftovers``. Does not own: the manifest model, loading and its checks, or search
(``index``).

Saving (``save_index``): files are written into ``.<name>.cachedrag-build-<pid>-<hex>/`` next to
the target, held by an ``flock`` on the sibling ``.lock`` file while the build runs, then
swapped in with one ``renameat2(RENAME_EXCHANGE)`` (Linux): at every instant the path holds
a complete index, the old one or the new one, and a failed exchange changes nothing. Where
the exchange is unsupported, two renames are used and a failure of the second renames the
old index back. Temp directories of builds that died (kill -9) are removed by the next save
next to the same path; nothing else is touched. Written with ``ctypes`` because the standard
library has no exchange-rename; ``_exchange`` / ``_rename`` are the seams fault tests use.

Layout of an index directory (no pickle anywhere; numpy files load with
``allow_pickle=False``)::

    manifest.json      IndexManifest
    chunks.jsonl       one Chunk record per line (id, doc_id, text, offsets), row order
    token_ids.npy      int32 [T] all chunks' LLM token ids, concatenated
    token_offsets.npy  int64 [n_chunks + 1] chunk i is token_ids[o[i]:o[i + 1]]
    centroids.npy      float32 [nlist, d]
    vectors.npy        float32 [n_chunks, d] embeddings, cluster-contiguous
    ids.npy            int64 [n_chunks] chunk row of each vector row
    offsets.npy        int64 [nlist + 1] cluster c is vector rows o[c]:o[c + 1]
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import hashlib
import json
import os
import secrets
import shutil
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np

from cachedrag.errors import ConfigError

MANIFEST = "manifest.json"
FORMAT = "cachedrag-ivf-index"
FORMAT_VERSION = 2
ARRAYS = ("token_ids", "token_offsets", "centroids", "vectors", "ids", "offsets")
FILES = frozenset([*(f"{a}.npy" for a in ARRAYS), "chunks.jsonl"])
BUILD_TAG = ".cachedrag-build-"
_STALE_LOCK_S = 60.0  # a live pid with a free lock this old is a reused pid, not a build in progress


def save_index(index: Any, out: Path) -> Path:
    """Write ``index`` (a ``RetrievalIndex``: its manifest, chunks and IVF arrays) to ``out`` through a
    temp directory swapped in at once (module docstring)."""
    if out.exists() and not (out / MANIFEST).is_file() and any(out.iterdir()):
        raise ConfigError(f"{out} exists and is not a cachedrag index directory; refusing to overwrite it")
    out.parent.mkdir(parents=True, exist_ok=True)
    clean_leftovers(out)
    base = out.parent / f".{out.name}{BUILD_TAG}{os.getpid()}-{secrets.token_hex(6)}"
    lock = Path(f"{base}.lock")
    lock_fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
    tmp = base
    try:
        fcntl.flock(lock_fd, fcntl.LOCK_EX)
        tmp.mkdir()
        token_offsets = np.concatenate([[0], np.cumsum([len(c.token_ids) for c in index.chunks])]).astype(np.int64)
        token_ids = np.fromiter((t for c in index.chunks for t in c.token_ids), dtype=np.int32, count=int(token_offsets[-1]))
        arrays = {
            "token_ids": token_ids,
            "token_offsets": token_offsets,
            "centroids": index.ivf.quantizer.centroids.cpu().numpy(),
            "vectors": index.ivf.vectors.cpu().numpy(),
            "ids": index.ivf.ids.cpu().numpy(),
            "offsets": index.ivf.offsets.cpu().numpy(),
        }
        files: dict[str, str] = {}
        for name, array in arrays.items():
            files[f"{name}.npy"] = _write(tmp / f"{name}.npy", lambda fh, a=array: np.save(fh, np.ascontiguousarray(a)))
        lines = "".join(json.dumps(c.to_record(), ensure_ascii=False) + "\n" for c in index.chunks)
        files["chunks.jsonl"] = _write(tmp / "chunks.jsonl", lambda fh: fh.write(lines.encode("utf-8")))
        manifest = index.manifest.model_copy(update={"files": files, "format_version": FORMAT_VERSION}).sealed()
        _write(tmp / MANIFEST, lambda fh: fh.write(manifest.model_dump_json(indent=2).encode()))
        os.chmod(tmp, 0o755)
        _fsync_dir(tmp)
        _swap_in(tmp, out)  # afterwards ``tmp`` holds the old index (or nothing)
        _fsync_dir(out.parent)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(Path(f"{base}.old"), ignore_errors=True)
        lock.unlink(missing_ok=True)
        os.close(lock_fd)
    return out


def _swap_in(new: Path, out: Path) -> None:
    """Put the complete index ``new`` at ``out``; the old index (if any) ends up at ``new``.

    ``out`` holds a complete index at every instant: one atomic exchange where the system has
    it; else two renames, the old index renamed back if the second fails."""
    if not out.exists():
        _rename(new, out)
        return
    try:
        _exchange(new, out)
        return
    except OSError as exc:
        if exc.errno not in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):
            raise  # a real failure: nothing changed, ``out`` still holds the old index
    old = Path(f"{new}.old")
    _rename(out, old)
    try:
        _rename(new, out)
    except BaseException:
        _rename(old, out)  # put the old index back
        raise
    _rename(old, new)


def _rename(src: Path, dst: Path) -> None:
    """``rename(2)`` (a seam: fault tests make it fail)."""
    os.rename(src, dst)


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _exchange(a: Path, b: Path) -> None:
    """Atomically swap two paths (``renameat2(..., RENAME_EXCHANGE)``, Linux 3.15+, glibc 2.28+).
    ``OSError(ENOSYS)`` where unavailable. A seam: fault tests make it fail."""
    libc = ctypes.CDLL(None, use_errno=True)
    fn = getattr(libc, "renameat2", None)
    if fn is None:
        raise OSError(errno.ENOSYS, "renameat2 is not available")
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), str(a), None, str(b))


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def clean_leftovers(out: str | Path) -> list[Path]:
    """Remove the temp directories that dead builds of ``out`` left next to it (our
    ``.<name>.cachedrag-build-*`` names only; a build still running holds its lock and is
    left alone). If a build died between the two renames of the fallback swap and ``out`` is
    missing, its old index is renamed back first. Returns what was removed."""
    out = Path(out)
    if not out.parent.is_dir():
        return []
    prefix = f".{out.name}{BUILD_TAG}"
    builds: dict[str, list[Path]] = {}
    for p in out.parent.iterdir():
        if p.name.startswith(prefix) and not p.is_symlink():
            build = p.name[len(prefix):].split(".")[0]
            builds.setdefault(build, []).append(p)
    removed: list[Path] = []
    for build, paths in builds.items():
        base = out.parent / f"{prefix}{build}"
        if not _dead(build, Path(f"{base}.lock")):
            continue
        old = Path(f"{base}.old")
        if not out.exists() and (old / MANIFEST).is_file():
            os.rename(old, out)
            warnings.warn(f"{out} was missing after a build died mid-swap; its previous index was restored",
                          RuntimeWarning, stacklevel=2)
        for p in paths:
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p, ignore_errors=True)
            elif p.exists():
                p.unlink(missing_ok=True)
            removed.append(p)
    return removed


def _dead(build: str, lock: Path) -> bool:
    """Whether the build ``<pid>-<hex>`` is over: its process is gone, or its lock is free
    (and old enough that it is not a build between creating and locking it)."""
    try:
        pid = int(build.split("-")[0])
    except ValueError:
        return False  # not a name we make
    if pid != os.getpid():
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            pass  # alive, someone else's
    try:
        fd = os.open(lock, os.O_RDWR)
    except FileNotFoundError:
        return pid != os.getpid() and _older_than(lock.with_suffix(""), _STALE_LOCK_S)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return False  # held: a build in progress
    finally:
        os.close(fd)
    return _older_than(lock, _STALE_LOCK_S)


def _older_than(path: Path, seconds: float) -> bool:
    try:
        return time.time() - os.lstat(path).st_mtime > seconds
    except FileNotFoundError:
        return True


def _write(path: Path, write) -> str:
    """Write a file, fsync it (so its pages can later be dropped from the cache), return its sha256."""
    with path.open("wb") as fh:
        write(fh)
        fh.flush()
        os.fsync(fh.fileno())
    return file_sha256(path)


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
