"""The disk tier's directory: its layout, what in it is ours, and the file operations that keep
to both.

Owns: entry and temp file names (``entry_path``, ``temp_name``), the walk of the directory at
start (``scan``), opening an entry without following a symlink or blocking on a FIFO
(``open_regular``), shard directories and temp files that are never written through something
else (``shard_dir``, ``open_temp``, ``check_target``), positional reads (``reader``), a
directory's fsync and the exclusive ``flock`` that makes one tier the directory's owner
(``lock_directory``). Does not own: the index, the byte budget or the handling of bad files
(``disk``).

Layout: ``<dir>/<key[:2]>/<key>.safetensors`` (256 shard directories at most, created on
demand). Writes go to ``<dir>/<key[:2]>/.<key>.cachedrag-<pid>-<random>.tmp`` in the same
shard, are flushed and fsynced, then ``os.replace``d over the final name: a reader sees the
old file, the new file or nothing, never a partial one. Temp files left by a crash (that name
pattern only) are deleted at start.

What is ours: only regular files with our names in real (not symlinked) two-hex-character
shard directories. Anything else (foreign names, foreign ``*.tmp``, symlinks, FIFOs, devices,
whatever sits behind a symlinked shard) is never opened, charged or deleted. Files are opened
with ``O_NOFOLLOW | O_NONBLOCK`` and checked to be regular before any read, and their size is
checked before reading: a file larger than what it was charged (or than the budget) is never
read into memory. A regular file at an entry's path that fails its checks is treated as a
damaged entry of ours: counted, removed, a miss.
"""

from __future__ import annotations

import errno
import fcntl
import os
import re
import secrets
import stat
import warnings
from pathlib import Path

from cachedrag.errors import DirectoryInUseError
from cachedrag.store.base import check_key

SUFFIX = ".safetensors"
TMP_SUFFIX = ".tmp"
SHARD = re.compile(r"[0-9a-f]{2}")
TEMP = re.compile(r"\.([0-9a-f]{2,128})\.cachedrag-[0-9]+-[0-9a-f]{16}\.tmp")
READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK


class NotOurFileError(OSError):
    """The path of an entry holds something we did not write (symlink, FIFO, directory)."""


def entry_path(directory: Path, key: str) -> Path:
    """Where ``key``'s file lives: ``<directory>/<key[:2]>/<key>.safetensors``."""
    return directory / key[:2] / (key + SUFFIX)


def temp_name(key: str) -> str:
    """A fresh temp file name for a write of ``key`` (a pattern no one else would use)."""
    return f".{key}.cachedrag-{os.getpid()}-{secrets.token_hex(8)}{TMP_SUFFIX}"


def lock_directory(directory: Path) -> int:
    """An exclusive ``flock`` on ``directory`` itself (no lock file to leave behind or to charge);
    returns the descriptor holding it (closing it releases the lock), else ``DirectoryInUseError``."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        os.close(fd)
        if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            raise
        raise DirectoryInUseError(
            f"{directory} is in use by another disk tier (another process, or an open store in this "
            "one): one owner per cache directory, whose budget it accounts; close the other store, give "
            "each process its own directory, or share caches through the Redis tier"
        ) from None
    return fd


def scan(directory: Path) -> tuple[list[Path], list[tuple[str, os.stat_result]]]:
    """Our files in ``directory``: temp files crashed writes left (``temp_name``'s pattern, in their
    key's shard), and each entry file's key and ``lstat``. Only regular files with our names in real
    shard directories count; anything else is not looked at."""
    temps: list[Path] = []
    files: list[tuple[str, os.stat_result]] = []
    with os.scandir(directory) as top:
        shards = sorted((e for e in top if SHARD.fullmatch(e.name) and e.is_dir(follow_symlinks=False)),
                        key=lambda e: e.name)
    for shard in shards:
        with os.scandir(shard.path) as it:
            entries = list(it)
        for f in entries:
            if not f.is_file(follow_symlinks=False):
                continue  # symlinks, FIFOs, sockets, devices, directories: not ours
            temp = TEMP.fullmatch(f.name)
            if temp is not None:
                if temp.group(1)[:2] == shard.name:
                    temps.append(Path(f.path))
                continue
            key = f.name[: -len(SUFFIX)] if f.name.endswith(SUFFIX) else ""
            try:
                check_key(key)
            except ValueError:
                continue  # not ours: leave it alone, not charged
            if key[:2] == shard.name:
                files.append((key, f.stat(follow_symlinks=False)))
    return temps, files


def open_regular(path: Path) -> int:
    """A read-only descriptor of ``path``: never follows a symlink, never blocks on a FIFO, and
    refuses anything but a regular file (``NotOurFileError``)."""
    fd = os.open(path, READ_FLAGS)
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise NotOurFileError(errno.EINVAL, f"{path} is not a regular file; left alone")
    return fd


def shard_dir(directory: Path, key: str) -> Path:
    """``key``'s shard directory, created if missing; ``NotOurFileError`` if something else (a
    symlink to elsewhere, a file) sits at its name: we never write through it."""
    shard = directory / key[:2]
    try:
        shard.mkdir()
    except FileExistsError:
        pass
    if not stat.S_ISDIR(os.lstat(shard).st_mode):
        raise NotOurFileError(errno.ENOTDIR, f"{shard} is not a real directory; not written through")
    return shard


def open_temp(tmp: Path) -> int:
    """Create the temp file (exclusively: never an existing file, never through a symlink)."""
    return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)


def check_target(path: Path) -> None:
    """Before a rename over ``path``: it is ours to replace (absent or a regular file), never a
    symlink, FIFO or directory someone put there."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISREG(st.st_mode):
        raise NotOurFileError(errno.EEXIST, f"{path} is not a regular file; not replaced")


def fsync_dir(directory: Path, owner: str) -> None:
    """fsync ``directory`` (a rename in it is durable then); a failure warns, naming ``owner``."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError as exc:
        warnings.warn(f"{owner}: cannot open {directory} to fsync it ({exc})", RuntimeWarning, stacklevel=3)
        return
    try:
        os.fsync(fd)
    except OSError as exc:
        warnings.warn(f"{owner}: fsync of {directory} failed ({exc})", RuntimeWarning, stacklevel=3)
    finally:
        os.close(fd)


def reader(fd: int):
    """``read_at(offset, length)`` over ``fd`` (short only at end of file)."""

    def read_at(offset: int, length: int) -> bytes:
        parts = []
        while length > 0:
            got = os.pread(fd, min(length, 1 << 30), offset)
            if not got:
                break
            parts.append(got)
            offset += len(got)
            length -= len(got)
        return b"".join(parts)

    return read_at
