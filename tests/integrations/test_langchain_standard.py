"""LangChain's standard test suites (langchain-tests) on ChatCachedRAG and CachedRAGRetriever.

The chat suites run on the tiny random engine registered as ``TINY`` (they check shapes and
behaviour, not wording); multimodal inputs are declared unsupported, so those tests skip
themselves. Tool calling, tool choice, structured output and JSON mode are on: every test that
the grammar alone decides passes on random weights (a forced call is a valid call, histories
with calls and results render). The tests that need a competent model (the right arguments, a
call chosen under ``auto``, free-text strings closed within the cap, Chinese text copied) are
non-strict xfails. ``TestChatCachedRAGDefaultModel`` (slow) runs the same suite on the default
model; its pass rate on those tests is the figure docs/integrations-langchain.md gives.
"""

from __future__ import annotations

import pytest
from langchain_tests.integration_tests import ChatModelIntegrationTests, RetrieversIntegrationTests
from langchain_tests.unit_tests import ChatModelUnitTests

from cachedrag.integrations.langchain import CachedRAGRetriever, ChatCachedRAG

from .conftest import TINY, TINY_OTHER


@pytest.fixture(autouse=True)
def _tiny_engines(tiny_engine):
    """Registers the tiny engines before the suites build models from plain parameters."""


class _Declared:
    @property
    def chat_model_class(self):
        return ChatCachedRAG

    @property
    def chat_model_params(self) -> dict:
        return {"model": TINY}

    @property
    def has_tool_calling(self) -> bool:
        return True

    @property
    def has_tool_choice(self) -> bool:
        return True

    @property
    def has_structured_output(self) -> bool:
        return True

    @property
    def supports_json_mode(self) -> bool:
        return True

    @property
    def supports_image_inputs(self) -> bool:
        return False

    @property
    def supports_audio_inputs(self) -> bool:
        return False

    @property
    def supports_pdf_inputs(self) -> bool:
        return False

    @property
    def returns_usage_metadata(self) -> bool:
        return True

    @property
    def model_override_value(self) -> str:
        return TINY_OTHER


class TestChatCachedRAGUnit(_Declared, ChatModelUnitTests):
    @pytest.mark.xfail(strict=True, raises=ValueError, reason=(
        "the suite loads with allowed_objects='all', which langchain-core limits to the classes in its own "
        "mapping, so any third-party class is refused after the (passing) snapshot check; the round trip with "
        "allowed_objects=[ChatCachedRAG], as users load it, is tested in test_idioms.py"))
    def test_serdes(self, model, snapshot) -> None:
        super().test_serdes(model, snapshot)


_COMPETENT = ("needs a competent model: random weights (byte tokenizer) make valid but arbitrary calls and JSON, and "
              "the default 135M model passes 5 of these 14 (TestChatCachedRAGDefaultModel)")


_JOKE = _COMPETENT + (" (the pydantic Joke needs both strings closed within the cap; the typeddict and json_schema "
                      "cases pass: XPASS)")


class TestChatCachedRAGIntegration(_Declared, ChatModelIntegrationTests):
    @property
    def standard_chat_model_params(self) -> dict:
        return {"max_tokens": 128}  # a call in the envelope is ~60 bytes before its arguments

    @pytest.mark.parametrize("model", [{}, {"output_version": "v1"}], indirect=True)
    @pytest.mark.xfail(strict=False, reason=_COMPETENT + " (expects exactly one call with input=3)")
    def test_tool_calling(self, model) -> None:
        super().test_tool_calling(model)

    @pytest.mark.xfail(strict=False, reason=_COMPETENT + " (expects exactly one call with input=3)")
    async def test_tool_calling_async(self, model) -> None:
        await super().test_tool_calling_async(model)

    @pytest.mark.parametrize("schema_type", ["pydantic", "typeddict", "json_schema"])
    @pytest.mark.xfail(strict=False, reason=_JOKE)
    def test_structured_output(self, model, schema_type) -> None:
        super().test_structured_output(model, schema_type)

    @pytest.mark.parametrize("schema_type", ["pydantic", "typeddict", "json_schema"])
    @pytest.mark.xfail(strict=False, reason=_JOKE)
    async def test_structured_output_async(self, model, schema_type) -> None:
        await super().test_structured_output_async(model, schema_type)

    @pytest.mark.xfail(strict=False, reason=_COMPETENT + " (the pydantic Joke needs both strings closed)")
    def test_structured_output_pydantic_2_v1(self, model) -> None:
        super().test_structured_output_pydantic_2_v1(model)

    @pytest.mark.xfail(strict=False, reason=_COMPETENT + " (json_mode allows any object; the keys come from the "
                       "prompt)")
    def test_json_mode(self, model) -> None:
        super().test_json_mode(model)

    @pytest.mark.parametrize("model", [{}, {"output_version": "v1"}], indirect=True)
    @pytest.mark.xfail(strict=False, reason=_COMPETENT + " (under auto the model must choose to call the tool)")
    def test_agent_loop(self, model) -> None:
        super().test_agent_loop(model)

    @pytest.mark.xfail(strict=False, reason=_COMPETENT + " (the arguments must copy Chinese text)")
    def test_unicode_tool_call_integration(self, model, *, tool_choice=None, force_tool_call=True) -> None:
        super().test_unicode_tool_call_integration(model, tool_choice=tool_choice, force_tool_call=force_tool_call)

    @property
    def supported_usage_metadata_details(self) -> dict:
        return {"invoke": ["cache_read_input"], "stream": ["cache_read_input"]}

    def invoke_with_cache_read_input(self, *, stream: bool = False):
        model = ChatCachedRAG(model=TINY, max_tokens=4)
        prompt = "A long enough system-free prompt to be cached as a prefix, then a question?"
        model.invoke(prompt)  # the first call fills the cache
        if stream:
            full = None
            for chunk in model.stream(prompt):
                full = chunk if full is None else full + chunk
            return full
        return model.invoke(prompt)


class TestCachedRAGRetriever(RetrieversIntegrationTests):
    @pytest.fixture(autouse=True)
    def _index(self, tiny_index_dir):
        self._index_dir = str(tiny_index_dir)

    @property
    def retriever_constructor(self):
        return CachedRAGRetriever

    @property
    def retriever_constructor_params(self) -> dict:
        return {"index_dir": self._index_dir, "k": 2}

    @property
    def retriever_query_example(self) -> str:
        return "How do I pretty-print JSON?"


@pytest.mark.slow
class TestChatCachedRAGDefaultModel(TestChatCachedRAGIntegration):
    """The integration suite on the default model (SmolLM2-135M-Instruct): the tests that need a
    competent model stay non-strict xfails, and their pass rate here is the figure the LangChain page
    gives (XPASS = passed on the default model)."""

    @property
    def chat_model_params(self) -> dict:
        return {}
