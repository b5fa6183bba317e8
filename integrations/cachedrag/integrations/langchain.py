"""LangChain integration: a chat model and a retriever that share chunk caches.

Owns the LangChain adapters (thin: the work is in ``generator``, ``search``, ``cachedrag.prompt``):

- ``ChatCachedRAG`` (``BaseChatModel``): ``_generate``/``_stream`` and real async
  ``_agenerate``/``_astream`` (work on a worker thread; streams through an
  ``asyncio.Queue``); the standard parameters as fields (``model``, ``temperature``,
  ``max_tokens``, ``stop``, ``timeout``, ``max_retries``); ``usage_metadata`` (cached prompt
  tokens as ``input_token_details.cache_read``) and ``response_metadata`` with ``model_name``
  and the engine's cache stats. Messages are rendered with the tokenizer's chat template into
  one string; registered chunk texts found in it (in any message) are served from the chunk
  caches, the rest is computed. Tool calling: ``bind_tools(tools, tool_choice=...,
  parallel_tool_calls=..., strict=...)``; the tools, ``AIMessage.tool_calls`` and
  ``ToolMessage`` results of a history are rendered in the template's own tool format (or the
  generic envelope), the answer is grammar-constrained per ``tool_choice`` (``cachedrag.prompt``
  tool modules) and parsed into ``AIMessage.tool_calls`` / streamed ``tool_call_chunks`` (name
  first, then argument deltas). ``with_structured_output`` with ``function_calling``,
  ``json_schema`` or ``json_mode``.
- ``CachedRAGRetriever`` (``BaseRetriever``) over an index directory with ``k``, returning
  ``Document``s (id = chunk id; metadata: chunk id, doc id, score, rank, offsets) and
  registering their texts.

Does not own: generation, search or the registries (the shared helper modules).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any

from langchain_core.callbacks import (
    AsyncCallbackManagerForLLMRun,
    AsyncCallbackManagerForRetrieverRun,
    CallbackManagerForLLMRun,
    CallbackManagerForRetrieverRun,
)
from langchain_core.documents import Document
from langchain_core.language_models import BaseChatModel
from langchain_core.language_models.base import LangSmithParams
from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessage, ToolMessage
from langchain_core.messages import ChatMessage as LCChatMessage
from langchain_core.messages.tool import tool_call, tool_call_chunk
from langchain_core.messages.ai import UsageMetadata
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult
from langchain_core.retrievers import BaseRetriever
from pydantic import Field, PrivateAttr, SecretStr

from cachedrag.config import FidelityName
from cachedrag.integrations.engines import engine_name, fidelity_engine, load_engine, shared_engine
from cachedrag.integrations.generator import Answer, ChunkAwareGenerator, ToolRequest, json_constraint, sampling_params
from cachedrag.integrations.search import shared_searcher
from cachedrag.integrations.speculation import pipelining_option
from cachedrag.integrations.worker import run_in_worker, stream_in_worker
from cachedrag.model.loader import DEFAULT_MODEL
from cachedrag.prompt.registry import ChunkRegistry
from cachedrag.prompt.registry import chunk_registry as _default_registry
from cachedrag.prompt.template import Message
from cachedrag.prompt.toolparse import ArgumentsDelta, CallStarted, TextDelta
from cachedrag.prompt.tools import ToolCall
from cachedrag.retrieval.config import PipeliningConfig

__all__ = ["ChatCachedRAG", "CachedRAGRetriever"]


class ChatCachedRAG(BaseChatModel):
    """A LangChain chat model that reuses the KV caches of retrieved chunks.

    >>> from langchain_core.output_parsers import StrOutputParser
    >>> from langchain_core.prompts import ChatPromptTemplate
    >>> from langchain_core.runnables import RunnablePassthrough
    >>> from cachedrag.integrations.langchain import CachedRAGRetriever, ChatCachedRAG
    >>> retriever = CachedRAGRetriever(index_dir="my-index", k=4)                    # doctest: +SKIP
    >>> prompt = ChatPromptTemplate.from_template("Context:\\n{context}\\n\\nQuestion: {question}")
    >>> format_docs = lambda docs: "\\n\\n".join(d.page_content for d in docs)
    >>> chain = ({"context": retriever | format_docs, "question": RunnablePassthrough()}  # doctest: +SKIP
    ...          | prompt | ChatCachedRAG(max_tokens=64) | StrOutputParser())
    >>> chain.invoke("How do I pretty-print JSON?")                                      # doctest: +SKIP

    ``model=`` names an HF id or local path (one engine per model per process, shared with
    ``CachedRAGLLM``), or a name given to ``register_engine``; ``engine=`` passes an existing
    ``CachedEngine`` to share its cache. A ``model`` keyword at call time selects another
    shared engine for that call.
    """

    model: str = Field(default=DEFAULT_MODEL, description="HF model id, local path, .gguf file, the embedded default's "
                       "name, or a name registered with register_engine")
    temperature: float = Field(default=0.0, ge=0.0, description="sampling temperature; 0 = greedy")
    max_tokens: int | None = Field(default=256, ge=1, description="upper bound on generated tokens (None = 256)")
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, description="nucleus sampling mass")
    top_k: int = Field(default=0, ge=0, description="sample among the k most likely tokens; 0 = no limit")
    repetition_penalty: float = Field(default=1.0, gt=0.0, description="> 1 discourages repeating generated "
                                      "tokens (stops small models from looping until the token cap)")
    stop: list[str] | None = Field(default=None, description="stop strings; the answer ends before them")
    seed: int | None = Field(default=None, description="sampling seed (None = nondeterministic when sampling)")
    timeout: float | None = Field(default=None, gt=0, description="seconds a generation may take (checked between "
                                  "tokens; TimeoutError when exceeded)")
    max_retries: int = Field(default=2, ge=0, description="accepted for LangChain's standard parameters; local "
                             "generation has no transient failures to retry, so no retries are made")
    api_key: SecretStr | None = Field(default=None, description="accepted for LangChain's standard parameters; "
                                      "a local model needs no key")
    streaming: bool = Field(default=False, description="invoke() streams internally (callbacks get tokens)")
    reuse_mode: str | None = Field(default=None, description="chunk reuse mode: full, prefix, naive, random or "
                                   "cachedrag (None = the engine's)")
    share_engine: bool = Field(default=True, description="use the process-wide engine of `model` "
                               "(False: load a private one)")
    fidelity: FidelityName | None = Field(
        default=None, description="a fidelity level, as `cachedrag serve --fidelity`: exact, faithful, guarded, "
        "balanced or fast (docs/fidelity.md); the engine at that level on the same weights, with a chunk cache of "
        "its own (None = the engine as configured)")

    _engine: Any = PrivateAttr(default=None)
    _generator: ChunkAwareGenerator = PrivateAttr(default=None)
    _registry: ChunkRegistry = PrivateAttr(default=None)

    def __init__(self, *, engine=None, chunk_registry: ChunkRegistry | None = None, **kwargs: Any):
        # unknown arguments raise (they were silently dropped: n=2, model_kwargs=...)
        unknown = sorted(set(kwargs) - set(type(self).model_fields) - {"callbacks", "tags", "metadata"})
        if unknown:
            raise TypeError(f"ChatCachedRAG got unknown argument(s) {', '.join(unknown)}; "
                            f"known: {', '.join(sorted(type(self).model_fields))}")
        if engine is not None and "model" not in kwargs:
            kwargs["model"] = engine_name(engine)
        super().__init__(**kwargs)
        if engine is None:
            engine = load_engine(self.model, self.share_engine, self.fidelity)
        elif self.fidelity is not None:
            engine = fidelity_engine(engine, self.fidelity)
        self._engine = engine
        self._registry = _default_registry() if chunk_registry is None else chunk_registry
        self._generator = ChunkAwareGenerator(engine, self._registry)

    @property
    def engine(self):
        """The ``CachedEngine`` (its ``stats()`` show the cache as a whole)."""
        return self._engine

    @property
    def _llm_type(self) -> str:
        return "cachedrag"

    @classmethod
    def is_lc_serializable(cls) -> bool:
        """``dumpd``/``dumps`` write the constructor arguments; ``load`` rebuilds the model (its
        engine comes from the process-wide registry again, so the cache is shared, not copied)."""
        return True

    @classmethod
    def get_lc_namespace(cls) -> list[str]:
        return ["cachedrag", "integrations", "langchain"]

    @property
    def lc_secrets(self) -> dict[str, str]:
        return {"api_key": "CACHEDRAG_API_KEY"}  # never written out; read back from the environment

    def get_num_tokens(self, text: str) -> int:
        """Tokens of ``text`` under the model's own tokenizer (never LangChain's GPT-2 fallback)."""
        return len(self._engine.runner.tokenizer.encode(text, add_special_tokens=False))

    def get_token_ids(self, text: str) -> list[int]:
        return list(self._engine.runner.tokenizer.encode(text, add_special_tokens=False))

    def bind_tools(self, tools: Sequence[Any], *, tool_choice: Any = None, parallel_tool_calls: bool | None = None,
                   strict: bool | None = None, **kwargs: Any):
        """The model with ``tools`` (pydantic classes, functions, ``BaseTool``s or OpenAI dicts) bound.

        ``tool_choice``: None / ``"auto"`` (text or calls), ``"none"``, ``"any"`` / ``"required"`` /
        True (calls only), or a tool's name; the answer is grammar-constrained accordingly, so a
        required call is always a call valid for its schema. ``parallel_tool_calls=False``: at most
        one call per answer. ``strict`` is passed to ``convert_to_openai_tool`` (the grammar
        enforces the schema either way).
        """
        from langchain_core.utils.function_calling import convert_to_openai_tool

        formatted = [convert_to_openai_tool(t, strict=strict) for t in tools]
        ToolRequest.of(formatted, tool_choice, parallel_tool_calls)  # fail here on a bad choice, not at invoke
        bound: dict[str, Any] = {"tools": formatted, **kwargs}
        if tool_choice is not None:
            bound["tool_choice"] = tool_choice
        if parallel_tool_calls is not None:
            bound["parallel_tool_calls"] = parallel_tool_calls
        return self.bind(**bound)

    def with_structured_output(self, schema=None, *, method: str = "json_schema", include_raw: bool = False,
                               strict: bool | None = None, **kwargs: Any):
        """Output parsed into ``schema`` (a pydantic class, a TypedDict or a JSON schema dict).

        Decoding is constrained by the schema's grammar over the model's vocabulary, so the JSON
        is valid whatever the model size. ``json_schema``: the answer is the JSON;
        ``function_calling``: the answer is a forced call of a tool whose parameters are the
        schema (parsed from ``AIMessage.tool_calls``); ``json_mode`` constrains to any JSON
        object (``schema`` then only picks the parser). ``strict`` is accepted (the grammar always
        enforces the schema).
        """
        from langchain_core.output_parsers import JsonOutputParser, PydanticOutputParser
        from langchain_core.utils.function_calling import convert_to_json_schema
        from langchain_core.utils.pydantic import is_basemodel_subclass

        if kwargs:
            raise TypeError(f"with_structured_output got unknown argument(s) {', '.join(sorted(kwargs))}")
        if method not in ("json_schema", "json_mode", "function_calling"):
            raise ValueError(f"method={method!r} is not supported; use 'function_calling', 'json_schema' or "
                             f"'json_mode'")
        if method != "json_mode" and schema is None:
            raise ValueError(f"with_structured_output(method={method!r}) needs a schema")
        pydantic_cls = schema if isinstance(schema, type) and is_basemodel_subclass(schema) else None
        if method == "function_calling":
            return _with_raw(*_function_calling(self, schema, pydantic_cls, strict), include_raw)
        json_schema = None if method == "json_mode" else convert_to_json_schema(schema)
        llm = self.bind(response_format={"type": method, "schema": json_schema}, ls_structured_output_format={
            "kwargs": {"method": method, "strict": strict},
            "schema": convert_to_json_schema(schema) if schema is not None else None})
        parser = PydanticOutputParser(pydantic_object=pydantic_cls) if pydantic_cls else JsonOutputParser()
        return _with_raw(llm, parser, include_raw)

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return {"model": self.model, "temperature": self.temperature, "max_tokens": self.max_tokens,
                "top_p": self.top_p, "reuse_mode": self.reuse_mode, "fidelity": self.fidelity}

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> LangSmithParams:
        params = super()._get_ls_params(stop=stop, **kwargs)
        params["ls_provider"] = "cachedrag"
        params["ls_model_name"] = kwargs.get("model") or self.model
        if stop or self.stop:
            params["ls_stop"] = list(stop or self.stop)
        return params

    # ------------------------------------------------------------------ sync
    def _generate(self, messages: list[BaseMessage], stop: list[str] | None = None,
                  run_manager: CallbackManagerForLLMRun | None = None, **kwargs: Any) -> ChatResult:
        model, generator = self._generator_for(kwargs)
        tools = _tool_request(kwargs)
        answer = generator.generate(generator.render_messages(_messages(messages), tools and tools.tools),
                                    self._params(stop, kwargs, tools), mode=kwargs.get("mode", self.reuse_mode),
                                    timeout=self.timeout)
        content, calls = answer.text, []
        parser = tools.parser(generator.engine) if tools else None
        if parser is not None:
            events = parser.feed(answer.text) + parser.finish()
            content = "".join(e.text for e in events if isinstance(e, TextDelta))
            calls = [tool_call(name=c.name, args=c.args, id=c.id) for c in parser.calls]
        message = AIMessage(content=content, tool_calls=calls, usage_metadata=_usage(answer),
                            response_metadata=_response_metadata(model, answer))
        generation = ChatGeneration(message=message, generation_info={"finish_reason": answer.finish_reason})
        return ChatResult(generations=[generation], llm_output={"model_name": model})

    def _stream(self, messages: list[BaseMessage], stop: list[str] | None = None,
                run_manager: CallbackManagerForLLMRun | None = None, **kwargs: Any) -> Iterator[ChatGenerationChunk]:
        model, generator = self._generator_for(kwargs)
        tools = _tool_request(kwargs)
        stream = generator.stream(generator.render_messages(_messages(messages), tools and tools.tools),
                                  self._params(stop, kwargs, tools), mode=kwargs.get("mode", self.reuse_mode),
                                  timeout=self.timeout)
        parser = tools.parser(generator.engine) if tools else None
        try:
            for delta in stream:
                for chunk in _chunks(parser.feed(delta) if parser is not None else [TextDelta(delta)]):
                    if run_manager is not None:
                        run_manager.on_llm_new_token(chunk.text, chunk=chunk)
                    yield chunk
            for chunk in _chunks(parser.finish() if parser is not None else []):
                yield chunk
        finally:
            stream.close()
        answer = stream.answer
        yield ChatGenerationChunk(
            message=AIMessageChunk(content="", usage_metadata=_usage(answer), chunk_position="last",
                                   response_metadata=_response_metadata(model, answer)),
            generation_info={"finish_reason": answer.finish_reason},
        )

    # ------------------------------------------------------------------ async (worker thread)
    async def _agenerate(self, messages: list[BaseMessage], stop: list[str] | None = None,
                         run_manager: AsyncCallbackManagerForLLMRun | None = None, **kwargs: Any) -> ChatResult:
        return await run_in_worker(self._generate, messages, stop, None, **kwargs)

    async def _astream(self, messages: list[BaseMessage], stop: list[str] | None = None,
                       run_manager: AsyncCallbackManagerForLLMRun | None = None,
                       **kwargs: Any) -> AsyncIterator[ChatGenerationChunk]:
        async for chunk in stream_in_worker(lambda: self._stream(messages, stop, None, **kwargs)):
            if run_manager is not None and chunk.text:
                await run_manager.on_llm_new_token(chunk.text, chunk=chunk)
            yield chunk

    # ------------------------------------------------------------------ helpers
    def _generator_for(self, kwargs: dict) -> tuple[str, ChunkAwareGenerator]:
        """The call's model name and generator (a ``model`` keyword selects another shared engine)."""
        model = kwargs.get("model")
        if not model or model == self.model:
            return self.model, self._generator
        return model, ChunkAwareGenerator(shared_engine(model), self._registry)

    def _params(self, stop: list[str] | None, kwargs: dict, tools: ToolRequest | None = None):
        max_tokens = kwargs.get("max_tokens", kwargs.get("max_new_tokens", self.max_tokens))
        constraint = None
        response_format = kwargs.get("response_format")
        engine = self._generator_for(kwargs)[1].engine
        if response_format and tools is not None and tools.choice.mode != "none":
            raise ValueError("tools with a tool_choice other than 'none' and a response_format cannot be combined")
        if response_format:
            constraint = json_constraint(response_format, engine)
        elif tools is not None:
            constraint = tools.constraint(engine)
        return sampling_params(
            max_new_tokens=max_tokens or 256, temperature=kwargs.get("temperature", self.temperature),
            top_p=kwargs.get("top_p", self.top_p), stop=list(self.stop or []) + list(stop or []),
            seed=kwargs.get("seed", self.seed), top_k=kwargs.get("top_k", self.top_k),
            repetition_penalty=kwargs.get("repetition_penalty", self.repetition_penalty), constraint=constraint,
        )


class CachedRAGRetriever(BaseRetriever):
    """Retrieve chunks from a cachedrag index directory as ``Document``s; their texts become cacheable chunks.

    >>> retriever = CachedRAGRetriever(index_dir="my-index", k=4)            # doctest: +SKIP
    >>> [d.id for d in retriever.invoke("How do I pretty-print JSON?")]        # doctest: +SKIP
    ['stdlib/json#0', ...]

    ``invoke(query, k=...)`` overrides ``k`` per call; ``prefetch(original_query)`` starts the
    lookahead prefetch before a query transformation (HyDE, multi-query...) runs.
    ``pipelining=True``: speculative pipelining (``integrations.speculation``).
    """

    index_dir: str = Field(description="index directory written by `cachedrag index build`")
    k: int = Field(default=4, ge=1, description="documents returned per query")
    nprobe: int | None = Field(default=None, ge=1, description="IVF clusters probed (None = 16, capped at nlist)")
    pipelining: bool | PipeliningConfig = Field(
        default=False, description="speculative pipelining: staged search while the chat model's engine prefills "
        "the intermediate top-k in the shape of its previous prompt (same documents and answers)")

    _searcher: Any = PrivateAttr(default=None)
    _pipelining: Any = PrivateAttr(default=None)
    _last_speculation: dict | None = PrivateAttr(default=None)

    def __init__(self, *, chunk_registry: ChunkRegistry | None = None, **kwargs: Any):
        super().__init__(**kwargs)
        self._searcher = shared_searcher(self.index_dir, chunk_registry)
        self._pipelining = pipelining_option(self.pipelining)

    @property
    def last_speculation(self) -> dict | None:
        """What the latest pipelined retrieval speculated (stages, kept chunks, wasted tokens)."""
        return self._last_speculation

    def prefetch(self, original_query: str) -> bool:
        """Start moving the IVF clusters nearest ``original_query`` to the fast tier; returns at once."""
        return self._searcher.prefetch(original_query)

    def _get_relevant_documents(self, query: str, *, run_manager: CallbackManagerForRetrieverRun,
                                **kwargs: Any) -> list[Document]:
        k = int(kwargs.get("k", self.k))
        if self._pipelining is None:
            hits = self._searcher.search(query, k=k, nprobe=self.nprobe)
        else:
            hits, self._last_speculation = self._pipelining.search(self._searcher, query, k, self.nprobe)
        return [Document(id=h.chunk_id, page_content=h.text, metadata=h.metadata()) for h in hits]

    async def _aget_relevant_documents(self, query: str, *, run_manager: AsyncCallbackManagerForRetrieverRun,
                                       **kwargs: Any) -> list[Document]:
        return await run_in_worker(self._get_relevant_documents, query, run_manager=None, **kwargs)


# ---------------------------------------------------------------------- helpers
def _messages(messages: list[BaseMessage]) -> list[Message]:
    out = []
    for m in messages:
        role = m.role if isinstance(m, LCChatMessage) else m.type
        if isinstance(m, AIMessage) and m.tool_calls:
            calls = tuple(ToolCall.of(c["name"], c.get("args") or {}, c.get("id")) for c in m.tool_calls)
            out.append(Message(role, _text(m), tool_calls=calls))
        elif isinstance(m, ToolMessage):
            out.append(Message("tool", _tool_text(m), tool_call_id=m.tool_call_id, name=m.name))
        else:
            out.append(Message(role, _text(m)))
    return out


def _tool_text(message: ToolMessage) -> str:
    """A tool result's text (non-text content JSON-dumped; an error status said)."""
    try:
        text = _text(message)
    except ValueError:
        text = json.dumps(message.content, ensure_ascii=False, default=str)
    return f"Error: {text}" if message.status == "error" else text


def _tool_request(kwargs: dict) -> ToolRequest | None:
    return ToolRequest.of(kwargs.get("tools"), kwargs.get("tool_choice"), kwargs.get("parallel_tool_calls"))


def _chunks(events) -> Iterator[ChatGenerationChunk]:
    """Stream chunks of parser events: text deltas as content, calls as ``tool_call_chunks``."""
    for e in events:
        if isinstance(e, TextDelta) and e.text:
            yield ChatGenerationChunk(message=AIMessageChunk(content=e.text))
        elif isinstance(e, CallStarted):
            yield ChatGenerationChunk(message=AIMessageChunk(content="", tool_call_chunks=[
                tool_call_chunk(name=e.name, args="", id=e.id, index=e.index)]))
        elif isinstance(e, ArgumentsDelta):
            yield ChatGenerationChunk(message=AIMessageChunk(content="", tool_call_chunks=[
                tool_call_chunk(args=e.text, index=e.index)]))


def _function_calling(llm: ChatCachedRAG, schema, pydantic_cls, strict: bool | None):
    """The bound model and the parser of ``with_structured_output(method="function_calling")``."""
    from langchain_core.output_parsers.openai_tools import JsonOutputKeyToolsParser, PydanticToolsParser
    from langchain_core.utils.function_calling import convert_to_json_schema, convert_to_openai_tool

    name = convert_to_openai_tool(schema)["function"]["name"]
    bound = llm.bind_tools([schema], tool_choice=name, parallel_tool_calls=False, strict=strict,
                           ls_structured_output_format={"kwargs": {"method": "function_calling", "strict": strict},
                                                        "schema": convert_to_json_schema(schema)})
    if pydantic_cls is not None:
        return bound, PydanticToolsParser(tools=[pydantic_cls], first_tool_only=True)
    return bound, JsonOutputKeyToolsParser(key_name=name, first_tool_only=True)


def _with_raw(llm, parser, include_raw: bool):
    from langchain_core.runnables import RunnableLambda, RunnableMap, RunnablePassthrough

    if not include_raw:
        return llm | parser

    def parse(raw):
        try:
            return {"parsed": parser.invoke(raw), "parsing_error": None}
        except Exception as exc:  # noqa: BLE001 - LangChain's include_raw contract reports it
            return {"parsed": None, "parsing_error": exc}

    return RunnableMap(raw=llm) | RunnablePassthrough.assign(**{
        "parsed": RunnableLambda(lambda x: parse(x["raw"])["parsed"]),
        "parsing_error": RunnableLambda(lambda x: parse(x["raw"])["parsing_error"])})


def _text(message: BaseMessage) -> str:
    content = message.content
    if isinstance(content, str):
        return content
    parts = []
    for block in content:
        if isinstance(block, str):
            parts.append(block)
        elif isinstance(block, dict) and block.get("type") == "text":
            parts.append(block.get("text", ""))
        elif isinstance(block, dict) and block.get("type") in ("tool_use", "tool_call", "reasoning", "thinking"):
            continue  # not text for the model to read back
        else:
            kind = block.get("type") if isinstance(block, dict) else type(block).__name__
            raise ValueError(f"ChatCachedRAG handles text only; the message has a {kind!r} block")
    return "".join(parts)


def _usage(answer: Answer) -> UsageMetadata:
    return UsageMetadata(input_tokens=answer.input_tokens, output_tokens=answer.output_tokens,
                         total_tokens=answer.input_tokens + answer.output_tokens,
                         input_token_details={"cache_read": answer.cached_tokens})


def _response_metadata(model: str, answer: Answer) -> dict:
    tokenizer_decode = answer.decode_token
    return {"model_name": model, "finish_reason": answer.finish_reason,
            "logprobs": {"content": [{"token": tokenizer_decode(t), "logprob": lp}
                                     for t, lp in zip(answer.result.token_ids, answer.result.token_logprobs)]},
            "cache": answer.stats()}
