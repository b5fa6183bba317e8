"""The ASGI app: OpenAI-compatible routes over the engine loop (FastAPI).

Owns: ``create_app(engine, config, embedder)``, which builds the app from its route groups
(``completions``: ``POST /v1/chat/completions`` and ``POST /v1/completions``; ``embeddings``:
``POST /v1/embeddings``; here: ``GET /health``, ``GET /v1/models``, ``GET /metrics`` in the
Prometheus text format), the engine loop's lifetime (it runs while the app does), errors in
the OpenAI shape (a bad request body: 400), and the middleware that counts every response and
refuses ``/v1`` requests without the API key when one is set (401). With ``config.index``, the
index's chunks are known passages from the start (``index_passages``).

What a completion request can ask (``n`` choices decoded from one prefill, sampling, stop,
penalties, structured output and tool calls, ``logprobs``, streaming), the ``usage`` and
``cachedrag`` objects of its answer, and its errors: ``completions``.

Does not own: the wire models (``protocol``), prompt planning (``cachedrag.prompt.planning``), the
loop, the metrics (``metrics``), settings (``config``).
"""

from __future__ import annotations

import contextlib
import hmac

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.datastructures import Headers

from cachedrag.prompt.planning import PromptPlanner
from cachedrag.server import completions, embeddings
from cachedrag.server import protocol as P
from cachedrag.server.config import ServerConfig
from cachedrag.server.loop import EngineLoop
from cachedrag.server.metrics import ServerMetrics


def create_app(engine, config: ServerConfig | None = None, embedder=None) -> FastAPI:
    """The server app over ``engine`` (a ``CachedEngine``); the engine loop runs while the app does.
    ``embedder`` (else ``config.index``'s): what ``/v1/embeddings`` embeds with (``EmbeddingService``)."""
    config = config or ServerConfig()
    loop = EngineLoop(engine, config.scheduler)
    metrics = ServerMetrics(engine, loop)
    loop.observer = metrics
    planner = PromptPlanner(engine, config.passages)
    if config.index is not None and config.passages.enabled:
        planner.seen.register(index_passages(config.index))

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        loop.start()
        try:
            yield
        finally:
            loop.stop()

    app = FastAPI(title="cachedrag", lifespan=lifespan)
    app.state.loop, app.state.metrics, app.state.planner, app.state.config = loop, metrics, planner, config
    _add_error_handlers(app)
    key = config.api_key.get_secret_value().encode() if config.api_key is not None else None
    app.add_middleware(_CountAndAuthorize, metrics=metrics, key=key)
    app.include_router(_info_router(loop, metrics, config))
    app.include_router(completions.router(completions.CompletionService(engine, loop, metrics, planner, config)))
    app.include_router(embeddings.router(embeddings.EmbeddingService(embedder, config.index)))
    return app


def _add_error_handlers(app: FastAPI) -> None:
    """Errors in the OpenAI shape: ``APIError`` as raised, a request body that fails validation as 400."""

    @app.exception_handler(P.APIError)
    async def _api_error(request: Request, exc: P.APIError):
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        message = f"{'.'.join(loc) or 'body'}: {first.get('msg', 'invalid request')}"
        return JSONResponse(P.APIError(400, message, param=".".join(loc) or None).body(), status_code=400)


def _info_router(loop: EngineLoop, metrics: ServerMetrics, config: ServerConfig) -> APIRouter:
    """``GET /health`` (503 while the engine loop is not running), ``GET /v1/models``, ``GET /metrics``."""
    routes = APIRouter()

    @routes.get("/health")
    async def health():
        if loop._thread is None or not loop._thread.is_alive():
            raise P.APIError(503, "engine loop is not running", type="service_unavailable")
        return {"status": "ok", "waiting": loop.waiting, "running": loop.running}

    @routes.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": config.model_name, "object": "model", "created": 0,
                                            "owned_by": "cachedrag"}]}

    @routes.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return routes


class _CountAndAuthorize:
    """Pure ASGI middleware: refuses ``/v1`` requests without the API key (when one is set) and
    counts every response by path and status. Not Starlette's ``BaseHTTPMiddleware`` (what
    ``@app.middleware("http")`` builds): that one passes every chunk of a streamed response
    through an extra memory stream and task, one more hop per token on the event loop that
    streams every running request's tokens."""

    def __init__(self, app, metrics: ServerMetrics, key: bytes | None) -> None:
        self.app, self.metrics, self.key = app, metrics, key

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        if self.key is not None and path.startswith("/v1") and not _authorized(Headers(scope=scope), self.key):
            error = P.APIError(401, "invalid or missing API key: send 'Authorization: Bearer <key>'",
                               code="invalid_api_key")
            response = JSONResponse(error.body(), status_code=401, headers={"WWW-Authenticate": "Bearer"})
            self.metrics.requests.labels(path, "401").inc()
            await response(scope, receive, send)
            return
        counted = False

        async def counting_send(message) -> None:
            nonlocal counted
            if message["type"] == "http.response.start" and not counted:
                counted = True
                self.metrics.requests.labels(path, str(message["status"])).inc()
            await send(message)

        try:
            await self.app(scope, receive, counting_send)
        except Exception:
            if not counted:  # no response started: the server's error handler answers 500
                self.metrics.requests.labels(path, "500").inc()
            raise


def _authorized(headers: Headers, key: bytes) -> bool:
    scheme, _, token = headers.get("authorization", "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), key)


def index_passages(index_dir: str) -> list[str]:
    """The chunk texts of the index at ``index_dir``: known passages from the start, so a tool
    result (or a prompt) holding one of them is cut at that chunk's boundaries, as the retriever
    cut it, not paragraph by paragraph (a chunk's short paragraphs would be computed every time)."""
    from cachedrag.retrieval.index import load_index

    return [chunk.text for chunk in load_index(index_dir, verify=False).chunks]

