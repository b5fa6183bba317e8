"""``/v1/embeddings``: the server's embedder behind OpenAI's embeddings API.

Owns: the route (``router``) and ``EmbeddingService``, which holds the embedder a server embeds with (given to
``create_app``, or the embedder of the index named by ``ServerConfig.index``, loaded on the first
embeddings request) and runs it on a transient worker thread (``TransientThreadExecutor``: the
embedder runs torch ops, which must stay off the event loop thread, and a worker that lives on
after them would keep an idle OpenMP team that slows the engine loop's decoding). A server with
neither answers 404 in the OpenAI error shape. An embedder is any object with ``encode(texts) ->
float32 [N, d]``, ``name`` and ``dim`` (``cachedrag.retrieval.embedder.Embedder``); with
``count_tokens(texts)`` the usage counts its tokens, else it is 0.

Does not own: the embedder (``cachedrag.retrieval``), the wire shapes (``protocol``).
"""

from __future__ import annotations

import asyncio
import threading

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from cachedrag.executor import TransientThreadExecutor
from cachedrag.server import protocol as P


def router(service: EmbeddingService) -> APIRouter:
    """``POST /v1/embeddings`` over ``service``."""
    routes = APIRouter()

    @routes.post("/v1/embeddings")
    async def embed(body: P.EmbeddingRequest):
        return JSONResponse(await service.embed(body))

    return routes


class EmbeddingService:
    def __init__(self, embedder=None, index: str | None = None):
        self._embedder, self._index = embedder, index
        self._lock = threading.Lock()
        self._executor = TransientThreadExecutor(1, thread_name_prefix="cachedrag-embed")

    @property
    def available(self) -> bool:
        return self._embedder is not None or self._index is not None

    def names(self) -> set[str]:
        """The ``model`` values a request may name: the embedder's name, its last path part, ``default``."""
        names = {"default"}
        if self._embedder is not None:
            names |= {self._embedder.name, self._embedder.name.rsplit("/", 1)[-1]}
        return names

    async def embed(self, body: P.EmbeddingRequest) -> dict:
        """The response body of ``body`` (``APIError`` 404 without an embedder, 400 for a bad request)."""
        if not self.available:
            raise P.APIError(404, "this server has no embedder: start it with an index (ServerConfig.index) or "
                                  "pass one to create_app(embedder=...) to serve /v1/embeddings",
                             param="model", code="model_not_found")
        embedder = await asyncio.wrap_future(self._executor.submit(self._load))
        if body.model not in self.names():
            raise P.APIError(404, f"the embedding model {body.model!r} does not exist; this server embeds with "
                                  f"{embedder.name!r}", param="model", code="model_not_found")
        if body.dimensions is not None and body.dimensions != embedder.dim:
            raise P.APIError(400, f"dimensions={body.dimensions}: the embedder {embedder.name!r} gives "
                                  f"{embedder.dim}-dimensional vectors", param="dimensions")
        vectors, tokens = await asyncio.wrap_future(self._executor.submit(_encode, embedder, body.texts))
        return P.embeddings_response(body.model, vectors, tokens, body.encoding_format)

    def _load(self):
        with self._lock:
            if self._embedder is None:
                from cachedrag.retrieval.index import load_index

                self._embedder = load_index(self._index, verify=False).embedder
            return self._embedder


def _encode(embedder, texts: list[str]):
    count = getattr(embedder, "count_tokens", None)
    return embedder.encode(texts), int(count(texts)) if count is not None else 0  # [N, d]
