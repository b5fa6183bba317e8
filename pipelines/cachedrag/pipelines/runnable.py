"""LangChain adapter: a pipeline as a runnable.

Owns: ``as_runnable(pipeline, output=...)`` -> a ``RunnableLambda`` named after the
pipeline. Input: a question string, or a dict with ``question`` (or ``input``/``query``).
Output: the answer string (``"answer"``), the run as a dict (``"dict"``) or the
``PipelineRun`` itself (``"run"``). ``invoke``/``batch``/``ainvoke`` and composition with
``|`` come from LangChain. Does not own: the pipelines, or LangChain LLM / retriever
classes (``cachedrag.integrations``).
"""

from __future__ import annotations

from typing import Literal

from langchain_core.runnables import RunnableLambda

from cachedrag.errors import ConfigError

_INPUT_KEYS = ("question", "input", "query")


def as_runnable(pipeline, output: Literal["answer", "dict", "run"] = "answer") -> RunnableLambda:
    """A LangChain runnable that runs ``pipeline``.

    >>> chain = as_runnable(HyDE(CachedEngine(), load_index("idx")))   # doctest: +SKIP
    >>> chain.invoke("How do I pretty-print JSON?")                      # doctest: +SKIP
    >>> chain.batch(["What does heapq.heappush do?", "How do I copy a file?"])  # doctest: +SKIP
    """
    if output not in ("answer", "dict", "run"):
        raise ConfigError(f"unknown output {output!r}; use 'answer', 'dict' or 'run'")

    def run(value):
        run = pipeline.run(_question(value))
        if output == "answer":
            return run.answer
        return run.to_dict() if output == "dict" else run

    return RunnableLambda(run, name=f"cachedrag-{pipeline.name}")


def _question(value) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, dict):
        for key in _INPUT_KEYS:
            if isinstance(value.get(key), str):
                return value[key]
    text = getattr(value, "content", None) or getattr(value, "text", None)  # a message or a prompt value
    if isinstance(text, str):
        return text
    raise ConfigError(f"expected a question string or a dict with one of {_INPUT_KEYS}, got {type(value).__name__}")
