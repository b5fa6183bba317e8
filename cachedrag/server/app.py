"""The ASGI app: OpenAI-compatible routes over the engine loop (FastAPI).

Owns: ``create_app(engine, config, embedder)`` with ``GET /health``, ``GET /v1/models``, ``GET
/metrics`` (Prometheus text), ``POST /v1/chat/completions`` and ``POST /v1/completions`` (JSON or
SSE streaming, ``n`` choices decoded from one prefill of the prompt, temperature / top_p /
max_tokens / stop / seed (choice ``i`` samples with ``seed + i``) / frequency and presence
penalties, structured output: ``response_format`` JSON and tool calls (``structured``),
``logprobs`` (chat: ``logprobs`` / ``top_logprobs``; completions: ``logprobs``), ``usage`` with
``prompt_tokens_details.cached_tokens``, and a ``cachedrag`` object on each finished response
saying how its prompt was served: ``protocol.served``), ``POST /v1/embeddings`` (``embeddings``),
OpenAI-shaped errors (400 bad parameter or a prompt longer than the context window, 401 without
the API key when one is set, 404 unknown model, 503 queue full or shutting down), and freeing a
request's batch slots when its client disconnects (streaming or not; ``_EventStream`` closes the
event generator however the response ends).

The event-loop thread only parses, renders templates and tokenises (no torch ops: see
``cachedrag.server.loop`` on OpenMP threads); generation runs on the engine loop's thread and
its events come back through ``loop.call_soon_threadsafe``.

Does not own: the wire models (``protocol``), prompt planning (``cachedrag.prompt.planning``), the
loop, assembling choices and SSE chunks (``stream``).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import ValidationError
from starlette.datastructures import Headers

from cachedrag.errors import CachedRAGError, ConfigError, ContextWindowError
from cachedrag.model.generation import SamplingParams
from cachedrag.prompt.planning import PromptPlanner
from cachedrag.prompt.template import Message
from cachedrag.prompt.tools import ToolCall
from cachedrag.server import protocol as P
from cachedrag.server.config import ServerConfig
from cachedrag.server.embeddings import EmbeddingService
from cachedrag.server.loop import EngineLoop, QueueFullError, ServeRequest
from cachedrag.server.metrics import ServerMetrics
from cachedrag.server.stream import Answer, Choice, collect, sse_events
from cachedrag.server.structured import StructuredOutput, ToolAnswer, request_tools, structured_output

log = logging.getLogger("cachedrag.server")

_DISCONNECT_POLL_S = 0.5


def create_app(engine, config: ServerConfig | None = None, embedder=None) -> FastAPI:
    """The server app over ``engine`` (a ``CachedEngine``); the engine loop runs while the app does.
    ``embedder`` (else ``config.index``'s): what ``/v1/embeddings`` embeds with (``EmbeddingService``)."""
    config = config or ServerConfig()
    embeddings = EmbeddingService(embedder, config.index)
    loop = EngineLoop(engine, config.scheduler)
    metrics = ServerMetrics(engine, loop)
    loop.observer = metrics
    planner = PromptPlanner(engine, config.passages)
    aliases = {config.model_name, "default"}

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        loop.start()
        try:
            yield
        finally:
            loop.stop()

    app = FastAPI(title="cachedrag", lifespan=lifespan)
    app.state.loop, app.state.metrics, app.state.planner, app.state.config = loop, metrics, planner, config

    @app.exception_handler(P.APIError)
    async def _api_error(request: Request, exc: P.APIError):
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        message = f"{'.'.join(loc) or 'body'}: {first.get('msg', 'invalid request')}"
        return JSONResponse(P.APIError(400, message, param=".".join(loc) or None).body(), status_code=400)

    key = config.api_key.get_secret_value().encode() if config.api_key is not None else None
    app.add_middleware(_CountAndAuthorize, metrics=metrics, key=key)

    @app.get("/health")
    async def health():
        if loop._thread is None or not loop._thread.is_alive():
            raise P.APIError(503, "engine loop is not running", type="service_unavailable")
        return {"status": "ok", "waiting": loop.waiting, "running": loop.running}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": config.model_name, "object": "model", "created": 0,
                                            "owned_by": "cachedrag"}]}

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: P.ChatCompletionRequest, request: Request):
        _check_model(body.model, aliases)
        try:
            messages = [_message(m) for m in body.messages]
        except ValueError as exc:
            raise P.APIError(400, str(exc), param="messages") from None
        chunks = body.cachedrag.chunks if body.cachedrag else None
        tools = request_tools(body)
        planned = _plan(lambda: planner.chat(messages, chunks, tools=tools))
        return await _serve(request, body, planned, chat=True)

    @app.post("/v1/embeddings")
    async def embed(body: P.EmbeddingRequest):
        return JSONResponse(await embeddings.embed(body))

    @app.post("/v1/completions")
    async def completions(body: P.CompletionRequest, request: Request):
        _check_model(body.model, aliases)
        chunks = body.cachedrag.chunks if body.cachedrag else None
        prompt = body.text()
        planned = _plan(lambda: planner.completion(prompt, chunks))
        return await _serve(request, body, planned, chat=False)

    async def _serve(request: Request, body, planned, chat: bool):
        shape = structured_output(body)
        if body.n > config.scheduler.max_batch:
            raise P.APIError(400, f"n={body.n}: this server decodes at most {config.scheduler.max_batch} choices "
                                  "together (its max batch)", param="n")
        params = []
        for i in range(body.n):  # each choice its own grammar state and seed
            constraint = await _constraint(shape)
            params.append(_params(body, planned.prompt_tokens, engine.runner.max_context,
                                  config.default_max_tokens, constraint, i))
        tokenizer = engine.runner.tokenizer
        choices = [Choice(i, shape.parser(tokenizer) if chat and shape is not None else None,
                          body.logprob_alternatives is not None, params[i].constraint) for i in range(body.n)]
        aio = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()

        def emit(event) -> None:  # engine-loop thread -> event loop
            with contextlib.suppress(RuntimeError):  # the event loop closed (shutdown)
                aio.call_soon_threadsafe(queue.put_nowait, event)

        serve = ServeRequest(segments=planned.segments, params=params[0], more=params[1:], emit=emit,
                             mode=config.mode, logprobs=body.logprob_alternatives, whole_answer=not body.stream)
        try:
            rid = loop.submit(serve)
        except QueueFullError as exc:
            raise P.APIError(503, f"server busy: {exc}; retry later", type="service_unavailable",
                             code="queue_full") from None
        except RuntimeError as exc:
            raise P.APIError(503, str(exc), type="service_unavailable") from None
        answer = Answer(P.new_id("chatcmpl" if chat else "cmpl"), body.model, chat, body.include_usage, _logprobs)
        if body.stream:
            return _EventStream(_stream(queue, rid, answer, choices), media_type="text/event-stream")
        try:
            done = await collect(queue, choices, _DISCONNECT_POLL_S, request.is_disconnected)
        except BaseException as exc:
            loop.cancel(rid)
            if isinstance(exc, Exception):
                raise _failure(exc) from None
            raise
        if done is None:
            loop.cancel(rid)
            metrics.disconnects.inc()
            return Response(status_code=499)
        return JSONResponse(answer.whole(done))

    async def _constraint(shape: StructuredOutput | ToolAnswer | None):
        if shape is None:
            return None
        try:  # compiling the grammar (and converting the vocabulary once) is not torch work
            return await asyncio.to_thread(shape.constraint, engine.runner.tokenizer, engine.eos_ids)
        except ConfigError as exc:
            raise P.APIError(400, str(exc), param=shape.param) from None

    def _logprobs(records: list | None, chat: bool, offset: int = 0) -> dict | None:
        """The OpenAI ``logprobs`` object of ``records`` (None: the request did not ask)."""
        if records is None:
            return None
        decode = engine.runner.tokenizer.decode  # tokenising only: no torch work on this thread
        if chat:
            return P.chat_logprobs(records, lambda t: decode([t]))
        return P.completion_logprobs(records, lambda t: decode([t]), offset)

    async def _stream(queue: asyncio.Queue, rid: int, answer: Answer, choices: list[Choice]):
        """SSE events of one request: per choice its deltas, each with the logprobs of its tokens
        (when asked), its finish chunk; then the usage chunk (when asked) and ``[DONE]``."""
        finished = False
        try:
            if answer.chat:
                for c in choices:
                    yield _sse(P.chat_chunk(answer.id, answer.model, {"role": "assistant", "content": ""},
                                            index=c.index))
            try:
                async for body in sse_events(queue, choices, answer.chunk, answer.last, answer.closing):
                    yield _sse(body)
            except Exception as exc:  # a failed request: its error, in the OpenAI shape, ends the stream
                finished = True
                yield _sse(_failure(exc).body())
            finished = True
            yield "data: [DONE]\n\n"
        finally:
            if not finished:  # the client went away (the response task was cancelled): free the slot
                loop.cancel(rid)
                metrics.disconnects.inc()

    return app


# ---------------------------------------------------------------------- helpers
class _EventStream(StreamingResponse):
    """A streaming response that closes its event generator when the response ends, however it
    ends. When the client goes while a chunk is in flight, Starlette cancels the stream task
    inside ``send``, not inside the generator: the generator stays suspended at its ``yield`` and
    its ``finally`` (which frees the request's batch slot) would run only when it is garbage
    collected, possibly after the request has decoded to ``max_tokens``. Closing it here runs
    that ``finally`` at once (a no-op when the generator already finished)."""

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()


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


def _message(m: P.ChatMessage) -> Message:
    """A request message as the prompt layer takes it: an assistant turn's calls (ids kept, so the
    tool results that answer them match) and a tool result's ``tool_call_id`` go to the template."""
    calls = tuple(ToolCall.of(c.function.name, c.function.arguments, c.id or None) for c in m.tool_calls or ())
    return Message(m.role, m.text(), tool_calls=calls, tool_call_id=m.tool_call_id, name=m.name)


def _check_model(model: str, aliases: set[str]) -> None:
    if model not in aliases:
        raise P.APIError(404, f"the model {model!r} does not exist; this server serves {sorted(aliases)[-1]!r}",
                         param="model", code="model_not_found")


def _plan(build):
    from cachedrag.prompt.planning import ChunkNotFoundError

    try:
        return build()
    except ChunkNotFoundError as exc:
        raise P.APIError(400, str(exc), param="cachedrag.chunks") from None
    except (CachedRAGError, ValueError) as exc:
        raise P.APIError(400, str(exc), param="messages") from None


def _params(body, prompt_tokens: int, max_context: int, default_max: int, constraint=None,
            choice: int = 0) -> SamplingParams:
    """Sampling parameters of choice ``choice`` (a request's seed + ``choice``: its choices differ,
    reproducibly)."""
    room = max_context - prompt_tokens
    new = body.new_tokens
    if new is None:
        new = min(default_max, room)
    if room <= 0 or new > room:
        raise P.APIError(400, f"this model's context window is {max_context} tokens; the prompt has {prompt_tokens} "
                              f"tokens and {new} were requested for the completion", param="messages",
                         code="context_length_exceeded")
    try:
        return SamplingParams(max_new_tokens=new, temperature=body.temperature, top_p=body.top_p,
                              stop=body.stop, seed=None if body.seed is None else body.seed + choice,
                              frequency_penalty=body.frequency_penalty,
                              presence_penalty=body.presence_penalty, constraint=constraint)
    except ValidationError as exc:
        raise P.APIError(400, str(exc.errors()[0].get("msg")), param="stop") from None


def _failure(error: BaseException) -> P.APIError:
    if isinstance(error, ContextWindowError):
        return P.APIError(400, str(error), code="context_length_exceeded")
    if isinstance(error, CachedRAGError):
        return P.APIError(400, str(error))
    if isinstance(error, RuntimeError) and "shutting down" in str(error):
        return P.APIError(503, str(error), type="service_unavailable")
    log.error("request failed: %r", error)
    return P.APIError(500, f"internal error: {error}", type="server_error")


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"

