"""Cache stats of one framework query: the sum over every LLM call the query made.

Owns ``QueryStats``, the per-query aggregate that the LlamaIndex integration puts on a query
engine's ``Response.metadata["cachedrag"]`` (a query may call the LLM several times: refine,
tree-summarize, sub-questions). It is filled in place, so a streaming response's stats appear
once its stream is consumed. Framework-free and torch-free; the LlamaIndex span handler that
decides which query a call belongs to lives in ``llama_index``.
"""

from __future__ import annotations

import threading

COUNTERS = ("prompt_tokens", "cached_tokens", "computed_tokens", "recomputed_tokens", "checked_tokens",
            "fresh_tokens", "chunks_hit", "chunks_missed", "registered_chunks", "registered_chunks_cached",
            "registered_chunks_computed")


class QueryStats:
    """``summary``: ``llm_calls``, the token and chunk counters summed over the calls,
    ``cached_fraction`` (cached / prompt tokens), ``ttft_s`` of the first call, ``llm_s`` (time spent
    in the LLM) and ``calls`` (each call's full stats, in order)."""

    def __init__(self):
        self._lock = threading.Lock()
        self.summary: dict = {"llm_calls": 0, **{name: 0 for name in COUNTERS}, "cached_fraction": 0.0,
                              "ttft_s": None, "llm_s": 0.0, "calls": []}

    def add(self, stats: dict) -> None:
        """Count one LLM call's stats (``Answer.stats()``)."""
        with self._lock:
            s = self.summary
            s["llm_calls"] += 1
            for name in COUNTERS:
                s[name] += int(stats.get(name) or 0)
            s["cached_fraction"] = s["cached_tokens"] / s["prompt_tokens"] if s["prompt_tokens"] else 0.0
            if s["ttft_s"] is None:
                s["ttft_s"] = stats.get("ttft_s")
            s["llm_s"] += float(stats.get("total_s") or 0.0)
            s["calls"].append(stats)
