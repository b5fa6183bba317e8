"""HTTP transports that attach the retrieved chunks to OpenAI requests (``cachedrag.chunks``).

Owns: ``ChunkTransport`` / ``AsyncChunkTransport`` (``httpx`` transports wrapping the default
ones) and ``chunk_http_client`` / ``chunk_async_http_client``. Before a POST to
``.../chat/completions`` or ``.../completions`` leaves, the registered chunk texts found
verbatim in its messages (or prompt) are added as the request's ``"cachedrag": {"chunks":
[...]}`` field, the explicit chunk mode of ``cachedrag serve``. The chunks come from the
process-wide ``ChunkRegistry`` that cachedrag's retrievers and node postprocessor fill with
what they return, so the chunks of the current query are attached without touching the
framework's prompt code. A body that already has the field, or contains no registered chunk,
is sent unchanged.

Why a transport: the OpenAI SDK, LlamaIndex ``OpenAILike`` and LangChain ``ChatOpenAI`` all take
an ``httpx`` client, and this one place sees every request of all three (sync, async,
streaming) after the framework has built the final messages.

Does not own: the framework classes (``openai_llama_index``, ``openai_langchain``), finding
chunks (``chunks.ChunkRegistry``).
"""

from __future__ import annotations

import json

import httpx

from cachedrag.prompt.registry import ChunkRegistry, chunk_registry

_PATHS = ("/chat/completions", "/completions")


def attach_chunks(body: dict, registry: ChunkRegistry) -> bool:
    """Add ``body["cachedrag"]["chunks"]`` from the registered chunks in its text; True if added."""
    if "cachedrag" in body:
        return False
    texts: list[str] = []
    for m in body.get("messages") or ():
        content = m.get("content")
        if isinstance(content, str):
            texts.append(content)
        elif isinstance(content, list):
            texts.extend(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
    prompt = body.get("prompt")
    texts.extend([prompt] if isinstance(prompt, str) else [p for p in prompt or () if isinstance(p, str)])
    found = list(dict.fromkeys(m.text for t in texts for m in registry.find(t)))
    if not found:
        return False
    body["cachedrag"] = {"chunks": found}
    return True


def _rewrite(request: httpx.Request, registry: ChunkRegistry) -> httpx.Request:
    if request.method != "POST" or not request.url.path.endswith(_PATHS):
        return request
    try:
        body = json.loads(request.content or b"null")
    except (ValueError, httpx.RequestNotRead):
        return request
    if not isinstance(body, dict) or not attach_chunks(body, registry):
        return request
    headers = [(k, v) for k, v in request.headers.multi_items() if k.lower() not in ("content-length", "content-type")]
    return httpx.Request(request.method, request.url, headers=headers, json=body, extensions=request.extensions)


class ChunkTransport(httpx.BaseTransport):
    def __init__(self, registry: ChunkRegistry | None = None, inner: httpx.BaseTransport | None = None):
        self.registry = chunk_registry() if registry is None else registry
        self.inner = inner or httpx.HTTPTransport()

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        return self.inner.handle_request(_rewrite(request, self.registry))

    def close(self) -> None:
        self.inner.close()


class AsyncChunkTransport(httpx.AsyncBaseTransport):
    def __init__(self, registry: ChunkRegistry | None = None, inner: httpx.AsyncBaseTransport | None = None):
        self.registry = chunk_registry() if registry is None else registry
        self.inner = inner or httpx.AsyncHTTPTransport()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        return await self.inner.handle_async_request(_rewrite(request, self.registry))

    async def aclose(self) -> None:
        await self.inner.aclose()


def chunk_http_client(registry: ChunkRegistry | None = None, **kwargs) -> httpx.Client:
    """An ``httpx.Client`` that attaches registered chunks (``kwargs`` go to ``httpx.Client``)."""
    kwargs.setdefault("timeout", httpx.Timeout(600.0, connect=10.0))
    return httpx.Client(transport=ChunkTransport(registry), **kwargs)


def chunk_async_http_client(registry: ChunkRegistry | None = None, **kwargs) -> httpx.AsyncClient:
    kwargs.setdefault("timeout", httpx.Timeout(600.0, connect=10.0))
    return httpx.AsyncClient(transport=AsyncChunkTransport(registry), **kwargs)
