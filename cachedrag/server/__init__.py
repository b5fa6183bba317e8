"""``cachedrag serve``: an OpenAI-compatible server with continuous batching over one chunk cache.

    config     ServerConfig, SchedulerConfig, PassageConfig (validated settings)
    protocol   OpenAI request/response bodies and the error shape
    structured response_format JSON and tool calls (tool_choice, parallel_tool_calls) as grammars
    stream     one answer's n choices (text, logprobs, tool calls) as OpenAI bodies and SSE chunks
    embeddings /v1/embeddings with the index's embedder
    policy     torch-free admission order: FIFO, or cache-aware within FIFO-forecast deadlines
    batch      one batched decode forward over several requests' KV buffers
    loop       the engine thread: prefill through the engine's seam, batched decode, events
    metrics    Prometheus metrics
    app        the FastAPI app (routes, SSE, disconnects)
    cli        ``cachedrag serve`` (uvicorn)

Names import lazily: the policy and config need neither torch nor FastAPI. Request text becomes
engine segments in ``cachedrag.prompt.planning``.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "create_app": "app",
    "EngineLoop": "loop",
    "ServeRequest": "loop",
    "SchedulerPolicy": "policy",
    "ServerConfig": "config",
    "SchedulerConfig": "config",
    "PassageConfig": "config",
    "batched_decode_step": "batch",
    "build_engine": "cli",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'cachedrag.server' has no attribute {name!r}")
    return getattr(importlib.import_module(f"cachedrag.server.{_EXPORTS[name]}"), name)
