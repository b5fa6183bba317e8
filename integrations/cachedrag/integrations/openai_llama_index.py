"""LlamaIndex LLM for a remote ``cachedrag serve``: ``OpenAILike`` that sends the retrieved chunks.

Owns: ``CachedRAGOpenAILike``, LlamaIndex's ``OpenAILike`` (the OpenAI-compatible LLM of the
``llama-index-llms-openai-like`` package) with defaults for a local ``cachedrag serve`` and an
``httpx`` client (``openai_transport``) that attaches the chunks cachedrag's retrievers or
``CachedRAGNodePostprocessor`` registered as the request's ``cachedrag.chunks`` field, so the
server serves them from its chunk cache at any position; ``structured_predict`` asks the server
for JSON constrained to the output class (``response_format``); it declares itself a function-calling
model (``cachedrag serve`` renders ``tools`` and constrains calls per ``tool_choice``), so
``FunctionAgent`` and the function-calling question generators accept it. Everything else (completion, chat,
streaming, async, query engines) is ``OpenAILike``'s own.

Does not own: the server, chunk registration (``cachedrag.prompt.registry``), in-process generation (``llama_index``).
"""

from __future__ import annotations

from typing import Any

from llama_index.core.types import PydanticProgramMode
from llama_index.llms.openai_like import OpenAILike

from cachedrag.integrations.openai_transport import chunk_async_http_client, chunk_http_client
from cachedrag.prompt.registry import ChunkRegistry


class CachedRAGOpenAILike(OpenAILike):
    """``OpenAILike`` for ``cachedrag serve`` that attaches registered chunks to each request.

    >>> from cachedrag.integrations.openai_llama_index import CachedRAGOpenAILike
    >>> llm = CachedRAGOpenAILike(api_base="http://127.0.0.1:8000/v1")  # doctest: +SKIP
    >>> # with a CachedRAGRetriever (or CachedRAGNodePostprocessor) in the query engine:
    >>> RetrieverQueryEngine.from_args(retriever, llm=llm).query("...")  # doctest: +SKIP
    """

    def __init__(self, model: str = "SmolLM2-135M-Instruct", api_base: str = "http://127.0.0.1:8000/v1",
                 api_key: str = "none", *, chunk_registry: ChunkRegistry | None = None, **kwargs: Any):
        kwargs.setdefault("is_chat_model", True)
        kwargs.setdefault("is_function_calling_model", True)
        kwargs.setdefault("context_window", 8192)
        kwargs.setdefault("http_client", chunk_http_client(chunk_registry))
        kwargs.setdefault("async_http_client", chunk_async_http_client(chunk_registry))
        super().__init__(model=model, api_base=api_base, api_key=api_key, **kwargs)

    @classmethod
    def class_name(cls) -> str:
        return "CachedRAGOpenAILike"

    def _should_use_structure_outputs(self) -> bool:
        """``structured_predict`` sends the output class as a ``response_format`` JSON schema:
        ``cachedrag serve`` constrains decoding to it for any model (``OpenAILike`` only does so
        for OpenAI's own model names and otherwise parses free text)."""
        return self.pydantic_program_mode == PydanticProgramMode.DEFAULT
