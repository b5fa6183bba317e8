"""The chunk-cache engine: layout -> plan -> load -> select -> prefill -> decode -> hand-off.

    cached_engine  CachedEngine: the facade (generate, prefill, prefill_task, score ...) and the
                   order of the request path's stages
    layout         segments -> system / chunks / question, order-aware reuse, the plan request
    load           cached KV into the buffer, re-rotation, layer-wise loaders, the cost model
    selection      TokenScorer: question, inter, deviation, leading, and their fusion
    question       the question pre-pass (the question scorer's attention pass)
    precision      which rows run on the bfloat16 weight copies
    prefill        the layer loop over hooks, as a generator the caller advances (PrefillTask)
    exact          every exact fallback: exact repeats and promotion, the first-token and decode
                   tie guards (DecodeTieGuard), the exact continuation
    handoff        what a prefill computed fresh, captured and handed to the cache manager
    decoding       generate's decode tail (guard, hand-off after the first token, promotion, result)
    result         EngineResult, Prefilled, GenerationStream; a prefill's stats
    state          the typed state the stages pass along (internal)

Does not own: decisions (``cachedrag.kvcache``), storage tiers (``cachedrag.store``), prompt layout
(``cachedrag.prompt``), the model's forward pass and sampling (``cachedrag.model``).
"""

from cachedrag.engine.cached_engine import CachedEngine
from cachedrag.engine.exact import DecodeTieGuard, top2, top2_gap
from cachedrag.engine.handoff import entry_payload
from cachedrag.engine.prefill import PrefillTask
from cachedrag.engine.result import EngineResult, GenerationStream, Prefilled

__all__ = ["CachedEngine", "DecodeTieGuard", "EngineResult", "GenerationStream", "PrefillTask", "Prefilled",
           "entry_payload", "top2", "top2_gap"]
