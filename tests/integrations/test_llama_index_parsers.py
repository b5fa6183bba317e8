"""``CachedRAGLLM.predict`` decodes the JSON shape a prompt's output parser expects (tiny random engine:
the grammar alone decides that the text parses), and leaves other prompts unconstrained."""

from __future__ import annotations

import asyncio

import pytest
from llama_index.core.output_parsers import PydanticOutputParser
from llama_index.core.prompts import PromptTemplate
from llama_index.core.question_gen import LLMQuestionGenerator
from llama_index.core.question_gen.types import SubQuestion
from llama_index.core.schema import QueryBundle
from llama_index.core.tools import ToolMetadata
from pydantic import BaseModel

from cachedrag.integrations.llama_index import CachedRAGLLM
from cachedrag.integrations.llama_index_parsers import parser_schema, sub_question_schema

from .conftest import TINY

TOOLS = [ToolMetadata(name="uber_10k", description="Uber's 2021 report"),
         ToolMetadata(name="lyft_10k", description="Lyft's 2021 report")]


class City(BaseModel):
    name: str
    population: int


@pytest.fixture
def llm(tiny_engine):
    return CachedRAGLLM(model=TINY, max_new_tokens=400, temperature=1.0, seed=3)


def test_stock_question_generator_parses_on_random_weights(llm):
    generator = LLMQuestionGenerator.from_defaults(llm=llm)  # LlamaIndex's prompt and parser
    questions = generator.generate(TOOLS, QueryBundle("Compare Uber's and Lyft's revenue growth"))
    assert 1 <= len(questions) <= 4 and all(isinstance(q, SubQuestion) for q in questions)
    assert {q.tool_name for q in questions} <= {"uber_10k", "lyft_10k"}
    again = asyncio.run(generator.agenerate(TOOLS, QueryBundle("Compare Uber's and Lyft's EBITDA")))
    assert again and {q.tool_name for q in again} <= {"uber_10k", "lyft_10k"}


def test_pydantic_parser_prompt_is_decoded_to_its_class(llm):
    parser = PydanticOutputParser(City)
    prompt = PromptTemplate("Name a city in {country}.", output_parser=parser)
    city = City.model_validate_json(llm.predict(prompt, country="France"))
    assert isinstance(city.population, int)


def test_a_prompt_without_a_known_parser_is_not_constrained(llm, monkeypatch):
    seen = []
    monkeypatch.setattr(type(llm), "_json_text", lambda self, *a, **k: seen.append(a) or "")
    text = llm.predict(PromptTemplate("Say something about {topic}."), topic="heaps")
    assert isinstance(text, str) and text and not seen
    assert parser_schema(None, {}) is None


def test_sub_question_schema_names_the_listed_tools_only():
    schema = sub_question_schema(["a", "b"])
    assert schema["properties"]["items"]["items"]["properties"]["tool_name"]["enum"] == ["a", "b"]
    from llama_index.core.question_gen.output_parser import SubQuestionOutputParser

    assert parser_schema(SubQuestionOutputParser(), {"tools_str": "not json"}) == sub_question_schema([])
    assert parser_schema(SubQuestionOutputParser(), {"tools_str": '{"x": "d"}'}) == sub_question_schema(["x"])
