"""Giving the C heap's freed memory back to the operating system.

Owns: ``trim_heap()``, glibc's ``malloc_trim(0)`` through ctypes, with the resident memory it
released; ``resident_bytes()``, this process's RSS.

Why: torch allocates CPU tensors with the C allocator, and glibc serves every block below its
*dynamic* mmap threshold from the heap. The threshold starts at 128 KiB and rises to the size
of each large block freed (up to 32 MiB on 64-bit), so after the first few requests a
server's KV buffers (a default-model request in bfloat16: ~20 MB) come from the heap, and
glibc keeps freed heap pages mapped. A server's RSS then stays at its busiest moment's peak:
16 buffers of a burst, freed, still held 545 MB in a plain loop (``tests/test_heap.py`` keeps a
smaller case); ``malloc_trim(0)`` returned all of it in ~40 ms. Fixing the threshold instead
(``mallopt(M_MMAP_THRESHOLD)``) would return each buffer at once but make every new one fault in
fresh pages, under load, where the engine loop cannot spare it; a trim when the loop has been
idle a while (``SchedulerConfig.trim_heap_idle_s``) costs nothing under load. No library wraps
this (``psutil`` reads memory, it does not release it), hence the few lines here.

Where the C library has no ``malloc_trim`` (musl, macOS), ``trim_heap`` does nothing and says so.

Does not own: when to trim (``cachedrag.server.loop``).
"""

from __future__ import annotations

import ctypes
import resource

_PAGE = resource.getpagesize()


def _malloc_trim():
    try:
        fn = ctypes.CDLL(None).malloc_trim  # the process's own symbols: glibc's when it is the C library
    except (AttributeError, OSError):
        return None
    fn.argtypes = [ctypes.c_size_t]
    fn.restype = ctypes.c_int
    return fn


_TRIM = _malloc_trim()


def resident_bytes() -> int | None:
    """This process's resident set size (Linux ``/proc/self/statm``), or None elsewhere."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        return None


def trim_heap() -> int | None:
    """Return the heap's free pages to the OS; returns the resident bytes released (0 when
    nothing was), or None where the C library cannot trim. Thread-safe (glibc locks each arena)."""
    if _TRIM is None:
        return None
    before = resident_bytes()
    _TRIM(0)
    after = resident_bytes()
    return max(0, before - after) if before is not None and after is not None else 0
