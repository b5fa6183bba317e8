"""Where cachedrag keeps files on the local machine.

Owns: the cache root (converted default model, disk chunk caches, built indexes by default).
One override: the ``CACHEDRAG_HOME`` environment variable, else ``~/.cache/cachedrag``.
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_home() -> Path:
    """Root directory for cachedrag's local files (created on demand)."""
    root = os.environ.get("CACHEDRAG_HOME") or os.path.join(Path.home(), ".cache", "cachedrag")
    path = Path(root)
    path.mkdir(parents=True, exist_ok=True)
    return path
