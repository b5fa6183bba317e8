"""``fidelity=`` on ``ChatCachedRAG`` and ``CachedRAGLLM``: the shared engine at that level, on the
same weights (one engine per model and level, shared by both classes), the level's settings."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from cachedrag.integrations.langchain import ChatCachedRAG
from cachedrag.integrations.llama_index import CachedRAGLLM

from .conftest import TINY


def test_fidelity_level_engine_shares_weights_and_is_shared(tiny_engine):
    chat = ChatCachedRAG(model=TINY, fidelity="exact")
    llm = CachedRAGLLM(model=TINY, fidelity="exact")
    assert chat.engine is llm._engine is not tiny_engine  # one engine per model and level
    assert chat.engine.runner is tiny_engine.runner  # the weights are not loaded again
    assert chat.engine.config.fidelity == "exact" and chat.engine.config.mode == "prefix"
    faithful = ChatCachedRAG(engine=tiny_engine, fidelity="faithful").engine
    assert faithful.config.cache.exact.tie_guard == 0.25 and faithful.manager is not tiny_engine.manager
    assert ChatCachedRAG(model=TINY).engine is tiny_engine  # no level: the engine as configured


def test_fidelity_answers_like_its_engine(tiny_engine):
    chat = ChatCachedRAG(model=TINY, fidelity="exact", max_tokens=4)
    out = chat.invoke("Say something.")
    assert out.response_metadata["cache"]["mode"] == "prefix"


@pytest.mark.parametrize("cls", [ChatCachedRAG, CachedRAGLLM])
def test_unknown_fidelity_level_is_refused(cls, tiny_engine):
    with pytest.raises(ValidationError):
        cls(model=TINY, fidelity="sloppy")
