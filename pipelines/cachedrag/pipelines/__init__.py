"""Prebuilt RAG pipelines over the shared chunk cache, with lookahead IVF prefetch.

    base          Pipeline, PipelineConfig, PipelineRun, Step (recording, breakdown)
    hyde          HyDE: hypothetical passage -> retrieve -> answer
    subquestion   SubQuestion: decompose -> batched retrieve -> answer each -> synthesise
    iter_retgen   IterRetGen: N rounds of retrieve(question + last answer) -> generate
    flare         FLARE: sentence look-ahead, retrieve on low token probability, regenerate
    agent         agentic RAG: LangGraph's ReAct agent / LlamaIndex's FunctionAgent with the
                  retriever as their tool (ToolScript: scripted tool_choice per step)
    prompts       PromptTemplate and the default prompts
    parsing       sub-question parsing, sentence cuts, confidence masks (pure Python)
    generators    EngineGenerator (CachedEngine), TransformersGenerator (plain baseline)
    retrievers    LookaheadSearch, FaissDiskSearch (plain baseline), ChunkWarmer
    query_engine  PipelineQueryEngine (LlamaIndex)
    runnable      as_runnable (LangChain)

``HyDE(engine, index).run(question)`` -> ``PipelineRun``; see ``docs/pipelines.md``. Names
import lazily, so ``import cachedrag.pipelines`` loads neither torch nor the frameworks.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "Pipeline": "base",
    "PipelineConfig": "base",
    "PipelineRun": "base",
    "Step": "base",
    "HyDE": "hyde",
    "HyDEConfig": "hyde",
    "SubQuestion": "subquestion",
    "SubQuestionConfig": "subquestion",
    "IterRetGen": "iter_retgen",
    "IterRetGenConfig": "iter_retgen",
    "FLARE": "flare",
    "FLAREConfig": "flare",
    "PromptTemplate": "prompts",
    "parse_subquestions": "parsing",
    "GenerationRequest": "generators",
    "Generation": "generators",
    "EngineGenerator": "generators",
    "TransformersGenerator": "generators",
    "SearchResult": "retrievers",
    "LookaheadSearch": "retrievers",
    "FaissDiskSearch": "retrievers",
    "ChunkWarmer": "retrievers",
    "PipelineQueryEngine": "query_engine",
    "as_runnable": "runnable",
    "ToolScript": "agent",
    "langgraph_agent": "agent",
    "function_agent": "agent",
    "search_tool": "agent",
    "llama_index_search_tool": "agent",
    "ScriptedFunctionAgent": "agent",
}

PIPELINES: dict[str, tuple[str, str]] = {
    "hyde": ("hyde", "HyDE"),
    "subquestion": ("subquestion", "SubQuestion"),
    "iter_retgen": ("iter_retgen", "IterRetGen"),
    "flare": ("flare", "FLARE"),
}

__all__ = sorted([*_EXPORTS, "PIPELINES", "pipeline_class"])


def pipeline_class(name: str):
    """The pipeline class registered as ``name`` (``hyde``, ``subquestion``, ``iter_retgen``, ``flare``)."""
    from cachedrag.errors import ConfigError

    if name not in PIPELINES:
        raise ConfigError(f"unknown pipeline {name!r}; choose from {', '.join(PIPELINES)}")
    module, attr = PIPELINES[name]
    return getattr(importlib.import_module(f"{__name__}.{module}"), attr)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'cachedrag.pipelines' has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
