"""Speculative pipelining through the pipelines' ``pipelining=`` option: same answers, real speculation."""

from __future__ import annotations

import threading

import pytest

from cachedrag.config import EngineConfig
from cachedrag.engine import CachedEngine
from cachedrag.pipelines import FLARE, FaissDiskSearch, HyDE, IterRetGen, LookaheadSearch, SubQuestion
from cachedrag.retrieval.config import LookaheadConfig, PipeliningConfig, SearchConfig
from cachedrag.retrieval.lookahead import LookaheadRetriever

from .conftest import QUESTION

SMALL = {"max_new_tokens": 6, "top_k": 2}
EXTRA = {HyDE: {"passage_tokens": 6}, SubQuestion: {"decompose_tokens": 6}, IterRetGen: {"rounds": 2},
         FLARE: {"sentence_tokens": 4, "max_sentences": 2, "threshold": 0.99}}
# speculate on every retrieval (the tiny index's searches are far shorter than min_search_s)
ALWAYS = PipeliningConfig(max_stages=2, min_search_s=0.0)


def _search(tiny_index):
    retriever = LookaheadRetriever.from_index(tiny_index, device="cpu", config=LookaheadConfig(),
                                              search_config=SearchConfig(k=3, nprobe=2))
    return LookaheadSearch(retriever, tiny_index)


class _Gated(LookaheadSearch):
    """A staged search whose later stages wait until the engine ran one more speculative step
    (so the test does not depend on how fast the tiny search is)."""

    def __init__(self, inner: LookaheadSearch, engine):
        super().__init__(inner.retriever, inner.index, inner.nprobe)
        self.steps = 0
        self.cond = threading.Condition()
        original = engine.generate_segments

        def counting(segments, params, **kw):
            out = original(segments, params, **kw)
            if params.max_new_tokens == 1:  # a speculative step
                with self.cond:
                    self.steps += 1
                    self.cond.notify_all()
            return out

        engine.generate_segments = counting

    def stage_search(self, queries, k):
        inner = super().stage_search(queries, k)

        def run(n_stages):
            seen = self.steps
            for i, stage in enumerate(inner(n_stages)):
                if i > 0:
                    with self.cond:
                        assert self.cond.wait_for(lambda: self.steps > seen, timeout=30)
                yield stage

        return run


def _run(cls, runner, index, mode, **options):
    engine = CachedEngine(runner, config=EngineConfig(mode=mode, cache_bytes=64 << 20))
    search = _search(index)
    if options.get("pipelining"):
        search = _Gated(search, engine)
    try:
        return cls(engine, search, **SMALL, **EXTRA[cls], **options).run(QUESTION)
    finally:
        search.close()


@pytest.mark.parametrize("mode", ["cachedrag", "prefix"])
@pytest.mark.parametrize("cls", [HyDE, SubQuestion, IterRetGen, FLARE])
def test_pipelined_answer_equals_the_plain_one(cls, mode, tiny_runner, tiny_index):
    plain = _run(cls, tiny_runner, tiny_index, mode)
    piped = _run(cls, tiny_runner, tiny_index, mode, pipelining=ALWAYS)
    assert piped.answer == plain.answer
    assert [s.output for s in piped.steps] == [s.output for s in plain.steps]  # every step, retrieval included
    assert not piped.notes or not any("pipelining is off" in n for n in piped.notes)
    specs = [s.retrieval["speculation"] for s in piped.steps_of("retrieval")]
    assert specs and all(sp["stages"] == 2 for sp in specs) and any(sp["speculative_steps"] > 0 for sp in specs)
    assert not any("speculation" in s.retrieval for s in plain.steps_of("retrieval"))
    # the generation after a retrieval found the chunks the speculation kept in the knowledge tree
    after = {id(s): piped.steps[i + 1] for i, s in enumerate(piped.steps[:-1]) if s.kind == "retrieval"}
    kept = [(s.retrieval["speculation"]["kept_chunks"], after.get(id(s))) for s in piped.steps_of("retrieval")]
    served = [gen.cache["prefix_hit_tokens"] for n, gen in kept if n > 0 and gen is not None
              and gen.kind == "post_retrieval" and gen.cache["chunks_missed"] + gen.cache["chunks_hit"] > 0]
    assert served and all(t > 0 for t in served)


def test_pipelining_true_uses_the_default_settings(tiny_runner, tiny_index):
    run = _run(HyDE, tiny_runner, tiny_index, "cachedrag", pipelining=True)
    # first search: nothing measured yet, so it speculates; a tiny search is then below min_search_s
    assert run.steps_of("retrieval")[0].retrieval["speculation"]["stages"] == PipeliningConfig().max_stages


def test_pipelining_without_a_staged_retriever_is_reported(tiny_runner, tiny_index):
    engine = CachedEngine(tiny_runner, config=EngineConfig(cache_bytes=64 << 20))
    run = HyDE(engine, FaissDiskSearch(tiny_index, nprobe=2), **SMALL, passage_tokens=4, pipelining=True).run(QUESTION)
    assert any("pipelining is off" in n and "FaissDiskSearch" in n for n in run.notes)
    assert isinstance(run.answer, str)


def test_pipelining_option_is_validated():
    from cachedrag.errors import ConfigError

    with pytest.raises(ConfigError, match="max_stages"):
        HyDE(_FakeEngine(), _FakeRetriever(), pipelining={"max_stages": 0})


class _FakeEngine:
    tokenizer = object()

    def generate(self, request):  # pragma: no cover - never called
        raise AssertionError


class _FakeRetriever:
    def prefetch(self, query):  # pragma: no cover
        pass

    def search(self, queries, k):  # pragma: no cover
        raise AssertionError

    def prefetch_report(self):  # pragma: no cover
        return None
