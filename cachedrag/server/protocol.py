"""The OpenAI wire format the server speaks: request models, response bodies, error shape.

Owns: pydantic models of the ``/v1/chat/completions`` and ``/v1/completions`` request bodies
(the fields we honour, validated: sampling, penalties, ``response_format``, ``tools`` /
``tool_choice``, ``logprobs``; unknown OpenAI fields are accepted and ignored, as vLLM does), the
``cachedrag`` extension field, builders of the JSON response and SSE chunk bodies
with ``usage`` (``prompt_tokens_details.cached_tokens`` = prompt tokens served from the chunk
cache), and ``APIError`` with OpenAI's error body ``{"error": {"message", "type", "param",
"code"}}``. Does not own: routing (``app``), generation (``loop``).
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class APIError(Exception):
    """An error answered in OpenAI's shape with ``status``."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class CachedRAGExtension(BaseModel):
    """The ``"cachedrag"`` request field: texts of the prompt to serve as reusable chunks."""

    model_config = ConfigDict(extra="forbid")

    chunks: list[str] = Field(default_factory=list, description="retrieved texts that occur verbatim in the prompt")


class JsonSchemaFormat(BaseModel):
    """``response_format.json_schema``: the schema the answer must follow (OpenAI's structured outputs)."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)

    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema", description="the JSON schema (absent: any JSON object)")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """``response_format``: free text, any JSON object, or JSON valid for a schema."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self):
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("type 'json_schema' needs a 'json_schema' object with a name and a schema")
        return self


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="allow")

    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: NamedFunction


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    n: int = Field(1, ge=1, le=128, description="choices, decoded from one prefill of the prompt")
    stop: str | list[str] | None = None
    seed: int | None = None
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    response_format: ResponseFormat | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    cachedrag: CachedRAGExtension | None = None

    @field_validator("stop")
    @classmethod
    def _stop(cls, value):
        if isinstance(value, list):
            if len(value) > 4:
                raise ValueError("at most 4 stop sequences")
            value = [s for s in value if s]
        return value or None

    @property
    def new_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.get("include_usage"))


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="allow")

    name: str
    arguments: str | dict[str, Any] = Field("{}", description="the call's arguments: a JSON object as text "
                                                           "(or as an object)")


class ToolCallItem(BaseModel):
    """An assistant message's ``tool_calls[i]``: kept with its ``id`` (the tool message answering it
    names it in ``tool_call_id``)."""

    model_config = ConfigDict(extra="allow")

    id: str = ""
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[ToolCallItem] | None = None  # an assistant turn that called tools
    tool_call_id: str | None = None  # a tool message: the call it answers

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.get("type") != "text":
                raise ValueError(f"only text content parts are supported, got {part.get('type')!r}")
            parts.append(str(part.get("text", "")))
        return "".join(parts)


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)

    @field_validator("top_logprobs")
    @classmethod
    def _top_needs_logprobs(cls, value, info):
        if value and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs: true")
        return value

    @property
    def logprob_alternatives(self) -> int | None:
        """None: no logprobs; else how many alternatives per token."""
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(_Sampling):
    prompt: str | list[str]
    logprobs: int | None = Field(None, ge=0, le=5)

    @property
    def logprob_alternatives(self) -> int | None:
        return self.logprobs

    def text(self) -> str:
        if isinstance(self.prompt, list):
            if len(self.prompt) != 1:
                raise APIError(400, "only one prompt per request is served", param="prompt")
            return self.prompt[0]
        return self.prompt


class EmbeddingRequest(BaseModel):
    """``/v1/embeddings``: texts to embed with the server's embedder (token-id inputs are not served)."""

    model_config = ConfigDict(extra="allow")

    model: str
    input: str | list[str] = Field(description="a text or a list of texts (each non-empty)")
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)

    @field_validator("input")
    @classmethod
    def _texts(cls, value):
        texts = [value] if isinstance(value, str) else value
        if not texts:
            raise ValueError("nothing to embed: input is empty")
        if len(texts) > 2048:
            raise ValueError("at most 2048 inputs per request")
        if any(not t for t in texts):
            raise ValueError("inputs must be non-empty strings")
        return value

    @property
    def texts(self) -> list[str]:
        return [self.input] if isinstance(self.input, str) else list(self.input)


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def chat_logprobs(records, decode) -> dict:
    """Chat ``logprobs``: ``{"content": [{token, logprob, bytes, top_logprobs}]}`` of ``records``
    (``TokenLogprob``s; ``decode(id)`` -> the token's text)."""
    def entry(token: int, logprob: float) -> dict:
        text = decode(token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return {"content": [{**entry(r.token, r.logprob), "top_logprobs": [entry(t, lp) for t, lp in r.top]}
                        for r in records]}


def completion_logprobs(records, decode, offset: int = 0) -> dict:
    """Legacy completion ``logprobs``: ``tokens``, ``token_logprobs``, ``top_logprobs`` (a
    ``{token: logprob}`` per position) and ``text_offset`` (from ``offset``)."""
    tokens = [decode(r.token) for r in records]
    offsets, at = [], offset
    for t in tokens:
        offsets.append(at)
        at += len(t)
    return {"tokens": tokens, "token_logprobs": [r.logprob for r in records],
            "top_logprobs": [{decode(t): lp for t, lp in r.top} for r in records], "text_offset": offsets}


def served(stats: dict) -> dict:
    """The ``cachedrag`` extension object of a finished response: how its prompt was served
    (``approximations``: what made it differ from full prefill, empty = exact; chunk hits and
    misses; ``exact_repeat``, ``first_token_gap``, ``tie_guard``, ``segment_actions``,
    ``tie_guard_actions``, ``tie_guard_switch``, ``tie_guard_agreed`` and ``tie_guard_rewound`` as
    ``EngineResult`` names them). OpenAI clients ignore it;
    ``response.model_extra["cachedrag"]`` reads it with the ``openai`` package."""
    return {"approximations": list(stats.get("approximations", [])), "chunks_hit": stats.get("chunks_hit", 0),
            "chunks_missed": stats.get("chunks_missed", 0), "exact_repeat": stats.get("exact_repeat"),
            "first_token_gap": stats.get("first_token_gap"), "tie_guard": stats.get("tie_guard"),
            "segment_actions": list(stats.get("segment_actions", [])),
            "tie_guard_actions": stats.get("tie_guard_actions"),
            "tie_guard_switch": stats.get("tie_guard_switch"), "tie_guard_agreed": stats.get("tie_guard_agreed"),
            "tie_guard_rewound": stats.get("tie_guard_rewound")}


def call_id() -> str:
    """A fresh tool call id (``call_`` + 24 hex digits, the shape OpenAI's ids have)."""
    return f"call_{uuid.uuid4().hex[:24]}"


def chat_response(rid: str, model: str, choices: list[dict], use: dict) -> dict:
    """A ``chat.completion`` body; ``choices``: ``chat_choice`` dicts."""
    return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": choices, "usage": use}


def chat_choice(index: int, message: dict, finish_reason: str, logprobs: dict | None = None) -> dict:
    return {"index": index, "message": message, "finish_reason": finish_reason, "logprobs": logprobs}


def chat_chunk(rid: str, model: str, delta: dict, finish_reason: str | None = None,
               use: dict | None = None, choices: bool = True, logprobs: dict | None = None, index: int = 0) -> dict:
    body = {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()), "model": model,
            "choices": [{"index": index, "delta": delta, "finish_reason": finish_reason, "logprobs": logprobs}]
            if choices else []}
    if use is not None:
        body["usage"] = use
    return body


def completion_response(rid: str, model: str, choices: list[dict], use: dict) -> dict:
    """A ``text_completion`` body; ``choices``: ``completion_choice`` dicts."""
    return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": choices, "usage": use}


def completion_choice(index: int, text: str, finish_reason: str | None, logprobs: dict | None = None) -> dict:
    return {"index": index, "text": text, "finish_reason": finish_reason, "logprobs": logprobs}


def completion_chunk(rid: str, model: str, text: str, finish_reason: str | None = None,
                     use: dict | None = None, choices: bool = True, logprobs: dict | None = None,
                     index: int = 0) -> dict:
    body = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [completion_choice(index, text, finish_reason, logprobs)] if choices else []}
    if use is not None:
        body["usage"] = use
    return body


def embeddings_response(model: str, vectors, prompt_tokens: int, encoding: str) -> dict:
    """A ``/v1/embeddings`` body of ``vectors`` (float32 ``[N, d]``): floats, or base64 of their
    little-endian float32 bytes (what the ``openai`` package decodes)."""
    import base64

    import numpy as np

    def encode(row):
        if encoding == "base64":
            return base64.b64encode(np.asarray(row, dtype="<f4").tobytes()).decode("ascii")
        return [float(x) for x in row]

    return {"object": "list", "model": model,
            "data": [{"object": "embedding", "index": i, "embedding": encode(row)} for i, row in enumerate(vectors)],
            "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}}
