"""Dynamic speculative pipelining (RAGCache §5.3): prefill on the intermediate top-k of a staged search.

Owns: ``SpeculativePipeline`` (a driver around ``CachedEngine``: it does not change the engine),
``EngineLoad`` (requests in flight on an engine, which sets the number of search stages) and
``PipelineResult``. Does not own: the staged search (``cachedrag.retrieval``: any callable
``n_stages -> iterable of StageTopK``), the stage rule (``retrieval.policy.speculation_stages``)
or the chunk cache.

How a request runs. The search runs on a transient thread (``executor.TransientThreadExecutor``:
it exits when the search ends, so no OpenMP team outlives it) and posts the running top-k after
each stage. The caller's thread prefills speculatively, one chunk at a time, in prompt order:
step ``j`` prefills the prompt layout up to chunk ``j`` + the chat template's short tail through
``engine.generate_segments`` (one token). The engine stores each step's chunk KV on the exact
prefix, so step ``j + 1`` finds chunks ``0..j`` in the knowledge tree and computes only chunk
``j + 1``. Before each step the driver looks for a newer stage: when its top-k differs, the
speculation keeps the common prefix (chunks already in the prompt in the same order are never
redone) and continues from the first changed position; the rest of the old speculation is
abandoned (the cancel happens between chunks: a prefill in progress is never interrupted).
When the final stage arrives, the request is generated over the final top-k: its common prefix
with the speculation is served from the knowledge tree, the rest is computed as usual.

Whether to speculate follows ``retrieval.policy.speculation_stages``: the engine's load
(``EngineLoad``) and the expected search time (an EMA of this pipeline's recent searches; a
search shorter than ``min_search_s`` leaves nothing to hide behind).

Results equal the non-speculative path: a tree hit is the same KV that a fresh prefill of the
same prefix computes, and before the final request the driver invalidates every entry that an
abandoned speculation step created (so no approximate reuse of speculative work can change the
answer). ``wasted_tokens`` counts the speculation's computed tokens that the final request did
not use (abandoned chunks and every step's tail).
"""

from __future__ import annotations

import queue
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from cachedrag.executor import TransientThreadExecutor
from cachedrag.kvcache.keys import path_key
from cachedrag.model.generation import SamplingParams
from cachedrag.retrieval.config import PipeliningConfig
from cachedrag.retrieval.policy import speculation_stages


@dataclass(frozen=True)
class StageTopK:
    """The running top-k of one search stage, as chunk texts (best first).

    ``payload``: anything the search wants back with the final stage (e.g. the hits of every
    query of a batch, with ids and scores); the driver only reads ``chunks``.
    """

    index: int
    chunks: tuple[str, ...]
    final: bool
    payload: Any = field(default=None, compare=False, repr=False)


StageSearch = Callable[[int], Iterable[StageTopK]]


class EngineLoad:
    """Requests in flight on one engine (shared by every driver that uses it: ``engine_load``)."""

    def __init__(self):
        self._active = 0
        self._lock = threading.Lock()

    @property
    def active(self) -> int:
        with self._lock:
            return self._active

    @contextmanager
    def request(self):
        with self._lock:
            self._active += 1
        try:
            yield
        finally:
            with self._lock:
                self._active -= 1


_LOADS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_LOADS_LOCK = threading.Lock()


def engine_load(engine) -> EngineLoad:
    """The process-wide ``EngineLoad`` of ``engine``: generators that run requests on it count
    them here (``pipelines.generators.EngineGenerator``, ``integrations.generator``), so every
    speculation over the engine sees the same load."""
    with _LOADS_LOCK:
        load = _LOADS.get(engine)
        if load is None:
            load = _LOADS[engine] = EngineLoad()
        return load


@dataclass
class Speculation:
    """What a staged search and its speculative prefill left for the final request.

    The final request is the caller's (``SpeculativePipeline.generate`` makes it; a retriever
    returns ``final`` and the LLM call that follows makes it): its prompt's leading chunks that
    equal ``chunks[:kept_chunks]`` in the speculated layout are tree hits.
    """

    final: StageTopK  # the last stage (the search's result)
    chunks: list[str]  # the final top-k, cut to ``prompt_chunks``
    stages: int  # search stages used (1: no speculation)
    search_s: float  # from the request start to the final top-k
    speculative_steps: int = 0
    speculative_tokens: int = 0  # tokens the speculative prefills computed
    useful_tokens: int = 0  # of those, chunk tokens on the final top-k's prefix
    kept_chunks: int = 0  # leading final chunks the speculation prefilled
    restarts: int = 0  # times a newer stage changed the speculated prompt
    timeline: list[tuple[float, str]] = field(default_factory=list)

    @property
    def wasted_tokens(self) -> int:
        return self.speculative_tokens - self.useful_tokens

    def stats(self) -> dict:
        return {"stages": self.stages, "search_s": self.search_s, "speculative_steps": self.speculative_steps,
                "speculative_tokens": self.speculative_tokens, "wasted_tokens": self.wasted_tokens,
                "kept_chunks": self.kept_chunks, "restarts": self.restarts}


@dataclass
class PipelineResult:
    """The engine's result over the final top-k, plus what the speculation did."""

    result: object  # EngineResult of the final request (ttft_s counted from the request start)
    chunks: list[str]  # the final prompt's chunks
    stages: int  # search stages used (1: no speculation)
    search_s: float  # from the request start to the final top-k
    ttft_s: float  # from the request start to the first token
    speculative_steps: int = 0
    speculative_tokens: int = 0  # tokens the speculative prefills computed
    wasted_tokens: int = 0  # of those, not used by the final request
    kept_chunks: int = 0  # leading final chunks served by the speculation
    restarts: int = 0  # times a newer stage changed the speculated prompt
    timeline: list[tuple[float, str]] = field(default_factory=list)

    @property
    def prefill_tokens(self) -> int:
        """All prefill tokens computed for this request: speculation + final."""
        return self.speculative_tokens + self.result.computed_tokens

    @property
    def wasted_fraction(self) -> float:
        return self.wasted_tokens / self.prefill_tokens if self.prefill_tokens else 0.0


@dataclass
class _Step:
    chunks: tuple[str, ...]  # the speculated prompt's chunks up to this step's chunk
    handle: str  # the tree path handle of this step's chunk
    created: bool  # the step stored the handle (it was not referenced before)
    computed: int  # tokens the step computed
    tail: int  # of which the template tail


Layout = Callable[[Sequence[str]], list]


class SpeculativePipeline:
    """Staged search + speculative prefill around one engine.

    >>> pipe = SpeculativePipeline(engine)                                   # doctest: +SKIP
    >>> out = pipe.generate("what does heapq do?", index_stages(index, "what does heapq do?"))
    >>> out.result.text, out.ttft_s, out.wasted_fraction                     # doctest: +SKIP

    ``speculate`` is the same without the final request: a retrieval step (a pipeline's, an
    integration retriever's) calls it with the layout of the LLM call that will follow.
    """

    def __init__(self, engine, config: PipeliningConfig | None = None, load: EngineLoad | None = None):
        self.engine = engine
        self.config = config or PipeliningConfig()
        self.load = load or engine_load(engine)
        self._pool = TransientThreadExecutor(4, thread_name_prefix="cachedrag-staged-search")  # one per request in flight
        self.expected_search_s: float | None = None  # EMA of this pipeline's search times

    def stages_for_load(self) -> int:
        """Stages for a request starting now (this one excluded from the load)."""
        return speculation_stages(max(0, self.load.active - 1), self.config.max_stages, self.config.busy_requests,
                                  self.expected_search_s, self.config.min_search_s)

    def _observe_search(self, seconds: float) -> None:
        w = self.config.search_ema
        prev = self.expected_search_s
        self.expected_search_s = seconds if prev is None else (1 - w) * prev + w * seconds

    def generate(self, question: str, search: StageSearch, *, system_prompt: str | None = None,
                 layout: Layout | None = None, max_new_tokens: int = 64,
                 temperature: float = 0.0, seed: int | None = None, mode: str | None = None,
                 n_stages: int | None = None, start: float | None = None) -> PipelineResult:
        """Answer ``question`` over the final top-k of ``search``, speculating on earlier stages.

        ``layout(chunks) -> segments`` builds the prompt (default: the engine's chat layout with
        ``system_prompt``; a pipeline passes its own template). ``n_stages`` overrides the load
        rule (1 = the sequential baseline: search, then prefill).
        """
        start = time.perf_counter() if start is None else start
        if layout is None:
            layout = lambda chunks: self.engine.prompts.chat(list(chunks), question, system_prompt)  # noqa: E731
        with self.load.request():
            spec = self._speculation(search, layout, self._tail(system_prompt), mode, n_stages, start)
            params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, seed=seed)
            result = self.engine.generate_segments(layout(spec.chunks), params, mode=mode, start=start)
        return PipelineResult(result=result, chunks=spec.chunks, stages=spec.stages, search_s=spec.search_s,
                              ttft_s=result.ttft_s, speculative_steps=spec.speculative_steps,
                              speculative_tokens=spec.speculative_tokens, wasted_tokens=spec.wasted_tokens,
                              kept_chunks=spec.kept_chunks, restarts=spec.restarts, timeline=spec.timeline)

    def speculate(self, search: StageSearch, layout: Layout, *, tail: str | None = None, mode: str | None = None,
                  n_stages: int | None = None, start: float | None = None,
                  prompt_chunks: int | None = None) -> Speculation:
        """Run ``search``, prefilling ``layout`` of its intermediate top-k meanwhile; no final request.

        ``layout(chunks) -> segments`` must be the layout of the request that will follow (its
        segments up to the last chunk); each speculative step ends with ``tail`` (default: the
        chat template's text after the user message). When this returns, the chunks of
        ``layout(result.chunks)`` up to ``kept_chunks`` sit in the engine's knowledge tree.
        ``prompt_chunks`` overrides the config's (the chunks the following request will use).
        """
        start = time.perf_counter() if start is None else start
        with self.load.request():
            return self._speculation(search, layout, tail if tail is not None else self._tail(None), mode, n_stages,
                                     start, prompt_chunks)

    def _tail(self, system_prompt: str | None) -> str:
        _, after = self.engine.prompts.template_split(system_prompt)
        return after or "\n"

    def _speculation(self, search, layout, tail: str, mode, n_stages, start, prompt_chunks=None) -> Speculation:
        stages = n_stages or self.stages_for_load()
        width = prompt_chunks or self.config.prompt_chunks
        if stages == 1:
            final = _last(search(1))
            search_s = time.perf_counter() - start
            self._observe_search(search_s)
            return Speculation(final, list(final.chunks[:width]), 1, search_s)
        posted: queue.Queue = queue.Queue()
        arrived: list[float] = []  # when the final stage was posted

        def produce():
            try:
                for stage in search(stages):
                    posted.put(stage)
                    if stage.final:
                        arrived.append(time.perf_counter() - start)
            except BaseException as exc:  # handed to the request thread
                posted.put(exc)

        future = self._pool.submit(produce)
        timeline: list[tuple[float, str]] = []
        steps: list[_Step] = []
        spec: list[str] = []  # the speculated prompt's chunks, in order
        restarts = 0
        final: StageTopK | None = None
        try:
            while final is None:
                stage = _newest(posted, block=True)
                timeline.append((time.perf_counter() - start, f"stage {stage.index}"))
                if stage.final:
                    final = stage
                    break
                target = list(stage.chunks[:width])
                keep = _common_prefix(spec, target)
                if keep < len(spec):
                    restarts += 1
                spec = spec[:keep]
                for j in range(keep, len(target)):
                    if not posted.empty():  # a newer top-k: re-plan before the next chunk
                        break
                    steps.append(self._step(layout(target[: j + 1]), target[: j + 1], mode, tail))
                    spec.append(target[j])
                    timeline.append((time.perf_counter() - start, f"speculated chunk {j}"))
        finally:
            future.result()  # the search thread has ended (its errors were posted)
        search_s = arrived[0] if arrived else timeline[-1][0]
        self._observe_search(search_s)
        chunks = list(final.chunks[:width])
        used = [s for s in steps if list(s.chunks) == chunks[: len(s.chunks)]]
        for s in steps:  # abandoned speculation must not be reused approximately by the final request
            if s not in used and s.created:
                self.engine.manager.invalidate(s.handle)
        return Speculation(final, chunks, stages, search_s, speculative_steps=len(steps),
                           speculative_tokens=sum(s.computed for s in steps),
                           useful_tokens=sum(s.computed - s.tail for s in used),
                           kept_chunks=max((len(s.chunks) for s in used), default=0), restarts=restarts,
                           timeline=timeline)

    def _step(self, segments: list, chunks: list[str], mode, tail: str) -> _Step:
        """Prefill the prompt up to its last chunk + ``tail``; the engine stores the chunk KV."""
        engine = self.engine
        last = max(i for i, seg in enumerate(segments) if seg.kind == "chunk")
        tail_segment = engine.prompts.segment("text", tail)
        context = segments[: last + 1]
        handle = path_key([seg.key for seg in context])
        created = handle not in set(engine.manager.handles())
        result = engine.generate_segments(context + [tail_segment], SamplingParams(max_new_tokens=1), mode=mode)
        return _Step(tuple(chunks), handle, created, result.computed_tokens, len(tail_segment))

    def close(self) -> None:
        self._pool.shutdown(wait=True)


def _newest(posted: queue.Queue, block: bool) -> StageTopK:
    """The newest stage posted (older ones are skipped); re-raises the search's error."""
    item = posted.get(block=block)
    while True:
        if isinstance(item, BaseException):
            raise item
        if item.final:
            return item
        try:
            item = posted.get_nowait()
        except queue.Empty:
            return item


def _last(stages: Iterable[StageTopK]) -> StageTopK:
    last = None
    for last in stages:
        pass
    if last is None:
        raise ValueError("the staged search yielded no stage")
    return last


def _common_prefix(a: Sequence[str], b: Sequence[str]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def index_stages(index, query, k: int, nprobe: int) -> StageSearch:
    """A ``StageSearch`` over a ``RetrievalIndex`` (all clusters in RAM)."""

    def run(n_stages: int):
        for stage, hits in index.search_stages(query, k=k, nprobe=nprobe, n_stages=n_stages):
            yield StageTopK(stage.index, tuple(h.chunk.text for h in hits[0]), stage.final)

    return run


def rows_stages(stages_of: Callable[[int], Iterable], texts_of: Callable[[Sequence[int]], list[str]]) -> StageSearch:
    """A ``StageSearch`` from any ``n_stages -> Stage`` iterator (``DiskIVF``, ``LookaheadRetriever``)
    and a map of result rows to chunk texts (first query of the batch)."""

    def run(n_stages: int):
        for stage in stages_of(n_stages):
            yield StageTopK(stage.index, tuple(texts_of(stage.ids[0].tolist())), stage.final)

    return run
