"""Speculative pipelining for the LlamaIndex and LangChain retrievers (``pipelining=``).

Owns: ``PromptShape`` (how the LLM's latest prompt with retrieved chunks looked around them:
the text parts before the first chunk and between chunks, its engine and reuse mode),
``remember_shape`` (``ChunkAwareGenerator`` calls it for every prompt it splits) and
``RetrieverPipelining``, the retrievers' option: the search runs in stages on a background
thread while the retriever's thread prefills the intermediate top-k in the remembered shape
(``cachedrag.pipelining.SpeculativePipeline.speculate``); a changed top-k keeps the common
prefix and re-plans the rest; abandoned speculation is invalidated. The retriever then returns
the final top-k, and the LLM call that follows finds the kept chunks in the knowledge tree.

Why a remembered shape: a framework retriever returns documents before the prompt around them
exists (the query engine or chain formats it afterwards), so the retriever cannot know the
text that will precede and separate the chunks. It takes it from the previous prompt that the
same registry's LLM saw: from the second request on, a fixed template (LlamaIndex's QA prompt,
a LangChain ``ChatPromptTemplate`` with ``{context}`` before the question) gives the same
segments, and speculation hits. Until then, or when the template puts question text before
the chunks, the speculation's tree paths differ from the prompt's and are simply not used:
answers never change (a tree hit is the KV a fresh prefill of the same prefix computes), only
the wasted work does; ``last_speculation`` reports it.

Does not own: the driver (``cachedrag.pipelining``), search (``search``), prompt splitting
(``cachedrag.prompt.splitter``).
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass

from cachedrag.pipelining import SpeculativePipeline, StageTopK
from cachedrag.prompt.splitter import TOKENIZATION, SplitPrompt
from cachedrag.retrieval.config import PipeliningConfig

_TAIL = "\n"  # what each speculative step prefills after its last chunk (one token, thrown away)


@dataclass(frozen=True)
class PromptShape:
    """The text around the chunks of one prompt (chunk texts themselves left out)."""

    lead: tuple[str, ...]  # text parts before the first chunk
    separators: tuple[tuple[str, ...], ...]  # text parts between chunk i and chunk i + 1
    engine: weakref.ref
    mode: str | None

    @classmethod
    def of(cls, split: SplitPrompt, engine, mode: str | None) -> "PromptShape | None":
        kinds = [kind for kind, _ in split.parts]
        if "chunk" not in kinds:
            return None
        first = kinds.index("chunk")
        last = len(kinds) - 1 - kinds[::-1].index("chunk")
        seps, current = [], []
        for kind, text in split.parts[first + 1:last + 1]:
            if kind == "chunk":
                seps.append(tuple(current))
                current = []
            else:
                current.append(text)
        return cls(tuple(t for _, t in split.parts[:first]), tuple(seps), weakref.ref(engine), mode)

    def parts(self, chunks) -> list[tuple[str, str]]:
        """The prompt's parts up to the last of ``chunks`` (later gaps repeat the last separator)."""
        out = [("text", t) for t in self.lead]
        for i, chunk in enumerate(chunks):
            if i:
                sep = self.separators[min(i, len(self.separators)) - 1] if self.separators else ()
                out += [("text", t) for t in sep]
            out.append(("chunk", chunk))
        return out


_SHAPES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # ChunkRegistry -> PromptShape
_SHAPES_LOCK = threading.Lock()


def remember_shape(registry, split: SplitPrompt, engine, mode: str | None) -> None:
    """Note the shape of a prompt that holds registered chunks (called per LLM request)."""
    shape = PromptShape.of(split, engine, mode)
    if shape is not None:
        with _SHAPES_LOCK:
            _SHAPES[registry] = shape


def shape_for(registry) -> PromptShape | None:
    with _SHAPES_LOCK:
        return _SHAPES.get(registry)


class RetrieverPipelining:
    """A retriever's ``pipelining=`` option: staged search + speculative prefill of its results.

    >>> option = RetrieverPipelining(PipeliningConfig(max_stages=4))      # doctest: +SKIP
    >>> hits, stats = option.search(searcher, "what does heapq do?", k=4)   # doctest: +SKIP
    """

    def __init__(self, config: PipeliningConfig | bool = True):
        self.config = config if isinstance(config, PipeliningConfig) else PipeliningConfig()
        self._pipes: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # engine -> SpeculativePipeline
        self._lock = threading.Lock()

    def search(self, searcher, texts, k: int, nprobe: int | None = None) -> tuple[list, dict]:
        """The final top-k of ``texts`` (equal to ``searcher.search``) and what the speculation did."""
        shape = shape_for(searcher.registry)
        engine = shape.engine() if shape is not None else None
        if engine is None:
            return searcher.search(texts, k=k, nprobe=nprobe), {
                "stages": 1, "pipelining": "off: no LLM prompt with retrieved chunks seen yet (the next request speculates)"}
        prompts = engine.prompts

        def run(n_stages: int):
            for index, hits, final in searcher.search_stages(texts, k, n_stages, nprobe=nprobe):
                yield StageTopK(index, tuple(h.text.strip() for h in hits), final, hits)

        def segments(chunks):  # the generator's segments of the prompt up to its last chunk
            return prompts.text_segments(shape.parts(chunks), tokenization=TOKENIZATION)

        spec = self._pipe(engine).speculate(run, segments,
                                            tail=_TAIL, mode=shape.mode, prompt_chunks=k)
        return spec.final.payload, spec.stats()

    def _pipe(self, engine) -> SpeculativePipeline:
        with self._lock:
            pipe = self._pipes.get(engine)
            if pipe is None:
                pipe = self._pipes[engine] = SpeculativePipeline(engine, self.config)
            return pipe


def pipelining_option(value) -> RetrieverPipelining | None:
    """``pipelining=`` of a retriever: False/None -> off, True -> defaults, a ``PipeliningConfig``
    or a dict of its fields -> those settings."""
    if value is None or value is False:
        return None
    if isinstance(value, dict):
        from cachedrag.retrieval.config import make_config

        value = make_config(PipeliningConfig, **value)
    if not isinstance(value, (bool, PipeliningConfig)):
        raise TypeError(f"pipelining must be a bool, a PipeliningConfig or a dict, got {type(value).__name__}")
    return RetrieverPipelining(value)
