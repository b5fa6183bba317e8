"""cachedrag: fast retrieval-augmented generation by reusing chunk KV caches.

Owns: the package's public surface. Heavy modules (torch, transformers) load lazily, so
``import cachedrag`` stays cheap; import the submodules for the full API.
"""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["__version__"]
