"""Engine registry: canonical names, one engine per model, registered engines shared by both frameworks."""

from __future__ import annotations

import pytest

from cachedrag.integrations.engines import EngineRegistry, canonical_name, engine_name, shared_engine
from cachedrag.model.loader import DEFAULT_MODEL

from .conftest import TINY


@pytest.mark.parametrize("name", [None, "default", "SmolLM2-135M-Instruct", "smollm2-135m-instruct"])
def test_default_aliases(name):
    assert canonical_name(name) == DEFAULT_MODEL


def test_paths_are_absolute_and_ids_pass_through(tmp_path, monkeypatch):
    (tmp_path / "m").mkdir()
    monkeypatch.chdir(tmp_path)
    assert canonical_name("m") == str(tmp_path / "m")
    assert canonical_name("org/some-model") == "org/some-model"


def test_registered_engine_is_shared(tiny_engine):
    assert shared_engine(TINY) is tiny_engine
    assert engine_name(tiny_engine) == TINY


def test_register_replace_remove(tiny_engine):
    reg = EngineRegistry()
    reg.register("x", tiny_engine)
    assert reg.get("x") is tiny_engine and reg.name_of(tiny_engine) == "x"
    reg.remove("x")
    assert reg.name_of(tiny_engine) is None


def test_both_framework_classes_share_one_engine(tiny_engine):
    from cachedrag.integrations.langchain import ChatCachedRAG
    from cachedrag.integrations.llama_index import CachedRAGLLM

    assert CachedRAGLLM(model=TINY).engine is ChatCachedRAG(model=TINY).engine is tiny_engine
    # an engine passed in is used as is, and named after its registry entry
    assert CachedRAGLLM(engine=tiny_engine).model == TINY
