"""LangChain's standard test suites (langchain-tests) on ChatCachedRAG and CachedRAGRetriever.

The chat suites run on the tiny random engine registered as ``TINY`` (they check shapes and
behaviour, not wording); tool calling and multimodal inputs are declared unsupported, so those
tests skip themselves. Structured output IS supported (grammar-constrained JSON; tested in
test_idioms.py and tests/model/test_constraint.py) but declared off here: the suite's schemas
have free-text strings, which a random-weight byte-level model does not close within the
suite's 16-token cap.
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
        return False

    @property
    def has_structured_output(self) -> bool:
        return False

    @property
    def supports_json_mode(self) -> bool:
        return False

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


class TestChatCachedRAGIntegration(_Declared, ChatModelIntegrationTests):
    @property
    def standard_chat_model_params(self) -> dict:
        return {"max_tokens": 16}  # short answers keep the suite fast

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
