"""``cachedrag.heap``: freed heap memory goes back to the OS on a trim."""

from __future__ import annotations

import pytest
import torch

from cachedrag.heap import resident_bytes, trim_heap

MB = 2**20


def _glibc() -> None:
    if trim_heap() is None or resident_bytes() is None:
        pytest.skip("the C library has no malloc_trim (not glibc) or no /proc")


def test_trim_returns_freed_buffers_between_live_ones():
    """A server's heap after a burst: large KV buffers freed between small allocations that live
    on. glibc keeps the freed pages mapped (it trims only a free top of the heap by itself);
    ``trim_heap`` gives them back and leaves the live ones alone."""
    _glibc()
    # glibc's dynamic mmap threshold rises to the size of a freed mmapped block: after this, 12 MB
    # blocks come from the heap (as a server's KV buffers do after its first requests)
    raise_threshold = torch.empty(16 * MB, dtype=torch.uint8).fill_(1)
    del raise_threshold
    burst, live = [], []
    for j in range(8):  # 96 MB touched, each buffer followed by one that stays
        burst.append(torch.empty(12 * MB, dtype=torch.uint8).fill_(1))
        live.append(torch.full((64 * 1024,), j, dtype=torch.uint8))
    with_burst = resident_bytes()
    del burst
    held = resident_bytes()  # blocks that came from mmap (earlier tests may have set the threshold) are gone already
    released = trim_heap()
    assert released is not None and released >= 48 * MB - (with_burst - held), (
        f"released {released / MB:.1f} MB of ~96 MB freed ({(with_burst - held) / MB:.1f} MB unmapped at free)")
    assert resident_bytes() <= with_burst - 48 * MB
    assert [int(t.sum()) for t in live] == [j * 64 * 1024 for j in range(8)]  # the live ones untouched


def test_a_second_trim_finds_little():
    _glibc()
    trim_heap()
    assert trim_heap() < 8 * MB
