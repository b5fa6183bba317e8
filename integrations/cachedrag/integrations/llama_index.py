"""LlamaIndex integration: an LLM, a retriever and a node postprocessor that share chunk caches.

Owns the LlamaIndex adapters (thin: the work is in ``generator``, ``search``, ``cachedrag.prompt``;
the retriever and the postprocessor live in ``llama_index_retrieval``, re-exported here):

- ``CachedRAGLLM`` (``FunctionCallingLLM``): complete / chat, streaming and real async variants
  (work runs on a worker thread; streams come through an ``asyncio.Queue``); the tokenizer's
  chat template; stop strings; ``metadata`` from the model. Tool calling (``chat_with_tools``
  and its async / stream variants, ``FunctionAgent``): tools, ``ToolCallBlock``s and tool
  messages rendered in the template's tool format, answers grammar-constrained per tool choice
  and parsed into ``ToolCallBlock``s (``llama_index_tools``). Registered chunk texts found in a
  prompt are served from the engine's chunk caches whatever template surrounds them.
- ``CachedRAGRetriever`` (``BaseRetriever``) over an index directory (``cachedrag index
  build``): embeds ``query_bundle.embedding_strs`` (HyDE's hypothetical document included),
  returns ``NodeWithScore`` with chunk ids, registers the chunk texts, and starts lookahead
  prefetch on the original query when a pipeline tells it (``prefetch``; with
  ``auto_prefetch``, on LlamaIndex's ``QueryStartEvent``, which query engines fire before
  any query transform runs).
- ``CachedRAGNodePostprocessor``: registers the texts of nodes from any other retriever or
  vector store (nodes pass through unchanged), so an app keeps its own index and still gets
  chunk reuse.
- Query-level stats: a span handler on LlamaIndex's dispatcher follows each query engine
  ``query``/``aquery`` span; every ``CachedRAGLLM`` call inside it (nested sub-queries included)
  is summed into ``Response.metadata["cachedrag"]`` (``query_stats.QueryStats``).

Does not own: generation, search or the registries (the shared helper modules).
"""

from __future__ import annotations

import contextvars
import inspect
from collections.abc import Sequence
from typing import Any

from llama_index.core.base.base_query_engine import BaseQueryEngine
from llama_index.core.base.llms.types import (
    ChatMessage,
    ChatResponse,
    ChatResponseAsyncGen,
    ChatResponseGen,
    CompletionResponse,
    CompletionResponseAsyncGen,
    CompletionResponseGen,
    LLMMetadata,
    MessageRole,
)
from llama_index.core.instrumentation import get_dispatcher
from llama_index.core.instrumentation.span import SimpleSpan, active_span_id
from llama_index.core.instrumentation.span_handlers import BaseSpanHandler
from llama_index.core.llms.callbacks import llm_chat_callback, llm_completion_callback
from llama_index.core.llms.function_calling import FunctionCallingLLM
from pydantic import Field, PrivateAttr

from cachedrag.config import FidelityName
from cachedrag.integrations.engines import engine_name, fidelity_engine, load_engine
from cachedrag.integrations.generator import Answer, ChunkAwareGenerator, ToolRequest, json_constraint, sampling_params
from cachedrag.integrations.llama_index_retrieval import CachedRAGNodePostprocessor, CachedRAGRetriever
from cachedrag.integrations.llama_index_parsers import parser_schema
from cachedrag.integrations.llama_index_tools import ToolCallTracker, prepare_chat_with_tools, tool_selections
from cachedrag.integrations.llama_index_tools import to_messages as _messages
from cachedrag.integrations.query_stats import QueryStats
from cachedrag.integrations.worker import run_in_worker, stream_in_worker
from cachedrag.model.loader import DEFAULT_MODEL
from cachedrag.prompt.registry import ChunkRegistry
from cachedrag.prompt.template import RenderedPrompt

__all__ = ["CachedRAGLLM", "CachedRAGRetriever", "CachedRAGNodePostprocessor"]


class CachedRAGLLM(FunctionCallingLLM):
    """A LlamaIndex LLM that reuses the KV caches of retrieved chunks.

    >>> from cachedrag.integrations.llama_index import CachedRAGLLM, CachedRAGRetriever
    >>> from llama_index.core.query_engine import RetrieverQueryEngine
    >>> llm = CachedRAGLLM(max_new_tokens=64)             # embedded SmolLM2-135M-Instruct  # doctest: +SKIP
    >>> retriever = CachedRAGRetriever(index_dir="my-index", similarity_top_k=4)  # doctest: +SKIP
    >>> engine = RetrieverQueryEngine.from_args(retriever, llm=llm)               # doctest: +SKIP
    >>> print(engine.query("How do I pretty-print JSON?"))                          # doctest: +SKIP

    ``model=`` names an HF id or local path (one engine per model per process, shared with
    ``ChatCachedRAG``); ``engine=`` passes an existing ``CachedEngine`` to share its cache.
    Each response's ``raw`` holds the engine's stats (TTFT, chunks hit/missed, tokens
    computed...); ``last_stats`` the latest call's.
    """

    model: str = Field(default=DEFAULT_MODEL, description="HF model id, local path, .gguf file, "
                       "or the embedded default's name")
    max_new_tokens: int = Field(default=256, ge=1, description="upper bound on generated tokens (metadata.num_output)")
    temperature: float = Field(default=0.0, ge=0.0, description="sampling temperature; 0 = greedy")
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, description="nucleus sampling mass")
    top_k: int = Field(default=0, ge=0, description="sample among the k most likely tokens; 0 = no limit")
    repetition_penalty: float = Field(default=1.0, gt=0.0, description="> 1 discourages repeating generated "
                                      "tokens (stops small models from looping until the token cap)")
    stop: list[str] = Field(default_factory=list, description="stop strings; the answer ends before them")
    seed: int | None = Field(default=None, description="sampling seed (None = nondeterministic when sampling)")
    reuse_mode: str | None = Field(
        default=None, description="chunk reuse mode: full, prefix, naive, random or cachedrag (None = the engine's)")
    context_window: int | None = Field(default=None, ge=1,
                                       description="context window reported in metadata (None = the model's)")
    timeout: float | None = Field(default=None, gt=0,
                                  description="seconds a generation may take (checked between tokens)")
    share_engine: bool = Field(default=True,
                               description="use the process-wide engine of `model` (False: load a private one)")
    fidelity: FidelityName | None = Field(
        default=None, description="a fidelity level, as `cachedrag serve --fidelity`: exact, faithful, guarded, "
        "balanced or fast (docs/fidelity.md); the engine at that level on the same weights, with a chunk cache of "
        "its own (None = the engine as configured)")

    _engine: Any = PrivateAttr(default=None)
    _generator: ChunkAwareGenerator = PrivateAttr(default=None)
    _last_stats: dict | None = PrivateAttr(default=None)

    def __init__(self, *, engine=None, chunk_registry: ChunkRegistry | None = None, **kwargs: Any):
        # unknown arguments raise (they were silently dropped: model_path=..., generate_kwargs=...)
        unknown = sorted(set(kwargs) - set(type(self).model_fields))
        if unknown:
            raise TypeError(f"CachedRAGLLM got unknown argument(s) {', '.join(unknown)}; "
                            f"known: {', '.join(sorted(type(self).model_fields))}")
        if engine is not None and "model" not in kwargs:
            kwargs["model"] = engine_name(engine)
        super().__init__(**kwargs)
        if engine is None:
            engine = load_engine(self.model, self.share_engine, self.fidelity)
        elif self.fidelity is not None:
            engine = fidelity_engine(engine, self.fidelity)
        self._engine = engine
        self._generator = ChunkAwareGenerator(engine, chunk_registry)

    def structured_predict(self, output_cls, prompt, llm_kwargs: dict[str, Any] | None = None,
                           **prompt_args: Any):
        """An ``output_cls`` instance from grammar-constrained JSON decoding (valid for its schema
        whatever the model size), instead of LlamaIndex's prompt-and-parse fallback."""
        rendered = self._generator.render_messages(_messages(prompt.format_messages(llm=self, **prompt_args)))
        return output_cls.model_validate_json(self._json_text(rendered, output_cls.model_json_schema(), llm_kwargs))

    async def astructured_predict(self, output_cls, prompt, llm_kwargs: dict[str, Any] | None = None,
                                  **prompt_args: Any):
        return await run_in_worker(self.structured_predict, output_cls, prompt, llm_kwargs, **prompt_args)

    def predict(self, prompt, **prompt_args: Any) -> str:
        """LlamaIndex's ``predict``; when the prompt's output parser expects a known JSON shape (a
        Pydantic class, LlamaIndex's sub-questions: ``llama_index_parsers``) the answer is decoded
        under that shape's grammar, so the parser that reads it does not fail on a small model."""
        schema = parser_schema(prompt.output_parser, prompt_args)
        if schema is None:
            return super().predict(prompt, **prompt_args)
        if self.metadata.is_chat_model:
            rendered = self._generator.render_messages(_messages(self._get_messages(prompt, **prompt_args)))
        else:
            rendered = self._completion_prompt(self._get_prompt(prompt, **prompt_args), formatted=True)
        return self._parse_output(self._json_text(rendered, schema))

    async def apredict(self, prompt, **prompt_args: Any) -> str:
        if parser_schema(prompt.output_parser, prompt_args) is None:
            return await super().apredict(prompt, **prompt_args)
        return await run_in_worker(self.predict, prompt, **prompt_args)

    def _json_text(self, rendered: RenderedPrompt, schema: dict, llm_kwargs: dict[str, Any] | None = None) -> str:
        """The answer to ``rendered`` decoded under the JSON ``schema``; a cut answer raises."""
        kwargs = dict(llm_kwargs or {})
        kwargs["response_format"] = {"type": "json_schema", "schema": schema}
        answer = self._answer(rendered, kwargs)
        if answer.finish_reason == "length":
            raise ValueError(f"structured output was cut at max_new_tokens={self.max_new_tokens} before the "
                             f"JSON was complete; raise max_new_tokens")
        return answer.text

    @classmethod
    def class_name(cls) -> str:
        return "CachedRAGLLM"

    @property
    def engine(self):
        """The ``CachedEngine`` (its ``stats()`` show the cache as a whole)."""
        return self._engine

    @property
    def last_stats(self) -> dict | None:
        """Stats of the latest finished call on this object (use each response's ``raw`` under concurrency)."""
        return self._last_stats

    @property
    def metadata(self) -> LLMMetadata:
        return LLMMetadata(
            context_window=self.context_window or self._engine.runner.max_context,
            num_output=self.max_new_tokens,
            model_name=self.model,
            is_chat_model=self._generator.is_chat_model,
            is_function_calling_model=True,
        )

    # ------------------------------------------------------------------ tool calling
    def _prepare_chat_with_tools(self, tools, user_msg=None, chat_history=None, verbose: bool = False,
                                 allow_parallel_tool_calls: bool = False, tool_required: bool = False,
                                 **kwargs: Any) -> dict[str, Any]:
        """``tool_required=True`` (or ``tool_choice="required"`` / a tool's name) forces a call;
        otherwise the model may answer in text (``auto``, a lazy grammar)."""
        return prepare_chat_with_tools(tools, user_msg, chat_history, allow_parallel_tool_calls, tool_required,
                                       **kwargs)

    def get_tool_calls_from_response(self, response: ChatResponse, error_on_no_tool_call: bool = True,
                                     **kwargs: Any) -> list:
        """``ToolSelection``s of the response's ``ToolCallBlock``s (partial JSON arguments closed)."""
        return tool_selections(response, error_on_no_tool_call)

    # ------------------------------------------------------------------ completion
    @llm_completion_callback()
    def complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        """``formatted=False`` wraps ``prompt`` as the user turn of the chat template (after
        ``system_prompt``); ``formatted=True`` uses it as is."""
        return self._complete(prompt, formatted, **kwargs)

    @llm_completion_callback()
    def stream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseGen:
        return self._stream_complete(prompt, formatted, _sinks=_query_spans.sinks(), **kwargs)

    @llm_completion_callback()
    async def acomplete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        return await run_in_worker(self._complete, prompt, formatted, **kwargs)

    @llm_completion_callback()
    async def astream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseAsyncGen:
        sinks = _query_spans.sinks()
        return stream_in_worker(lambda: self._stream_complete(prompt, formatted, _sinks=sinks, **kwargs))

    # ------------------------------------------------------------------ chat
    @llm_chat_callback()
    def chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        return self._chat(messages, **kwargs)

    @llm_chat_callback()
    def stream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseGen:
        return self._stream_chat(messages, _sinks=_query_spans.sinks(), **kwargs)

    @llm_chat_callback()
    async def achat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        return await run_in_worker(self._chat, messages, **kwargs)

    @llm_chat_callback()
    async def astream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseAsyncGen:
        sinks = _query_spans.sinks()
        return stream_in_worker(lambda: self._stream_chat(messages, _sinks=sinks, **kwargs))

    # ------------------------------------------------------------------ helpers (blocking; any thread)
    def _complete(self, prompt: str, formatted: bool, **kwargs: Any) -> CompletionResponse:
        answer = self._answer(self._completion_prompt(prompt, formatted), kwargs)
        return CompletionResponse(text=answer.text, raw=answer.stats(), additional_kwargs=_usage(answer))

    def _stream_complete(self, prompt: str, formatted: bool, _sinks=(), **kwargs: Any) -> CompletionResponseGen:
        rendered = self._completion_prompt(prompt, formatted)
        for text, delta, answer in self._deltas(rendered, kwargs, _sinks):
            if answer is None:
                yield CompletionResponse(text=text, delta=delta)
            else:
                yield CompletionResponse(text=text, delta=delta, raw=answer.stats(), additional_kwargs=_usage(answer))

    def _chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        tools = _tool_request(kwargs)
        answer = self._answer(self._generator.render_messages(_messages(messages), tools and tools.tools), kwargs)
        parser = tools.parser(self._engine) if tools else None
        if parser is None:
            message = ChatMessage(role=MessageRole.ASSISTANT, content=answer.text)
        else:
            tracker = ToolCallTracker()
            tracker.add(parser.feed(answer.text) + parser.finish())
            message = tracker.message()
        return ChatResponse(message=message, raw=answer.stats(), additional_kwargs=_usage(answer))

    def _stream_chat(self, messages: Sequence[ChatMessage], _sinks=(), **kwargs: Any) -> ChatResponseGen:
        tools = _tool_request(kwargs)
        rendered = self._generator.render_messages(_messages(messages), tools and tools.tools)
        parser = tools.parser(self._engine) if tools else None
        tracker = ToolCallTracker()
        for text, delta, answer in self._deltas(rendered, kwargs, _sinks):
            if parser is not None:  # text outside the calls; the calls as ToolCallBlocks so far
                delta = tracker.add(parser.feed(delta) + (parser.finish() if answer is not None else []))
                message = tracker.message()
            else:
                message = ChatMessage(role=MessageRole.ASSISTANT, content=text)
            if answer is None:
                yield ChatResponse(message=message, delta=delta)
            else:
                yield ChatResponse(message=message, delta=delta, raw=answer.stats(), additional_kwargs=_usage(answer))

    def _completion_prompt(self, prompt: str, formatted: bool) -> RenderedPrompt:
        if not self._generator.is_chat_model:
            formatted = True  # no template to apply: the prompt is the model's input
        return self._generator.render_completion(prompt, self.system_prompt, formatted=formatted)

    def _answer(self, rendered: RenderedPrompt, kwargs: dict) -> Answer:
        answer = self._generator.generate(rendered, self._params(kwargs), mode=kwargs.get("mode", self.reuse_mode),
                                          timeout=self.timeout)
        self._last_stats = answer.stats()
        for sink in _query_spans.sinks():
            sink.add(self._last_stats)
        return answer

    def _deltas(self, rendered: RenderedPrompt, kwargs: dict, sinks=()):
        """``(text so far, delta, None)`` per delta as it comes, then ``(text, "", Answer)``: a final
        empty-delta response carries the stats (nothing is held back from the stream). ``sinks``: the
        queries this stream belongs to, taken when the stream was requested (it is consumed later)."""
        stream = self._generator.stream(rendered, self._params(kwargs), mode=kwargs.get("mode", self.reuse_mode),
                                        timeout=self.timeout)
        text = ""
        try:
            for delta in stream:
                text += delta
                yield text, delta, None
        finally:
            stream.close()
        self._last_stats = stream.answer.stats()
        for sink in sinks:
            sink.add(self._last_stats)
        yield text, "", stream.answer

    def _params(self, kwargs: dict):
        stop = list(self.stop) + list(kwargs.get("stop") or [])
        tools = _tool_request(kwargs)
        if tools is not None and not kwargs.get("response_format"):
            constraint = tools.constraint(self._engine)
        else:
            constraint = json_constraint(kwargs["response_format"], self._engine) if kwargs.get("response_format") \
                else None
        return sampling_params(
            max_new_tokens=kwargs.get("max_new_tokens", kwargs.get("max_tokens", self.max_new_tokens)),
            temperature=kwargs.get("temperature", self.temperature), top_p=kwargs.get("top_p", self.top_p),
            stop=stop, seed=kwargs.get("seed", self.seed), top_k=kwargs.get("top_k", self.top_k),
            repetition_penalty=kwargs.get("repetition_penalty", self.repetition_penalty), constraint=constraint,
        )


# ---------------------------------------------------------------------- helpers
def _tool_request(kwargs: dict) -> ToolRequest | None:
    return ToolRequest.of(kwargs.get("tools"), kwargs.get("tool_choice"), kwargs.get("parallel_tool_calls"))


def _usage(answer: Answer) -> dict:
    return {"prompt_tokens": answer.input_tokens, "completion_tokens": answer.output_tokens,
            "total_tokens": answer.input_tokens + answer.output_tokens, "cached_tokens": answer.cached_tokens}


class _QuerySpans(BaseSpanHandler[SimpleSpan]):
    """Follows LlamaIndex spans to tell which open queries an LLM call belongs to.

    A query engine's ``query``/``aquery`` span gets a ``QueryStats``; at its exit the summary goes
    on the response's ``metadata["cachedrag"]`` (the same dict keeps filling for a stream consumed
    later). Only span ids and parent links are kept, and only while spans are open.
    """

    _queries: dict = PrivateAttr(default_factory=dict)  # open query span id -> QueryStats

    @classmethod
    def class_name(cls) -> str:
        return "CachedRAGQuerySpans"

    def new_span(self, id_: str, bound_args, instance=None, parent_span_id: str | None = None, tags=None, **kwargs):
        if isinstance(instance, BaseQueryEngine) and id_.split("-", 1)[0].rsplit(".", 1)[-1] in ("query", "aquery"):
            with self.lock:
                self._queries[id_] = QueryStats()
        return SimpleSpan(id_=id_, parent_id=parent_span_id)

    def prepare_to_exit_span(self, id_: str, bound_args, instance=None, result=None, **kwargs):
        with self.lock:
            stats = self._queries.pop(id_, None)
        gen = getattr(result, "response_gen", None)
        # a streaming response generates after its query span ended: its calls are attributed explicitly
        wrap = _attributed if inspect.isgenerator(gen) else _attributed_async if inspect.isasyncgen(gen) else None
        # only queries that called a CachedRAGLLM get stats (a stream's calls come later, as it is consumed)
        if stats is not None and hasattr(result, "metadata") and (stats.summary["llm_calls"] or wrap is not None):
            if result.metadata is None:
                result.metadata = {}
            result.metadata["cachedrag"] = stats.summary
            if wrap is not None:
                result.response_gen = wrap(gen, stats)
        return self.open_spans.get(id_)

    def prepare_to_drop_span(self, id_: str, bound_args, instance=None, err=None, **kwargs):
        with self.lock:
            self._queries.pop(id_, None)
        return self.open_spans.get(id_)

    def sinks(self) -> list[QueryStats]:
        """The ``QueryStats`` of every open query enclosing the current span (innermost first), and
        of the streaming responses being consumed right now."""
        out = list(_streaming_queries.get())
        span_id = active_span_id.get()
        with self.lock:
            while span_id is not None:
                if span_id in self._queries:
                    out.append(self._queries[span_id])
                span = self.open_spans.get(span_id)
                span_id = span.parent_id if span is not None else None
        return out


# queries whose streaming response is being advanced in this context (set only around each step)
_streaming_queries: contextvars.ContextVar[tuple[QueryStats, ...]] = contextvars.ContextVar(
    "cachedrag_streaming_queries", default=())


def _attributed(gen, stats: QueryStats):
    """``gen``'s items; while it computes each one, LLM calls count for ``stats``."""
    try:
        while True:
            token = _streaming_queries.set(_streaming_queries.get() + (stats,))
            try:
                item = next(gen)
            except StopIteration:
                return
            finally:
                _streaming_queries.reset(token)
            yield item
    finally:
        gen.close()  # a consumer that stops early stops the generation too


async def _attributed_async(gen, stats: QueryStats):
    """The async twin of ``_attributed``."""
    try:
        while True:
            token = _streaming_queries.set(_streaming_queries.get() + (stats,))
            try:
                item = await gen.__anext__()
            except StopAsyncIteration:
                return
            finally:
                _streaming_queries.reset(token)
            yield item
    finally:
        await gen.aclose()


_query_spans = _QuerySpans()
get_dispatcher().add_span_handler(_query_spans)
