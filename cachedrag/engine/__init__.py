"""The chunk-cache engine: plan -> load -> partial prefill -> decode -> store.

    cached_engine  CachedEngine: the facade (generate, prefill, score ...) and the request path
    result         EngineResult, Prefilled, GenerationStream: what a request returns
    state          the typed state one prefill passes between its stages (internal)
    selection      which rows a prefill computes: top-scored tokens, question + inter fusion
    exact          exact fallbacks while decoding (DecodeTieGuard) and the top-2 logit gap
    handoff        the payload of a new cache entry handed to the cache manager

Does not own: decisions (``cachedrag.kvcache``), storage tiers (``cachedrag.store``), prompt layout
(``cachedrag.prompt``), the model's forward pass and sampling (``cachedrag.model``).
"""

from cachedrag.engine.cached_engine import CachedEngine
from cachedrag.engine.exact import DecodeTieGuard, top2, top2_gap
from cachedrag.engine.handoff import entry_payload
from cachedrag.engine.result import EngineResult, GenerationStream, Prefilled

__all__ = ["CachedEngine", "DecodeTieGuard", "EngineResult", "GenerationStream", "Prefilled", "entry_payload",
           "top2", "top2_gap"]
