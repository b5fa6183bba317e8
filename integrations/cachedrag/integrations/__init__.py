"""Framework integrations: LlamaIndex and LangChain classes over one shared chunk cache.

Owns the adapters users meet (one file per framework) and the helpers they share:

    llama_index  CachedRAGLLM, CachedRAGRetriever, CachedRAGNodePostprocessor
    langchain    ChatCachedRAG, CachedRAGRetriever
    engines      process-wide engine registry: one CachedEngine (one cache) per model
    generator    chunk-aware generation (blocking, streaming, timeout) and token usage
    search       index-directory search with lookahead prefetch, registering what it returns
    worker       blocking work on worker threads for the async methods
    openai_llama_index, openai_langchain   clients of a remote ``cachedrag serve`` (OpenAILike,
                 ChatOpenAI) that send the registered chunks as ``cachedrag.chunks``
    openai_transport  the httpx transports that attach them

Does not own: the engine, caches or retrieval (``cachedrag``'s core), nor prompt text:
rendering chat messages, the chunk registry and splitting a prompt around its chunks live in
``cachedrag.prompt`` (``ChunkRegistry``, ``ChunkRegistryConfig``, ``chunk_registry``,
``register_chunks`` and ``split_prompt`` are re-exported here, where framework users look for
them). Names below import lazily, so ``import cachedrag.integrations`` needs neither framework
installed; the two retrievers share a class name, so import them from their framework module.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "CachedRAGLLM": "llama_index",
    "CachedRAGNodePostprocessor": "llama_index",
    "ChatCachedRAG": "langchain",
    "CachedRAGOpenAILike": "openai_llama_index",
    "ChatCachedRAGOpenAI": "openai_langchain",
    "ChunkRegistry": "cachedrag.prompt.registry",
    "ChunkRegistryConfig": "cachedrag.prompt.registry",
    "chunk_registry": "cachedrag.prompt.registry",
    "register_chunks": "cachedrag.prompt.registry",
    "shared_engine": "engines",
    "register_engine": "engines",
    "split_prompt": "cachedrag.prompt.splitter",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'cachedrag.integrations' has no attribute {name!r}")
    module = _EXPORTS[name]
    if "." not in module:
        module = f"cachedrag.integrations.{module}"
    return getattr(importlib.import_module(module), name)
