"""Framework idioms: strict constructor arguments, own tokenizer counts, sampling knobs,
structured output (grammar-constrained JSON), logprobs (tool calling: test_langchain_tools.py)."""

from __future__ import annotations

import pytest
from pydantic import BaseModel, Field

from cachedrag.integrations.langchain import ChatCachedRAG
from cachedrag.integrations.llama_index import CachedRAGLLM

from .conftest import TINY


class Verdict(BaseModel):
    ok: bool
    score: int = Field(ge=0, le=9)
    label: str = Field(json_schema_extra={"enum": ["yes", "no"]})


@pytest.mark.parametrize("kwargs", [{"n": 2}, {"model_kwargs": {"x": 1}}, {"max_new_tokens_typo": 3}])
def test_chat_unknown_arguments_raise(tiny_engine, kwargs):
    with pytest.raises(TypeError, match="unknown argument"):
        ChatCachedRAG(model=TINY, **kwargs)


@pytest.mark.parametrize("kwargs", [{"model_path": "x"}, {"generate_kwargs": {"top_k": 3}}])
def test_llm_unknown_arguments_raise(tiny_engine, kwargs):
    with pytest.raises(TypeError, match="unknown argument"):
        CachedRAGLLM(model=TINY, **kwargs)


def test_get_num_tokens_uses_the_models_tokenizer(tiny_engine):
    chat = ChatCachedRAG(model=TINY)
    assert chat.get_num_tokens("hello") == len(tiny_engine.runner.tokenizer.encode("hello", add_special_tokens=False))
    assert chat.get_num_tokens("hello") == 5  # the byte tokenizer: one token per byte


def test_langchain_structured_output_is_a_valid_object_on_random_weights(tiny_engine):
    chat = ChatCachedRAG(model=TINY, max_tokens=120)
    got = chat.with_structured_output(Verdict).invoke("Is a heap a tree? Answer as JSON.")
    assert isinstance(got, Verdict) and got.label in ("yes", "no") and 0 <= got.score <= 9
    raw = chat.with_structured_output(Verdict, include_raw=True).invoke("Again.")
    assert isinstance(raw["parsed"], Verdict) and raw["parsing_error"] is None
    assert raw["raw"].response_metadata["finish_reason"] == "stop"


def test_langchain_json_mode_and_unsupported_methods(tiny_engine):
    chat = ChatCachedRAG(model=TINY, max_tokens=60)
    msg = chat.bind(response_format={"type": "json_mode"}).invoke("Anything as JSON.")
    assert msg.content.startswith("{")  # an object, valid so far (an unbounded object may hit the token cap)
    if msg.response_metadata["finish_reason"] == "stop":
        import json

        assert isinstance(json.loads(msg.content), dict)
    with pytest.raises(ValueError, match="not supported"):
        chat.with_structured_output(Verdict, method="xml")


def test_langchain_logprobs_and_sampling_knobs(tiny_engine):
    chat = ChatCachedRAG(model=TINY, max_tokens=8, top_k=3, temperature=0.7, seed=1, repetition_penalty=1.3)
    msg = chat.invoke("hi")
    content = msg.response_metadata["logprobs"]["content"]
    assert len(content) == msg.usage_metadata["output_tokens"] and all(c["logprob"] <= 0 for c in content)


def test_llama_index_structured_predict(tiny_engine):
    from llama_index.core.prompts import PromptTemplate

    llm = CachedRAGLLM(model=TINY, max_new_tokens=120, top_k=5, repetition_penalty=1.1)
    got = llm.structured_predict(Verdict, PromptTemplate("Is {thing} sorted? Answer as JSON."), thing="a heap")
    assert isinstance(got, Verdict) and got.label in ("yes", "no")


def test_langchain_serialisation_round_trips_without_secrets(tiny_engine, monkeypatch):
    from langchain_core.load import dumpd, dumps, load, loads

    chat = ChatCachedRAG(model=TINY, temperature=0.7, top_k=5, stop=["\n\n"], max_tokens=12, api_key="sk-secret")
    text = dumps(chat)
    assert "sk-secret" not in text and "CACHEDRAG_API_KEY" in text
    assert dumpd(chat)["id"] == ["cachedrag", "integrations", "langchain", "ChatCachedRAG"]
    monkeypatch.setenv("CACHEDRAG_API_KEY", "sk-secret")
    # langchain-core admits only its own mapping's classes by default (even with "all"): allow ours by name
    again = loads(text, valid_namespaces=["cachedrag"], secrets_from_env=True, allowed_objects=[ChatCachedRAG])
    assert isinstance(again, ChatCachedRAG) and again.model_dump() == chat.model_dump()
    assert again.engine is chat.engine  # the shared engine (and its cache), not a copy
    assert again.invoke("hi").content == chat.invoke("hi").content or chat.temperature > 0
    assert load(dumpd(ChatCachedRAG(model=TINY)), valid_namespaces=["cachedrag"],
                allowed_objects=[ChatCachedRAG]).model_dump() == ChatCachedRAG(model=TINY).model_dump()
