"""Pipeline base: the step record, the run record and the step helpers every pipeline uses.

Owns: ``Step`` (one recorded step: name, kind, text in/out, tokens, time, cache and retrieval
stats), ``PipelineRun`` (a run's answer, steps and breakdown: LLM time, retrieval time,
prefetch overlap), ``PipelineConfig`` (settings shared by all pipelines, validated once) and
``Pipeline``: one generator (the chunk-cache engine, or the plain-transformers baseline) and
one retriever (lookahead or plain Faiss) shared by all steps of a run, with ``run(question)``
and the recording helpers ``_prefetch`` / ``_generate`` / ``_retrieve`` / ``_judge``.

Does not own: what a pipeline does (``hyde``, ``subquestion``, ``iter_retgen``, ``flare``),
prompt text (``prompts``), model calls (``generators``), search (``retrievers``), or the
LlamaIndex / LangChain wrappers (``query_engine``, ``runnable``).

One ``Pipeline`` object runs one request at a time (its retriever holds one lookahead
prefetch at a time); give concurrent callers a pipeline (and a retriever) each. They can all
share one engine, and so one chunk cache.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field

from cachedrag.errors import ConfigError, EmptyInputError
from cachedrag.pipelines.generators import Generation, GenerationRequest, as_generator
from cachedrag.pipelines.prompts import ANSWER, PromptTemplate
from cachedrag.pipelines.retrievers import SearchResult, as_retriever
from cachedrag.retrieval.config import PipeliningConfig

StepKind = Literal["pre_retrieval", "retrieval", "post_retrieval", "judgment"]
GENERATION_KINDS: tuple[str, ...] = ("pre_retrieval", "post_retrieval")


@dataclass
class Step:
    """One recorded step of a run. ``started_s`` is the offset from the start of the run."""

    name: str
    kind: StepKind
    input: Any  # prompt's user text / queries / judged text
    output: Any  # generated text / chunk ids per query / decision
    started_s: float
    seconds: float
    prompt_tokens: int = 0
    generated_tokens: int = 0
    computed_tokens: int = 0  # prompt tokens computed at full depth (the rest was served from the chunk cache)
    ttft_s: float | None = None  # a generation's time to first token (its prefill), when known
    cache: dict = field(default_factory=dict)  # chunk-cache stats of a generation step
    retrieval: dict = field(default_factory=dict)  # hit rate, tier times... of a retrieval step
    details: dict = field(default_factory=dict)  # e.g. a judgment's token probabilities
    documents: list[list[tuple[str, str]]] = field(default_factory=list, repr=False)  # (chunk id, text) per query

    def to_dict(self, documents: bool = False) -> dict:
        out = asdict(self)
        if not documents:
            out.pop("documents")
        return out


@dataclass
class PipelineRun:
    """Answer and step-by-step record of one ``Pipeline.run``."""

    pipeline: str
    question: str
    answer: str
    steps: list[Step]
    total_s: float
    prefetch: dict | None = None  # what the lookahead prefetch did (None: no prefetch)
    notes: list[str] = field(default_factory=list)

    def steps_of(self, *kinds: str) -> list[Step]:
        return [s for s in self.steps if s.kind in kinds]

    @property
    def llm_s(self) -> float:
        return sum(s.seconds for s in self.steps_of(*GENERATION_KINDS))

    @property
    def retrieval_s(self) -> float:
        return sum(s.seconds for s in self.steps_of("retrieval"))

    @property
    def llm_calls(self) -> int:
        return len(self.steps_of(*GENERATION_KINDS))

    @property
    def documents(self) -> list[tuple[str, str]]:
        """Distinct (chunk id, text) of every retrieval step, in first-seen order."""
        seen: dict[str, str] = {}
        for step in self.steps_of("retrieval"):
            for row in step.documents:
                for cid, text in row:
                    seen.setdefault(cid, text)
        return list(seen.items())

    def breakdown(self) -> dict:
        """Seconds per part (TeleRAG Fig. 10 style): LLM, retrieval, the rest; prefetch overlap."""
        gens = self.steps_of(*GENERATION_KINDS)
        prompt = sum(s.prompt_tokens for s in gens)
        out = {
            "total_s": self.total_s,
            "llm_s": self.llm_s,
            "retrieval_s": self.retrieval_s,
            "other_s": max(0.0, self.total_s - self.llm_s - self.retrieval_s),
            "llm_calls": len(gens),
            # LLM time to first token (prefill) vs after it (decode); None when a generator does not report it
            "prefill_s": sum(s.ttft_s for s in gens) if all(s.ttft_s is not None for s in gens) else None,
            "prompt_tokens": prompt,
            "computed_tokens": sum(s.computed_tokens for s in gens),
            "cached_tokens": prompt - sum(s.computed_tokens for s in gens),
            "generated_tokens": sum(s.generated_tokens for s in gens),
            "chunks_hit": sum(s.cache.get("chunks_hit", 0) for s in gens),
            "chunks_missed": sum(s.cache.get("chunks_missed", 0) for s in gens),
        }
        out["decode_s"] = out["llm_s"] - out["prefill_s"] if out["prefill_s"] is not None else None
        searches = [s.retrieval.get("search_ms") for s in self.steps_of("retrieval")]
        # retrieval without query embedding: cluster assignment, tier reads and scoring
        out["search_ms"] = sum(searches) if all(v is not None for v in searches) else None
        hit_rates = [s.retrieval["hit_rate"] for s in self.steps_of("retrieval") if "hit_rate" in s.retrieval]
        out["cluster_hit_rate"] = sum(hit_rates) / len(hit_rates) if hit_rates else None
        if self.prefetch:
            out["prefetch_ms"] = self.prefetch.get("elapsed_ms")
            out["prefetch_hidden_ms"] = self.prefetch.get("hidden_ms")
            out["prefetch_overlap"] = self.prefetch.get("overlap")
        return out

    def to_dict(self, documents: bool = False) -> dict:
        return {
            "pipeline": self.pipeline, "question": self.question, "answer": self.answer,
            "total_s": self.total_s, "breakdown": self.breakdown(), "prefetch": self.prefetch,
            "notes": list(self.notes), "steps": [s.to_dict(documents) for s in self.steps],
        }


class PipelineConfig(BaseModel):
    """Settings every pipeline has. Templates are ``PromptTemplate``s users may override."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    top_k: int = Field(4, ge=1, description="chunks retrieved per query")
    max_new_tokens: int = Field(48, ge=1, description="tokens of the final answer")
    temperature: float = Field(0.0, ge=0.0, description="0 = greedy decoding")
    seed: int | None = Field(None, description="sampling seed (temperature > 0)")
    answer: PromptTemplate = Field(ANSWER, description="prompt of the answer over retrieved chunks; fields: question")
    prefetch: bool = Field(True, description="call the retriever's prefetch(original question) before the first LLM call")
    pipelining: bool | PipeliningConfig = Field(
        False, description="speculative pipelining (RAGCache): retrieval steps search in stages and prefill the "
        "answer prompt's chunks on each intermediate top-k while the search goes on; True = default settings")


class _Recorder:
    """State of one run: start time, steps, the prefetch and its timing."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.steps: list[Step] = []
        self.notes: list[str] = []
        self.prefetch_at: float | None = None  # offset of prefetch() from the start
        self.first_search_after_prefetch: float | None = None

    def now(self) -> float:
        return time.perf_counter() - self.start

    def add(self, step: Step) -> Step:
        self.steps.append(step)
        return step


class Pipeline(ABC):
    """A RAG pipeline: steps sharing one generator and one retriever.

    ``engine``: a ``CachedEngine`` (chunk-cache reuse), or any generator of
    ``cachedrag.pipelines.generators`` (e.g. ``TransformersGenerator``, the plain baseline).
    ``retriever``: a ``RetrievalIndex`` (lookahead retrieval is built over it), a
    ``LookaheadSearch``, a ``FaissDiskSearch`` or anything with ``prefetch``/``search``/
    ``prefetch_report``. Settings: ``config=`` (the pipeline's config class) or keyword
    overrides, e.g. ``HyDE(engine, index, top_k=3)``.
    """

    name: ClassVar[str] = "pipeline"
    config_class: ClassVar[type[PipelineConfig]] = PipelineConfig

    def __init__(self, engine, retriever, config: PipelineConfig | None = None, **overrides):
        self.generator = as_generator(engine)
        self.retriever = as_retriever(retriever)
        config = self.config_class() if config is None else config
        if not isinstance(config, self.config_class):
            raise ConfigError(f"{type(self).__name__} takes a {self.config_class.__name__}, not {type(config).__name__}")
        if overrides:
            try:
                config = self.config_class.model_validate({**config.model_dump(), **overrides})
            except ValueError as exc:
                raise ConfigError(str(exc)) from exc
        self.config = config
        self._speculator = None  # the SpeculativePipeline of ``pipelining`` (made on first use)

    # ------------------------------------------------------------------ public API
    def run(self, question: str) -> PipelineRun:
        """Answer ``question``; the ``PipelineRun`` records every step."""
        if not isinstance(question, str) or not question.strip():
            raise EmptyInputError("the question is empty")
        question = question.strip()
        rec = _Recorder()
        answer = self._run(question, rec)
        total = rec.now()
        return PipelineRun(self.name, question, answer.strip(), rec.steps, total, self._prefetch_summary(rec), rec.notes)

    def as_query_engine(self, **kwargs):
        """This pipeline as a LlamaIndex query engine (``query_engine.PipelineQueryEngine``)."""
        from cachedrag.pipelines.query_engine import PipelineQueryEngine

        return PipelineQueryEngine(self, **kwargs)

    def as_runnable(self, output: str = "answer"):
        """This pipeline as a LangChain runnable (``runnable.as_runnable``)."""
        from cachedrag.pipelines.runnable import as_runnable

        return as_runnable(self, output=output)

    # ------------------------------------------------------------------ pipeline body
    @abstractmethod
    def _run(self, question: str, rec: _Recorder) -> str:
        """The pipeline's steps; returns the answer."""

    # ------------------------------------------------------------------ step helpers
    def _prefetch(self, rec: _Recorder, question: str) -> None:
        """Start the lookahead prefetch for the original question (returns at once)."""
        if not self.config.prefetch or rec.prefetch_at is not None:
            return
        rec.prefetch_at = rec.now()
        self.retriever.prefetch(question)

    def _generate(self, rec: _Recorder, name: str, kind: StepKind, template: PromptTemplate, values: dict,
                  *, chunks: Sequence[str] = (), max_new_tokens: int, assistant_prefix: str = "",
                  stop: Sequence[str] = ()) -> Generation:
        """One LLM call, recorded as a step."""
        assert kind in GENERATION_KINDS, kind
        system, user = template.render(**values)
        request = GenerationRequest(user=user, system=system, chunks=tuple(chunks), assistant_prefix=assistant_prefix,
                                    max_new_tokens=max_new_tokens, stop=tuple(stop),
                                    temperature=self.config.temperature, seed=self.config.seed)
        started = rec.now()
        gen = self.generator.generate(request)
        rec.add(Step(name=name, kind=kind, input=user, output=gen.text, started_s=started, seconds=rec.now() - started,
                     prompt_tokens=gen.prompt_tokens, generated_tokens=len(gen.token_ids),
                     computed_tokens=gen.computed_tokens, ttft_s=gen.ttft_s, cache=dict(gen.cache)))
        rec.notes.extend(gen.notes)
        return gen

    def _retrieve(self, rec: _Recorder, name: str, queries: Sequence[str], k: int | None = None) -> SearchResult:
        """One (batched) search, recorded as a step."""
        queries = [q for q in queries if q and q.strip()]
        if not queries:
            raise EmptyInputError(f"{self.name}: step {name!r} has no query")
        started = rec.now()
        if rec.prefetch_at is not None and rec.first_search_after_prefetch is None:
            rec.first_search_after_prefetch = started
        k = k or self.config.top_k
        speculator = self._pipelining(rec)
        if speculator is None:
            result, info = self.retriever.search(queries, k), {}
        else:
            result, info = self._speculative_search(speculator, queries, k)
        rec.add(Step(name=name, kind="retrieval", input=list(queries), output=[list(r) for r in result.chunk_ids],
                     started_s=started, seconds=rec.now() - started, retrieval={**result.info, **info},
                     documents=[list(zip(ids, texts)) for ids, texts in zip(result.chunk_ids, result.chunks)]))
        return result

    def _pipelining(self, rec: _Recorder):
        """The ``SpeculativePipeline`` of retrieval steps, or None (pipelining off or not possible:
        then a note says why and the search is plain)."""
        option = self.config.pipelining
        if option is False:
            return None
        if self._speculator is None:
            engine = getattr(self.generator, "engine", None)
            if engine is None or not callable(getattr(self.generator, "chunk_layout", None)):
                reason = f"the generator {type(self.generator).__name__} has no chunk-cache engine"
            elif not callable(getattr(self.retriever, "stage_search", None)):
                reason = f"the retriever {type(self.retriever).__name__} has no staged search"
            else:
                from cachedrag.pipelining import SpeculativePipeline

                config = option if isinstance(option, PipeliningConfig) else PipeliningConfig()
                self._speculator = SpeculativePipeline(engine, config)
                return self._speculator
            note = f"pipelining is off: {reason}"
            if note not in rec.notes:
                rec.notes.append(note)
            return None
        return self._speculator

    def _speculative_search(self, speculator, queries: Sequence[str], k: int) -> tuple[SearchResult, dict]:
        """Staged search of ``queries``; the first query's intermediate top-k is prefilled in the
        layout of the answer prompt (``config.answer`` over the chunks, what every pipeline's
        post-retrieval generation uses), so that generation finds those chunks in the tree."""
        layout, tail = self.generator.chunk_layout(self.config.answer.system)
        spec = speculator.speculate(self.retriever.stage_search(queries, k), layout, tail=tail,
                                    mode=getattr(self.generator, "mode", None), prompt_chunks=k)
        return spec.final.payload, {"speculation": spec.stats()}

    def _judge(self, rec: _Recorder, name: str, judged: str, decision: str, started: float, details: dict) -> None:
        """A decision taken without the LLM (e.g. FLARE's confidence check), recorded as a step."""
        rec.add(Step(name=name, kind="judgment", input=judged, output=decision, started_s=started,
                     seconds=rec.now() - started, details=dict(details)))

    def _prefetch_summary(self, rec: _Recorder) -> dict | None:
        if rec.prefetch_at is None:
            return None
        report = self.retriever.prefetch_report()
        if report is None:
            return None
        report = dict(report)
        elapsed = report.get("elapsed_ms")
        if elapsed is not None:
            window = ((rec.first_search_after_prefetch if rec.first_search_after_prefetch is not None else rec.now())
                      - rec.prefetch_at) * 1e3
            report["window_ms"] = window  # LLM work between prefetch() and the first search
            report["hidden_ms"] = min(elapsed, window)
            report["overlap"] = report["hidden_ms"] / elapsed if elapsed > 0 else 1.0
        if report.get("error"):
            rec.notes.append(f"prefetch failed (results are still complete): {report['error']}")
        return report


__all__ = ["GENERATION_KINDS", "Pipeline", "PipelineConfig", "PipelineRun", "Step", "StepKind"]
