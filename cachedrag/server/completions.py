"""The completion routes: ``POST /v1/chat/completions`` and ``POST /v1/completions``.

Owns: ``CompletionService`` (a request's prompt planned, its sampling parameters per choice,
its grammar, submission to the engine loop, and its answer: JSON, or SSE streaming through
``EventStream``, which frees the request's batch slots however the response ends) and
``router``, the routes over it; the OpenAI errors of these routes (400 bad parameter or a prompt
longer than the context window, 404 unknown model, 503 queue full or shutting down, 499 when a
client leaves before its answer).

The event-loop thread only parses, renders templates and tokenises (no torch ops: see
``cachedrag.server.loop`` on OpenMP threads); generation runs on the engine loop's thread and
its events come back through ``loop.call_soon_threadsafe``.

Does not own: the wire models (``protocol``), prompt planning (``cachedrag.prompt.planning``),
structured output (``structured``), the loop, assembling choices and SSE chunks (``stream``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError

from cachedrag.errors import CachedRAGError, ConfigError, ContextWindowError
from cachedrag.model.generation import SamplingParams
from cachedrag.prompt.planning import PromptPlanner
from cachedrag.prompt.template import Message
from cachedrag.prompt.tools import ToolCall
from cachedrag.server import protocol as P
from cachedrag.server.config import ServerConfig
from cachedrag.server.loop import EngineLoop, QueueFullError, ServeRequest
from cachedrag.server.metrics import ServerMetrics
from cachedrag.server.stream import Answer, Choice, collect, sse_events
from cachedrag.server.structured import StructuredOutput, ToolAnswer, request_tools, structured_output

log = logging.getLogger("cachedrag.server")

_DISCONNECT_POLL_S = 0.5


def router(service: CompletionService) -> APIRouter:
    """The completion routes over ``service``."""
    routes = APIRouter()

    @routes.post("/v1/chat/completions")
    async def chat_completions(body: P.ChatCompletionRequest, request: Request):
        return await service.chat(body, request)

    @routes.post("/v1/completions")
    async def completions(body: P.CompletionRequest, request: Request):
        return await service.completion(body, request)

    return routes


class CompletionService:
    """Serves completion requests of one app: plans the prompt, submits to ``loop``, answers."""

    def __init__(self, engine, loop: EngineLoop, metrics: ServerMetrics, planner: PromptPlanner,
                 config: ServerConfig) -> None:
        self.engine, self.loop, self.metrics, self.planner, self.config = engine, loop, metrics, planner, config
        self.aliases = {config.model_name, "default"}

    async def chat(self, body: P.ChatCompletionRequest, request: Request):
        _check_model(body.model, self.aliases)
        try:
            messages = [_message(m) for m in body.messages]
        except ValueError as exc:
            raise P.APIError(400, str(exc), param="messages") from None
        chunks = body.cachedrag.chunks if body.cachedrag else None
        tools = request_tools(body)
        planned = _plan(lambda: self.planner.chat(messages, chunks, tools=tools))
        return await self.serve(request, body, planned, chat=True)

    async def completion(self, body: P.CompletionRequest, request: Request):
        _check_model(body.model, self.aliases)
        chunks = body.cachedrag.chunks if body.cachedrag else None
        prompt = body.text()
        planned = _plan(lambda: self.planner.completion(prompt, chunks))
        return await self.serve(request, body, planned, chat=False)

    async def serve(self, request: Request, body, planned, chat: bool):
        """Submit ``planned`` (its ``n`` choices decoded from one prefill) and answer: a stream, the
        whole answer, or 499 when the client left first."""
        shape = structured_output(body)
        params = await self._choice_params(body, planned, shape)
        tokenizer = self.engine.runner.tokenizer
        choices = [Choice(i, shape.parser(tokenizer) if chat and shape is not None else None,
                          body.logprob_alternatives is not None, params[i].constraint) for i in range(body.n)]
        aio = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()

        def emit(event) -> None:  # engine-loop thread -> event loop
            with contextlib.suppress(RuntimeError):  # the event loop closed (shutdown)
                aio.call_soon_threadsafe(queue.put_nowait, event)

        rid = self._submit(ServeRequest(segments=planned.segments, params=params[0], more=params[1:], emit=emit,
                                        mode=self.config.mode, logprobs=body.logprob_alternatives,
                                        whole_answer=not body.stream, conversation=chat and planned.conversation))
        answer = Answer(P.new_id("chatcmpl" if chat else "cmpl"), body.model, chat, body.include_usage,
                        self._logprobs)
        if body.stream:
            return EventStream(self._stream(queue, rid, answer, choices), media_type="text/event-stream")
        try:
            done = await collect(queue, choices, _DISCONNECT_POLL_S, request.is_disconnected)
        except BaseException as exc:
            self.loop.cancel(rid)
            if isinstance(exc, Exception):
                raise _failure(exc) from None
            raise
        if done is None:
            self.loop.cancel(rid)
            self.metrics.disconnects.inc()
            return Response(status_code=499)
        return JSONResponse(answer.whole(done))

    async def _choice_params(self, body, planned, shape) -> list[SamplingParams]:
        """Each choice's sampling parameters: its own grammar state and seed."""
        max_batch = self.config.scheduler.max_batch
        if body.n > max_batch:
            raise P.APIError(400, f"n={body.n}: this server decodes at most {max_batch} choices together (its "
                                  "max batch)", param="n")
        params = []
        for i in range(body.n):
            constraint = await self._constraint(shape)
            params.append(_params(body, planned.prompt_tokens, self.engine.runner.max_context,
                                  self.config.default_max_tokens, constraint, i))
        return params

    def _submit(self, serve: ServeRequest) -> int:
        try:
            return self.loop.submit(serve)
        except QueueFullError as exc:
            raise P.APIError(503, f"server busy: {exc}; retry later", type="service_unavailable",
                             code="queue_full") from None
        except RuntimeError as exc:
            raise P.APIError(503, str(exc), type="service_unavailable") from None

    async def _constraint(self, shape: StructuredOutput | ToolAnswer | None):
        if shape is None:
            return None
        try:  # compiling the grammar (and converting the vocabulary once) is not torch work
            return await asyncio.to_thread(shape.constraint, self.engine.runner.tokenizer, self.engine.eos_ids)
        except ConfigError as exc:
            raise P.APIError(400, str(exc), param=shape.param) from None

    def _logprobs(self, records: list | None, chat: bool, offset: int = 0) -> dict | None:
        """The OpenAI ``logprobs`` object of ``records`` (None: the request did not ask)."""
        if records is None:
            return None
        decode = self.engine.runner.tokenizer.decode  # tokenising only: no torch work on this thread
        if chat:
            return P.chat_logprobs(records, lambda t: decode([t]))
        return P.completion_logprobs(records, lambda t: decode([t]), offset)

    async def _stream(self, queue: asyncio.Queue, rid: int, answer: Answer, choices: list[Choice]):
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
                self.loop.cancel(rid)
                self.metrics.disconnects.inc()


class EventStream(StreamingResponse):
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
