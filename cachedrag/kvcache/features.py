"""What a chunk-cache manager's store offers beyond the narrow tier interface.

Owns: ``StoreFeatures``, found once by duck typing (a ``TieredStore``, a bare tier, a test
fake): placement hints, header-only reads, shared keys, the drop log, held keys, and whether a
tier persists or is shared. Pure Python; never imports torch.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class StoreFeatures:
    """What the store offers beyond the narrow tier interface (duck-typed once)."""

    placement: bool  # put(..., priority=, parent=) and set_priority(key, p, parent=)
    info: bool  # info(key) / extras(key): header-only reads
    shared_keys: bool  # keys(shared=True)
    drops: bool  # drops_since(cursor)
    hold: bool  # hold(keys): entries to evict last
    persistent: bool  # some tier survives a restart (disk, Redis)
    shared: bool  # some tier is shared with other processes (Redis)

    @classmethod
    def of(cls, store: Any) -> StoreFeatures:
        tiers = list(getattr(store, "tiers", None) or [store])

        def takes(name: str, *params: str) -> bool:
            fn = getattr(store, name, None)
            if fn is None:
                return False
            try:
                sig = inspect.signature(fn).parameters
            except (TypeError, ValueError):
                return False
            return all(p in sig for p in params)

        return cls(
            placement=takes("put", "priority", "parent") and takes("set_priority", "parent"),
            info=callable(getattr(store, "info", None)) and callable(getattr(store, "extras", None)),
            shared_keys=takes("keys", "shared"),
            drops=callable(getattr(store, "drops_since", None)),
            hold=callable(getattr(store, "hold", None)),
            persistent=any(getattr(t, "persistent", False) for t in tiers),
            shared=any(getattr(t, "shared", False) for t in tiers),
        )
