"""Scale-out: cachedrag replicas as a Ray Serve deployment with chunk-affinity routing.

    affinity      torch-free routing policy (rendezvous hashing with bounded load)
    fingerprints  chunk fingerprints of OpenAI request bodies (what the router hashes)

Names import lazily: the policy needs neither torch nor Ray.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "AffinityConfig": "affinity",
    "AffinityPolicy": "affinity",
    "request_fingerprints": "fingerprints",
    "Fingerprints": "fingerprints",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'cachedrag.cluster' has no attribute {name!r}")
    return getattr(importlib.import_module(f"cachedrag.cluster.{_EXPORTS[name]}"), name)
