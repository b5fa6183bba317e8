"""The GPU tier: entries resident in CUDA memory, the fastest place to serve from.

Owns: ``GPUTier`` — a ``MemoryTier`` on a CUDA device with a clear error when CUDA is
missing. Budgets count tensor bytes; the CUDA caching allocator's own slack is not counted.
"""

from __future__ import annotations

import torch

from cachedrag.errors import ConfigError
from cachedrag.store.cpu import MemoryTier


class GPUTier(MemoryTier):
    """Entries on ``device`` (default ``cuda``). Raises ``ConfigError`` without CUDA."""

    def __init__(
        self,
        budget_bytes: int,
        *,
        namespace: str,
        device: str = "cuda",
        self_evict: bool = True,
        name: str = "gpu",
    ) -> None:
        if not torch.cuda.is_available():
            raise ConfigError(
                "GPUTier needs CUDA, and torch.cuda.is_available() is False on this machine; "
                "set gpu_bytes=0 (no GPU tier) or run on a CUDA machine"
            )
        dev = torch.device(device)
        if dev.type != "cuda":
            raise ConfigError(f"GPUTier device must be a CUDA device, got {device!r}")
        super().__init__(budget_bytes, namespace=namespace, device=dev, name=name, self_evict=self_evict)
