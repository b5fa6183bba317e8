"""Native build artefacts cached on disk (AOTInductor packages, the native CPU kernels'
library): the digests that key and guard them.

Owns: ``file_sha256`` (the digest stored beside an artefact: one whose bytes changed is rebuilt,
never loaded), ``write_atomic`` (how such a digest is written: whole or not at all) and ``cpu_flags_digest`` (part of an artefact's key: its kernels are vectorised for
this CPU's instruction sets). Does not own: building, loading or where artefacts live
(``compiled.py``, ``native.py``, ``cachedrag.paths``).
"""

from __future__ import annotations

import hashlib
import os
import platform
import tempfile
from pathlib import Path


def file_sha256(path: Path) -> str:
    """The SHA-256 of the file's bytes (hex)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def cpu_flags_digest() -> str:
    """A digest of the CPU's instruction-set flags (``/proc/cpuinfo``), else the processor name."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return hashlib.sha256(line.encode()).hexdigest()[:16]
    except OSError:
        pass
    return platform.processor() or "unknown"


def write_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temp file in the same directory and a rename: a reader
    sees the old file or the whole new one, never a part."""
    fd, tmp = tempfile.mkstemp(suffix=".tmp", dir=path.parent)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)
