"""The ASGI app: OpenAI-compatible routes over the engine loop (FastAPI).

Owns: ``create_app(engine, config)`` with ``GET /health``, ``GET /v1/models``, ``GET /metrics``
(Prometheus text), ``POST /v1/chat/completions`` and ``POST /v1/completions`` (JSON or SSE
streaming, ``n=1``, temperature / top_p / max_tokens / stop / seed / frequency and presence
penalties, structured output: ``response_format`` JSON and required tool calls (``structured``),
``logprobs`` (chat: ``logprobs`` / ``top_logprobs``; completions: ``logprobs``), ``usage`` with
``prompt_tokens_details.cached_tokens``, and a ``cachedrag`` object on each finished response
saying how its prompt was served: ``protocol.served``), OpenAI-shaped errors (400 bad parameter or a prompt
longer than the context window, 401 without the API key when one is set, 404 unknown model, 503
queue full or shutting down), and freeing a request's batch slot when its client disconnects
(streaming or not; ``_EventStream`` closes the event generator however the response ends).

The event-loop thread only parses, renders templates and tokenises (no torch ops: see
``cachedrag.server.loop`` on OpenMP threads); generation runs on the engine loop's thread and
its events come back through ``loop.call_soon_threadsafe``.

Does not own: the wire models (``protocol``), prompt planning (``prompts``), the loop.
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
from cachedrag.server import protocol as P
from cachedrag.server.config import ServerConfig
from cachedrag.server.loop import Delta, EngineLoop, Failed, Finished, QueueFullError, ServeRequest
from cachedrag.server.metrics import ServerMetrics
from cachedrag.server.structured import StructuredOutput, structured_output

log = logging.getLogger("cachedrag.server")

_DISCONNECT_POLL_S = 0.5


def create_app(engine, config: ServerConfig | None = None) -> FastAPI:
    """The server app over ``engine`` (a ``CachedEngine``); the engine loop runs while the app does."""
    config = config or ServerConfig()
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
            messages = [Message(m.role, m.text()) for m in body.messages]
        except ValueError as exc:
            raise P.APIError(400, str(exc), param="messages") from None
        chunks = body.cachedrag.chunks if body.cachedrag else None
        planned = _plan(lambda: planner.chat(messages, chunks))
        return await _serve(request, body, planned, chat=True)

    @app.post("/v1/completions")
    async def completions(body: P.CompletionRequest, request: Request):
        _check_model(body.model, aliases)
        chunks = body.cachedrag.chunks if body.cachedrag else None
        prompt = body.text()
        planned = _plan(lambda: planner.completion(prompt, chunks))
        return await _serve(request, body, planned, chat=False)

    async def _serve(request: Request, body, planned, chat: bool):
        shape = structured_output(body)
        constraint = None
        if shape is not None:  # compiling the grammar (and converting the vocabulary once) is not torch work
            try:
                constraint = await asyncio.to_thread(shape.constraint, engine.runner.tokenizer, engine.eos_ids)
            except ConfigError as exc:
                raise P.APIError(400, str(exc), param=shape.param) from None
        params = _params(body, planned.prompt_tokens, engine.runner.max_context, config.default_max_tokens,
                         constraint)
        aio = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()

        def emit(event) -> None:  # engine-loop thread -> event loop
            with contextlib.suppress(RuntimeError):  # the event loop closed (shutdown)
                aio.call_soon_threadsafe(queue.put_nowait, event)

        serve = ServeRequest(segments=planned.segments, params=params, emit=emit, mode=config.mode,
                             logprobs=body.logprob_alternatives, whole_answer=not body.stream)
        try:
            rid = loop.submit(serve)
        except QueueFullError as exc:
            raise P.APIError(503, f"server busy: {exc}; retry later", type="service_unavailable",
                             code="queue_full") from None
        except RuntimeError as exc:
            raise P.APIError(503, str(exc), type="service_unavailable") from None
        name = body.model
        oid = P.new_id("chatcmpl" if chat else "cmpl")
        calls = shape if chat and shape is not None and shape.is_tool_call else None
        if body.stream:
            return _EventStream(_stream(queue, rid, oid, name, chat, body.include_usage, calls),
                                media_type="text/event-stream")
        text: list[str] = []
        records: list | None = [] if body.logprob_alternatives is not None else None
        while True:
            try:
                event = await asyncio.wait_for(queue.get(), timeout=_DISCONNECT_POLL_S)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    loop.cancel(rid)
                    metrics.disconnects.inc()
                    return Response(status_code=499)
                continue
            if isinstance(event, Delta):
                text.append(event.text)
                if records is not None:
                    records += event.logprobs or []
            elif isinstance(event, Failed):
                raise _failure(event.error)
            elif isinstance(event, Finished):
                use = P.usage(event.prompt_tokens, event.completion_tokens, event.cached_tokens)
                logprobs = _logprobs(records, chat)
                if not chat:
                    body = P.completion_response(oid, name, "".join(text), event.finish_reason, use, logprobs)
                else:
                    tool_calls = _tool_calls(calls, "".join(text), event.finish_reason)
                    body = P.chat_response(oid, name, "".join(text), "tool_calls" if tool_calls
                                           else event.finish_reason, use, tool_calls, logprobs)
                return JSONResponse({**body, "cachedrag": P.served(event.stats)})

    def _logprobs(records: list | None, chat: bool, offset: int = 0) -> dict | None:
        """The OpenAI ``logprobs`` object of ``records`` (None: the request did not ask)."""
        if records is None:
            return None
        decode = engine.runner.tokenizer.decode  # tokenising only: no torch work on this thread
        if chat:
            return P.chat_logprobs(records, lambda t: decode([t]))
        return P.completion_logprobs(records, lambda t: decode([t]), offset)

    async def _stream(queue: asyncio.Queue, rid: int, oid: str, name: str, chat: bool, include_usage: bool,
                      calls: StructuredOutput | None = None):
        """SSE events of one request, each text delta with the logprobs of its tokens (when asked).
        A tool call's JSON is held back and sent whole as one ``tool_calls`` delta when it
        completes (the call's name may be its last field)."""
        finished = False
        held: list[str] = []
        held_records: list | None = None
        sent = 0  # characters of completion text sent: the legacy logprobs' text_offset
        try:
            if chat:
                yield _sse(P.chat_chunk(oid, name, {"role": "assistant", "content": ""}))
            pending = None
            while True:
                event, pending = pending or await queue.get(), None
                if isinstance(event, Delta):
                    event, pending = _merge_deltas(event, queue)
                    if calls is not None:
                        held.append(event.text)
                        if event.logprobs is not None:
                            held_records = (held_records or []) + event.logprobs
                        continue
                    logprobs = _logprobs(event.logprobs, chat, sent)
                    sent += len(event.text)
                    yield _sse(P.chat_chunk(oid, name, {"content": event.text}, logprobs=logprobs) if chat
                               else P.completion_chunk(oid, name, event.text, logprobs=logprobs))
                elif isinstance(event, Failed):
                    finished = True
                    yield _sse(_failure(event.error).body())
                    break
                elif isinstance(event, Finished):
                    finished = True
                    reason = event.finish_reason
                    if calls is not None:
                        tool_calls = _tool_calls(calls, "".join(held), reason)
                        if tool_calls:
                            reason = "tool_calls"
                            delta = {"tool_calls": [{"index": i, **c} for i, c in enumerate(tool_calls)]}
                        else:
                            delta = {"content": "".join(held)}
                        yield _sse(P.chat_chunk(oid, name, delta, logprobs=_logprobs(held_records, chat)))
                    last = P.chat_chunk(oid, name, {}, reason) if chat else P.completion_chunk(oid, name, "", reason)
                    yield _sse({**last, "cachedrag": P.served(event.stats)})
                    if include_usage:
                        use = P.usage(event.prompt_tokens, event.completion_tokens, event.cached_tokens)
                        yield _sse(P.chat_chunk(oid, name, {}, use=use, choices=False) if chat
                                   else P.completion_chunk(oid, name, "", use=use, choices=False))
                    break
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


def _tool_calls(calls: StructuredOutput | None, text: str, finish_reason: str) -> list[dict] | None:
    """The OpenAI ``tool_calls`` of a finished answer when it is a complete call (a call cut at
    ``max_tokens`` or by a stop string stays text, with its own finish reason)."""
    if calls is None or finish_reason != "stop":
        return None
    try:
        json.loads(text)
        return calls.tool_calls(text)
    except (ValueError, KeyError, TypeError):
        return None


def _merge_deltas(first: Delta, queue: asyncio.Queue) -> tuple[Delta, object | None]:
    """``first`` joined with the deltas already queued behind it (one SSE chunk for them: when
    the event loop falls behind a batch of streams it catches up in fewer sends), and the first
    queued event that is not a delta (``None`` if none was taken)."""
    if queue.empty():
        return first, None
    texts, records = [first.text], None if first.logprobs is None else list(first.logprobs)
    while not queue.empty():
        event = queue.get_nowait()
        if not isinstance(event, Delta):
            return Delta("".join(texts), records), event
        texts.append(event.text)
        if records is not None:
            records += event.logprobs or []
    return Delta("".join(texts), records), None


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


def _params(body, prompt_tokens: int, max_context: int, default_max: int, constraint=None) -> SamplingParams:
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
                              stop=body.stop, seed=body.seed, frequency_penalty=body.frequency_penalty,
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

