"""The disk tier: one safetensors file per entry in a local (SSD) directory.

Owns: the directory layout, atomic writes, the byte budget in real allocated bytes, the
index rebuilt at start (caches survive restarts) and disk-error handling. Does not own:
the byte format (``codec``) or cross-tier placement.

Layout: ``<dir>/<key[:2]>/<key>.safetensors`` (256 shard directories at most, created on
demand). Writes go to ``<dir>/<key[:2]>/.<key>.<random>.tmp`` in the same shard, are
flushed and fsynced, then ``os.replace``d over the final name: a reader sees the old file,
the new file or nothing, never a partial one. Temp files left by a crash are deleted at
start.

Budget: each file is charged ``max(size rounded up to the filesystem block, st_blocks *
512)`` — what it occupies. Room (and the bytes of the temp file being written) is reserved
before writing, so the files in the directory never exceed ``budget_bytes`` at any moment,
temp files included. Not counted: the shard directories' own inodes (at most 256) and the
blocks of a file removed while another thread still reads it.

Validation at start (``validate``): ``"lazy"`` stats files only (every get still verifies
the full checksum); ``"header"`` (default) also reads each header — namespace, key, format,
length — removing foreign and truncated files before they take budget; ``"full"`` decodes
and verifies every file. Bad files found at any time are counted (``corrupt`` /
``foreign``), removed and served as misses.

Errors: an ``OSError`` on write (disk full, read-only directory) skips the write with a
``RuntimeWarning``, counts ``skipped_writes`` and leaves the tier serving.

One process per directory: the index lives in this process (share across processes and
machines with the Redis tier).
"""

from __future__ import annotations

import logging
import os
import tempfile
import time
import warnings
from collections import OrderedDict
from pathlib import Path
from typing import Literal

import torch

from cachedrag.errors import CorruptCacheError
from cachedrag.store.base import EntryInfo, HeaderTier, Prepared, check_key
from cachedrag.store.codec import ForeignEntryError, check_namespace, decode, decode_extras, encode, read_header
from cachedrag.store.entry import KVEntry
from cachedrag.store.source import BlobSource, LayerSource

SUFFIX = ".safetensors"
TMP_SUFFIX = ".tmp"
Validate = Literal["lazy", "header", "full"]
logger = logging.getLogger(__name__)


class DiskTier(HeaderTier):
    """Entries as safetensors files under ``directory``, within ``budget_bytes`` on disk."""

    persistent = True
    serialized = True

    def __init__(
        self,
        directory: str | os.PathLike[str],
        budget_bytes: int,
        *,
        namespace: str,
        validate: Validate = "header",
        fsync: bool = True,
        self_evict: bool = True,
        name: str = "disk",
    ) -> None:
        super().__init__(name, budget_bytes, namespace, self_evict=self_evict)
        if validate not in ("lazy", "header", "full"):
            raise ValueError(f"validate must be 'lazy', 'header' or 'full', got {validate!r}")
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.fsync = fsync
        self.validate = validate
        self._block = os.statvfs(self.directory).f_frsize or 4096
        self._index: OrderedDict[str, int] = OrderedDict()  # key -> charged bytes, oldest use first
        self._used = 0
        self._reserved = 0  # bytes of writes in flight (their temp files)
        self._rebuild()

    # ---- paths and sizes -----------------------------------------------------------------
    def path(self, key: str) -> Path:
        return self.directory / key[:2] / (key + SUFFIX)

    def _alloc(self, nbytes: int) -> int:
        return -(-nbytes // self._block) * self._block

    def _charge(self, st: os.stat_result) -> int:
        return max(self._alloc(st.st_size), st.st_blocks * 512)

    @property
    def used_bytes(self) -> int:
        with self._lock:
            return self._used + self._reserved

    # ---- start-up ------------------------------------------------------------------------
    def _rebuild(self) -> None:
        """Index the directory: drop temp files, charge real sizes, validate per ``validate``."""
        found: list[tuple[int, str, int, int]] = []  # (mtime_ns, key, charge, inode)
        for shard in sorted(self.directory.iterdir()):
            if not shard.is_dir() or len(shard.name) != 2:
                continue
            for f in shard.iterdir():
                if f.name.endswith(TMP_SUFFIX):
                    self._unlink_quiet(f, "leftover temp file")
                    self.stats.temp_cleaned += 1
                    continue
                key = f.name[: -len(SUFFIX)] if f.name.endswith(SUFFIX) else ""
                try:
                    check_key(key)
                except ValueError:
                    continue  # not ours: leave it alone, not charged
                if key[:2] != shard.name:
                    continue
                st = f.stat()
                found.append((st.st_mtime_ns, key, self._charge(st), st.st_ino))
        for _, key, charge, ino in sorted(found):
            if self.validate != "lazy" and not self._valid_at_start(key, ino):
                continue
            self._index[key] = charge
            self._used += charge
        while self._used > self._budget and self._index:  # budget shrank since last run
            self._evict_oldest()

    def _valid_at_start(self, key: str, ino: int) -> bool:
        try:
            if self.validate == "full":
                decode(self.path(key).read_bytes(), key, self.namespace)
            else:
                with open(self.path(key), "rb") as f:
                    size = os.fstat(f.fileno()).st_size
                    read_header(lambda off, ln: os.pread(f.fileno(), ln, off), size, key, self.namespace)
        except CorruptCacheError as exc:
            self._discard_bad(key, ino, exc)
            return False
        except OSError as exc:
            warnings.warn(f"{self.name}: cannot read {self.path(key)} at start ({exc}); not indexed", RuntimeWarning, stacklevel=3)
            return False
        return True

    # ---- reads ---------------------------------------------------------------------------
    def contains(self, key: str) -> bool:
        with self._lock:
            return key in self._index

    def keys(self) -> list[str]:
        with self._lock:
            return list(self._index)

    def entry_bytes(self, key: str) -> int | None:
        with self._lock:
            return self._index.get(key)

    def _get(self, key: str) -> KVEntry | None:
        if not self.contains(key):
            return None
        try:
            with open(self.path(key), "rb") as f:
                ino = os.fstat(f.fileno()).st_ino
                blob = f.read()
        except FileNotFoundError:
            self._forget(key)
            return None
        except OSError as exc:
            warnings.warn(f"{self.name}: read of {key} failed ({exc}); served as a miss", RuntimeWarning, stacklevel=3)
            return None
        try:
            entry = decode(blob, key, self.namespace)
        except CorruptCacheError as exc:
            self._discard_bad(key, ino, exc)
            return None
        with self._lock:
            if key in self._index:
                self._index.move_to_end(key)
        return entry

    def _open_fd(self, key: str) -> int | None:
        """A read-only descriptor of ``key``'s file, or None when the index or the disk lacks it
        (a file gone behind our back is forgotten). Other OS errors propagate."""
        if not self.contains(key):
            return None
        try:
            return os.open(self.path(key), os.O_RDONLY)
        except FileNotFoundError:
            self._forget(key)
            return None

    def _read_header(self, key: str, *, extras: bool) -> tuple[EntryInfo, dict[str, torch.Tensor]] | None:
        """Header (and with ``extras`` the non-layered tensors) of ``key``'s file; K/V are not read."""
        try:
            fd = self._open_fd(key)
        except OSError as exc:
            warnings.warn(f"{self.name}: header read of {key} failed ({exc}); served as a miss", RuntimeWarning, stacklevel=3)
            return None
        if fd is None:
            return None
        try:
            st = os.fstat(fd)

            def read_at(offset: int, length: int) -> bytes:
                return os.pread(fd, length, offset)

            header = read_header(read_at, st.st_size, key, self.namespace)
            tensors = decode_extras(header, read_at) if extras else {}
        except CorruptCacheError as exc:
            self._discard_bad(key, st.st_ino, exc)
            return None
        except OSError as exc:
            warnings.warn(f"{self.name}: header read of {key} failed ({exc}); served as a miss", RuntimeWarning, stacklevel=3)
            return None
        finally:
            os.close(fd)
        return EntryInfo(dict(header.meta), header.nbytes, header.n_layers, header.n_tokens), tensors

    def open_source(self, key: str) -> LayerSource | None:
        fd = self._open_fd(key)
        if fd is None:
            return None
        st = os.fstat(fd)

        def read_at(offset: int, length: int) -> bytes:
            return os.pread(fd, length, offset)

        try:
            header = read_header(read_at, st.st_size, key, self.namespace)
        except CorruptCacheError as exc:
            os.close(fd)
            self._discard_bad(key, st.st_ino, exc)
            return None
        with self._lock:
            self.stats.hits += 1
            if key in self._index:
                self._index.move_to_end(key)
        return BlobSource(
            header,
            read_at,
            self.name,
            on_close=lambda: os.close(fd),
            on_corrupt=lambda exc: self._discard_bad(key, st.st_ino, exc),
        )

    # ---- writes --------------------------------------------------------------------------
    def prepare(self, key: str, entry: KVEntry, *, blob: bytes | None = None, copy: bool = True) -> Prepared:
        check_key(key)
        check_namespace(entry, self.namespace)
        if blob is None:
            blob = encode(key, entry, self.namespace)
        return Prepared(key, self._alloc(len(blob)), blob)

    def commit(self, prepared: Prepared) -> bool:
        key, reserve, blob = prepared.key, prepared.nbytes, prepared.payload
        assert isinstance(blob, bytes)
        with self._lock:
            if not self._reserve(reserve, key):
                self.stats.refused += 1
                return False
        t0 = time.perf_counter()
        tmp: str | None = None
        try:
            shard = self.path(key).parent
            shard.mkdir(exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=shard, prefix=f".{key}.", suffix=TMP_SUFFIX)
            with os.fdopen(fd, "wb") as f:
                f.write(blob)
                f.flush()
                if self.fsync:
                    os.fsync(f.fileno())
                charge = self._charge(os.fstat(f.fileno()))
            with self._lock:
                if charge > reserve:  # the filesystem took more blocks than planned
                    if not self._reserve(charge - reserve, key):
                        raise OSError(f"file took {charge} bytes, {reserve} reserved and no room for the rest")
                    reserve = charge
                os.replace(tmp, self.path(key))
                tmp = None
                self._used += charge - self._index.pop(key, 0)
                self._index[key] = charge
                self._reserved -= reserve
                reserve = 0
                self.stats.puts += 1
                self.stats.put_bytes += charge
                self.stats.store_seconds += time.perf_counter() - t0
            if self.fsync:
                self._fsync_dir(shard)
            return True
        except OSError as exc:
            warnings.warn(f"{self.name}: write of {key} skipped ({exc}); serving continues", RuntimeWarning, stacklevel=3)
            with self._lock:
                self.stats.skipped_writes += 1
                self._reserved -= reserve
            if tmp is not None:
                self._unlink_quiet(Path(tmp), "temp file of a failed write")
            return False

    def _reserve(self, nbytes: int, key: str) -> bool:
        """Under the lock: make ``nbytes`` free (LRU self-eviction if allowed) and reserve them."""
        if nbytes > self._budget:
            return False
        while self._used + self._reserved + nbytes > self._budget:
            victim = next((k for k in self._index if k != key), None)
            if victim is None or not self.self_evict:
                return False
            self._evict_oldest(victim)
        self._reserved += nbytes
        return True

    def _evict_oldest(self, key: str | None = None) -> None:
        key = key if key is not None else next(iter(self._index))
        if self._delete(key):
            self.stats.evictions += 1

    def remove(self, key: str) -> bool:
        with self._lock:
            if key not in self._index:
                return False
            ok = self._delete(key)
            if ok:
                self.stats.removes += 1
            return ok

    def _delete(self, key: str) -> bool:
        """Under the lock: unlink ``key``'s file and uncharge it (kept charged if unlink fails)."""
        try:
            self.path(key).unlink(missing_ok=True)
        except OSError as exc:
            warnings.warn(f"{self.name}: cannot delete {key} ({exc}); still charged", RuntimeWarning, stacklevel=4)
            return False
        self._used -= self._index.pop(key, 0)
        return True

    def _forget(self, key: str) -> None:
        """A read found no file: uncharge ``key`` unless a write put it back meanwhile."""
        with self._lock:
            if key in self._index and not self.path(key).exists():
                self._used -= self._index.pop(key)

    def _discard_bad(self, key: str, ino: int, exc: CorruptCacheError) -> None:
        """Count a bad file and remove it — only if the path still names the inode we read."""
        kind = "foreign" if isinstance(exc, ForeignEntryError) else "corrupt"
        logger.warning("%s: %s file for %s removed (%s)", self.name, kind, key, exc)
        with self._lock:
            if kind == "foreign":
                self.stats.foreign += 1
            else:
                self.stats.corrupt += 1
            try:
                same = self.path(key).stat().st_ino == ino
            except FileNotFoundError:
                same = False
                self._used -= self._index.pop(key, 0)
            if same:
                self._delete(key)

    def _unlink_quiet(self, path: Path, what: str) -> None:
        try:
            path.unlink(missing_ok=True)
        except OSError as exc:
            warnings.warn(f"{self.name}: cannot remove {what} {path} ({exc})", RuntimeWarning, stacklevel=3)

    def _fsync_dir(self, directory: Path) -> None:
        try:
            fd = os.open(directory, os.O_RDONLY)
        except OSError as exc:
            warnings.warn(f"{self.name}: cannot open {directory} to fsync it ({exc})", RuntimeWarning, stacklevel=3)
            return
        try:
            os.fsync(fd)
        except OSError as exc:
            warnings.warn(f"{self.name}: fsync of {directory} failed ({exc})", RuntimeWarning, stacklevel=3)
        finally:
            os.close(fd)
