"""Helpers of the store tests: tiny deterministic entries, keys, on-disk size."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import torch

from cachedrag.store.entry import KVEntry

NS = "testns0123"


def key_of(i: int | str) -> str:
    """A sha256 hex key, as the engine makes them."""
    return hashlib.sha256(str(i).encode()).hexdigest()


def make_entry(
    seed: int,
    *,
    layers: int = 4,
    heads: int = 2,
    tokens: int = 8,
    dim: int = 4,
    dtype: torch.dtype = torch.float32,
    namespace: str = NS,
    extras: bool = True,
) -> KVEntry:
    """A deterministic entry: the same seed always gives the same tensors."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(layers, heads, tokens, dim, generator=g).to(dtype)  # [L, H_kv, T, D]
    v = torch.randn(layers, heads, tokens, dim, generator=g).to(dtype)  # [L, H_kv, T, D]
    tensors = {"k": k, "v": v}
    if extras:
        tensors["token_inter"] = torch.rand(tokens, generator=g)  # [T]
    return KVEntry(tensors, {"namespace": namespace, "seed": str(seed)})


def disk_bytes_on_disk(directory: Path) -> tuple[int, int]:
    """(sum of st_blocks * 512, number of files) of every file under ``directory``.

    A file listed and then renamed or removed before its ``stat`` (a writer's temp file being
    committed, an evicted entry) is skipped: it is no longer on the disk."""
    total = files = 0
    for root, _dirs, names in os.walk(directory):
        for name in names:
            try:
                st = os.stat(os.path.join(root, name))
            except FileNotFoundError:
                continue
            total += st.st_blocks * 512
            files += 1
    return total, files


