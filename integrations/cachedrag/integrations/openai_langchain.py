"""LangChain chat model for a remote ``cachedrag serve``: ``ChatOpenAI`` that sends the retrieved chunks.

Owns: ``ChatCachedRAGOpenAI``, LangChain's ``ChatOpenAI`` (``langchain-openai``) with defaults for
a local ``cachedrag serve`` and ``httpx`` clients (``openai_transport``) that attach the chunks
cachedrag's ``CachedRAGRetriever`` registered as the request's ``cachedrag.chunks`` field. Chains,
streaming, async and callbacks are ``ChatOpenAI``'s own.

Does not own: the server, chunk registration (``cachedrag.prompt.registry``), in-process generation (``langchain``).
"""

from __future__ import annotations

from typing import Any

from langchain_openai import ChatOpenAI

from cachedrag.integrations.openai_transport import chunk_async_http_client, chunk_http_client
from cachedrag.prompt.registry import ChunkRegistry


class ChatCachedRAGOpenAI(ChatOpenAI):
    """``ChatOpenAI`` for ``cachedrag serve`` that attaches registered chunks to each request.

    >>> from cachedrag.integrations.openai_langchain import ChatCachedRAGOpenAI
    >>> llm = ChatCachedRAGOpenAI(base_url="http://127.0.0.1:8000/v1")  # doctest: +SKIP
    >>> (prompt | llm).invoke({"context": docs, "question": "..."})      # doctest: +SKIP
    """

    def __init__(self, *, chunk_registry: ChunkRegistry | None = None, **kwargs: Any):
        kwargs.setdefault("model", "SmolLM2-135M-Instruct")
        kwargs.setdefault("base_url", "http://127.0.0.1:8000/v1")
        kwargs.setdefault("api_key", "none")
        kwargs.setdefault("http_client", chunk_http_client(chunk_registry))
        kwargs.setdefault("http_async_client", chunk_async_http_client(chunk_registry))
        super().__init__(**kwargs)
