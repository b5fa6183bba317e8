"""The disk tier: one safetensors file per entry in a local (SSD) directory.

Owns: atomic writes, the byte budget in real allocated bytes, the index rebuilt at start
(caches survive restarts), holding the directory lock, and disk-error handling (bad files,
failed writes). Does not own: the directory's layout, what in it is ours and the file
operations that keep to both (``disk_files``), the byte format (``codec``) or cross-tier
placement.

Budget: each file is charged ``max(size rounded up to the filesystem block, st_blocks *
512)`` — what it occupies. Room (and the bytes of the temp file being written) is reserved
before writing, so the files in the directory never exceed ``budget_bytes`` at any moment,
temp files included. Not counted: the shard directories' own inodes (at most 256) and the blocks of a file removed while another thread still reads it.

Validation at start (``validate``): ``"lazy"`` stats files only (every get still verifies
the full checksum; a file larger than the budget has its header checked anyway);
``"header"`` (default) also reads each header — namespace, key, format, length — removing
foreign and truncated files before they take budget; ``"full"`` decodes and verifies every
file. Bad files found at any time are counted (``corrupt`` / ``foreign``), removed and
served as misses.

Errors: an ``OSError`` on write (disk full, read-only directory) skips the write with a
``RuntimeWarning``, counts ``skipped_writes`` and leaves the tier serving.

One owner per directory: the index and the byte accounting live in this object, so a
second ``DiskTier`` on the same directory (another process, or another object in this one)
would overrun the budget. The constructor takes an exclusive ``flock`` on the
directory itself and raises ``DirectoryInUseError`` when it is taken; ``close()`` (or
garbage collection) releases it. Share caches across processes and machines with the
Redis tier. ``flock`` needs a local filesystem (it is advisory and not reliable on NFS).
"""

from __future__ import annotations

import errno
import logging
import os
import stat
import time
import warnings
from collections import OrderedDict
from pathlib import Path
from typing import Literal

import torch

from cachedrag.errors import CorruptCacheError
from cachedrag.store.base import EntryInfo, HeaderTier, Prepared, check_key
from cachedrag.store.codec import (
    ForeignEntryError,
    FormatError,
    check_namespace,
    decode,
    decode_extras,
    encode,
    read_header,
)
from cachedrag.store.disk_files import (
    NotOurFileError,
    check_target,
    entry_path,
    fsync_dir,
    lock_directory,
    open_regular,
    open_temp,
    reader,
    scan,
    shard_dir,
    temp_name,
)
from cachedrag.store.entry import KVEntry
from cachedrag.store.source import BlobSource, LayerSource


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
        self._lock_fd: int | None = None
        self._lock_fd = lock_directory(self.directory)
        try:
            self._rebuild()
        except BaseException:
            self.close()
            raise

    # ---- the directory lock ---------------------------------------------------------------
    def close(self) -> None:
        """Release the directory (another ``DiskTier`` may open it afterwards)."""
        with self._lock:
            fd, self._lock_fd = self._lock_fd, None
        if fd is not None:
            os.close(fd)  # closing the descriptor drops the flock

    def __del__(self) -> None:
        fd = getattr(self, "_lock_fd", None)
        if fd is not None:
            os.close(fd)

    # ---- paths and sizes -----------------------------------------------------------------
    def path(self, key: str) -> Path:
        return entry_path(self.directory, key)

    def _alloc(self, nbytes: int) -> int:
        return -(-nbytes // self._block) * self._block

    def _charge(self, st: os.stat_result) -> int:
        return max(self._alloc(st.st_size), st.st_blocks * 512)

    @property
    def used_bytes(self) -> int:
        with self._lock:
            return self._used + self._reserved

    def allocated_bytes(self) -> int:
        """What the directory's files really take on disk (``st_blocks``), counted under the tier's
        lock: a snapshot no write or eviction of this tier lands in the middle of (a walk without
        it can count an entry evicted from one shard and its successor in a later shard)."""
        total = 0
        with self._lock:
            for root, _dirs, names in os.walk(self.directory):
                for name in names:
                    try:
                        total += os.lstat(os.path.join(root, name)).st_blocks * 512
                    except FileNotFoundError:  # a foreign file removed meanwhile
                        continue
        return total

    # ---- start-up ------------------------------------------------------------------------
    def _rebuild(self) -> None:
        """Index the directory: drop our temp files, charge real sizes, validate per ``validate``.
        Only regular files with our names in real shard directories are looked at."""
        temps, files = scan(self.directory)
        for tmp in temps:
            self._unlink_quiet(tmp, "leftover temp file")
            self.stats.temp_cleaned += 1
        found = sorted((st.st_mtime_ns, key, self._charge(st), st.st_ino) for key, st in files)
        for _, key, charge, ino in found:
            if charge > self._budget:  # never written at this budget: ours only if its header proves it
                if not self._valid_at_start(key, ino, "header", discard=False):
                    warnings.warn(f"{self.name}: {self.path(key)} is larger than the budget and not a valid "
                                  "entry; not ours, left alone", RuntimeWarning, stacklevel=3)
                    continue
            elif self.validate != "lazy" and not self._valid_at_start(key, ino, self.validate):
                continue
            self._index[key] = charge
            self._used += charge
        for key in list(self._index):  # budget shrank since last run: oldest first
            if self._used <= self._budget:
                break
            self._evict_oldest(key)

    def _valid_at_start(self, key: str, ino: int, check: str, *, discard: bool = True) -> bool:
        try:
            fd = open_regular(self.path(key))
            try:
                size = os.fstat(fd).st_size
                read_at = reader(fd)
                header = read_header(read_at, size, key, self.namespace)
                if check == "full":
                    decode(read_at(0, header.total_size), key, self.namespace)
            finally:
                os.close(fd)
        except CorruptCacheError as exc:
            if discard:
                self._discard_bad(key, ino, exc)
            return False
        except OSError as exc:
            warnings.warn(f"{self.name}: cannot read {self.path(key)} at start ({exc}); not indexed", RuntimeWarning, stacklevel=3)
            return False
        return True

    def _not_ours(self, key: str, exc: OSError) -> None:
        """The entry's path holds something we did not write (a symlink gives ELOOP): uncharge
        ``key`` (our file is gone) and leave the thing alone."""
        warnings.warn(f"{self.name}: {self.path(key)} is not a regular file we wrote ({exc}); "
                      "served as a miss, left alone", RuntimeWarning, stacklevel=4)
        with self._lock:
            self._used -= self._index.pop(key, 0)

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
        try:
            fd = self._open_fd(key)
        except OSError as exc:
            warnings.warn(f"{self.name}: read of {key} failed ({exc}); served as a miss", RuntimeWarning, stacklevel=3)
            return None
        if fd is None:
            return None
        try:
            st = os.fstat(fd)
            if not self._size_ok(key, st):
                return None
            blob = reader(fd)(0, st.st_size)
            entry = decode(blob, key, self.namespace)
        except CorruptCacheError as exc:
            self._discard_bad(key, st.st_ino, exc)
            return None
        except OSError as exc:
            warnings.warn(f"{self.name}: read of {key} failed ({exc}); served as a miss", RuntimeWarning, stacklevel=3)
            return None
        finally:
            os.close(fd)
        with self._lock:
            if key in self._index:
                self._index.move_to_end(key)
        return entry

    def _size_ok(self, key: str, st: os.stat_result) -> bool:
        """Before reading a file: it must not take more than it was charged, so a file grown
        behind our back (a huge sparse file) is never read into memory. A bigger file that our
        own concurrent write just renamed over the path is a race, not damage: a miss."""
        with self._lock:
            charged = self._index.get(key, 0)
            if self._charge(st) <= charged:
                return True
            extra = self._charge(st) - charged
            if key in self._index and self._alloc(st.st_size) <= charged and self._reserve(extra, key):
                # its bytes are what we wrote, but the filesystem mapped more blocks after the write
                # (delayed allocation adds extent blocks at writeback: 4 KB on a 64 MB entry, seen on
                # an H100 VM): charged now, room made as for a write, and read as the entry it is
                self._reserved -= extra
                self._used += extra
                self._index[key] = charged + extra
                return True
            try:
                replaced = os.lstat(self.path(key)).st_ino != st.st_ino
            except FileNotFoundError:
                replaced = True
        if not replaced:
            exc = FormatError(f"file of {st.st_size} bytes takes {self._charge(st)}, more than the {charged} charged")
            self._discard_bad(key, st.st_ino, exc)
        return False

    def _open_fd(self, key: str) -> int | None:
        """A read-only descriptor of ``key``'s regular file, or None when the index or the disk
        lacks it (a file gone behind our back is forgotten; a symlink, FIFO or other non-regular
        file in its place is left alone and the key uncharged). Other OS errors propagate."""
        if not self.contains(key):
            return None
        try:
            return open_regular(self.path(key))
        except FileNotFoundError:
            self._forget(key)
            return None
        except NotOurFileError as exc:
            self._not_ours(key, exc)
            return None
        except OSError as exc:
            if exc.errno == errno.ELOOP:  # O_NOFOLLOW met a symlink
                self._not_ours(key, exc)
                return None
            raise

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
            read_at = reader(fd)
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
        try:
            fd = self._open_fd(key)
        except OSError as exc:
            warnings.warn(f"{self.name}: open of {key} failed ({exc}); served as a miss", RuntimeWarning, stacklevel=2)
            return None
        if fd is None:
            return None
        st = os.fstat(fd)
        read_at = reader(fd)
        if not self._size_ok(key, st):
            os.close(fd)
            return None
        try:
            header = read_header(read_at, st.st_size, key, self.namespace)
        except CorruptCacheError as exc:
            os.close(fd)
            self._discard_bad(key, st.st_ino, exc)
            return None
        except OSError as exc:
            os.close(fd)
            warnings.warn(f"{self.name}: header read of {key} failed ({exc}); served as a miss", RuntimeWarning, stacklevel=2)
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
        tmp: Path | None = None
        try:
            shard = shard_dir(self.directory, key)
            tmp = shard / temp_name(key)
            fd = self._open_temp(tmp)
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
                check_target(self.path(key))
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
                fsync_dir(shard, self.name)
            return True
        except OSError as exc:
            warnings.warn(f"{self.name}: write of {key} skipped ({exc}); serving continues", RuntimeWarning, stacklevel=3)
            with self._lock:
                self.stats.skipped_writes += 1
                self._reserved -= reserve
            if tmp is not None:
                self._unlink_quiet(tmp, "temp file of a failed write")
            return False

    def _open_temp(self, tmp: Path) -> int:
        """Create the temp file of a write (a seam: fault tests make it fail)."""
        return open_temp(tmp)

    def _reserve(self, nbytes: int, key: str) -> bool:
        """Under the lock: make ``nbytes`` free (LRU self-eviction if allowed) and reserve them."""
        if nbytes > self._budget:
            return False
        while self._used + self._reserved + nbytes > self._budget:
            victim = next((k for k in self._index if k != key), None)
            if victim is None or not self.self_evict:
                return False
            if not self._evict_oldest(victim):
                return False
        self._reserved += nbytes
        return True

    def _evict_oldest(self, key: str | None = None) -> bool:
        key = key if key is not None else next(iter(self._index))
        if self._delete(key):
            self.stats.evictions += 1
            return True
        if key in self._index:  # undeletable (read-only disk): move it last so others can go
            self._index.move_to_end(key)
        return False

    def remove(self, key: str) -> bool:
        """Delete ``key``'s file; ``False`` when it was not here or could not be deleted (then it
        stays indexed and charged, with a ``RuntimeWarning``)."""
        with self._lock:
            if key not in self._index:
                return False
            ok = self._delete(key)
            if ok:
                self.stats.removes += 1
            return ok

    def _delete(self, key: str) -> bool:
        """Under the lock: unlink ``key``'s file and uncharge it (kept charged if unlink fails).
        Something other than a regular file at its path is not ours: left alone, uncharged."""
        path = self.path(key)
        try:
            if not stat.S_ISREG(os.lstat(path).st_mode):
                self._used -= self._index.pop(key, 0)
                return True
            self._unlink(path)
        except FileNotFoundError:
            pass
        except OSError as exc:
            warnings.warn(f"{self.name}: cannot delete {key} ({exc}); still charged", RuntimeWarning, stacklevel=4)
            return False
        self._used -= self._index.pop(key, 0)
        return True

    def _unlink(self, path: Path) -> None:
        """The one place entry files are deleted (a seam for fault injection: read-only disks)."""
        os.unlink(path)

    def _forget(self, key: str) -> None:
        """A read found no file: uncharge ``key`` unless a write put it back meanwhile."""
        with self._lock:
            if key in self._index and not os.path.lexists(self.path(key)):
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
                same = os.lstat(self.path(key)).st_ino == ino
            except FileNotFoundError:
                same = False
                self._used -= self._index.pop(key, 0)
            if same:
                if key in self._index:
                    self._delete(key)
                else:  # found bad at start, before it was indexed
                    try:
                        self._unlink(self.path(key))
                    except OSError as err:
                        warnings.warn(f"{self.name}: cannot remove bad file {self.path(key)} ({err})",
                                      RuntimeWarning, stacklevel=3)

    def _unlink_quiet(self, path: Path, what: str) -> None:
        try:
            path.unlink(missing_ok=True)
        except OSError as exc:
            warnings.warn(f"{self.name}: cannot remove {what} {path} ({exc})", RuntimeWarning, stacklevel=3)
