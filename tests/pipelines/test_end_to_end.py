"""Every pipeline end to end on the tiny model and a tiny saved index; generators and retrievers."""

from __future__ import annotations

import math

import pytest
import torch

from cachedrag.pipelines import (FLARE, EngineGenerator, FaissDiskSearch, GenerationRequest, HyDE, IterRetGen,
                                 LookaheadSearch, SubQuestion, TransformersGenerator)
from cachedrag.pipelines.prompts import ANSWER

from .conftest import QUESTION

ALL = [HyDE, SubQuestion, IterRetGen, FLARE]
SMALL = {"max_new_tokens": 6, "top_k": 2}
EXTRA = {HyDE: {"passage_tokens": 6}, SubQuestion: {"decompose_tokens": 6}, IterRetGen: {"rounds": 2},
         FLARE: {"sentence_tokens": 4, "max_sentences": 2, "threshold": 0.99}}


@pytest.mark.parametrize("cls", ALL)
def test_pipeline_with_engine_and_lookahead(cls, engine, lookahead):
    run = cls(engine, lookahead, **SMALL, **EXTRA[cls]).run(QUESTION)
    assert isinstance(run.answer, str)
    assert run.steps_of("retrieval") and run.steps_of("pre_retrieval", "post_retrieval")
    for step in run.steps_of("pre_retrieval", "post_retrieval"):
        assert step.cache["mode"] == "cachedrag" and 0 < step.computed_tokens <= step.prompt_tokens
    for step in run.steps_of("retrieval"):
        assert 0.0 <= step.retrieval["hit_rate"] <= 1.0 and all(len(row) <= 2 for row in step.output)
    assert run.prefetch is not None and run.prefetch["elapsed_ms"] > 0 and 0.0 <= run.prefetch["overlap"] <= 1.0
    assert run.breakdown()["llm_s"] > 0


@pytest.mark.parametrize("cls", ALL)
def test_pipeline_with_plain_baseline(cls, tiny_runner, tiny_index):
    run = cls(TransformersGenerator(tiny_runner), FaissDiskSearch(tiny_index, nprobe=2), **SMALL, **EXTRA[cls]).run(QUESTION)
    assert isinstance(run.answer, str) and run.prefetch is None
    assert all(s.cache == {"mode": "transformers"} for s in run.steps_of("pre_retrieval", "post_retrieval"))


def test_iter_retgen_reuses_chunk_caches_across_rounds(engine, lookahead):
    run = IterRetGen(engine, lookahead, rounds=3, max_new_tokens=4, top_k=2).run(QUESTION)
    gens = run.steps_of("post_retrieval")
    assert gens[0].cache["chunks_missed"] == 2
    # a round whose chunks were retrieved before serves them from the chunk cache
    assert sum(g.cache["chunks_hit"] for g in gens[1:]) > 0
    assert sum(g.computed_tokens for g in gens[1:]) < sum(g.prompt_tokens for g in gens[1:])


def test_index_as_retriever_builds_lookahead(engine, tiny_index):
    hyde = HyDE(engine, tiny_index, **SMALL, passage_tokens=4)
    assert isinstance(hyde.retriever, LookaheadSearch) and hyde.retriever.nprobe == tiny_index.ivf.nlist
    try:
        assert hyde.run(QUESTION).prefetch["clusters"]
    finally:
        hyde.retriever.close()


def test_faiss_disk_search_equals_ivf_search(tiny_index):
    queries = [QUESTION, "What does heappush do?", "random uuid"]
    found = FaissDiskSearch(tiny_index, nprobe=2).search(queries, 3)
    expected = tiny_index.search(queries, k=3, nprobe=2)
    assert found.chunk_ids == [[h.chunk.id for h in row] for row in expected]
    assert found.chunks == [[h.chunk.text for h in row] for row in expected]


def test_lookahead_search_equals_ivf_search(lookahead, tiny_index):
    lookahead.prefetch(QUESTION)
    found = lookahead.search(["What does heappush do?"], 3)
    expected = tiny_index.search(["What does heappush do?"], k=3, nprobe=2)
    assert found.chunk_ids == [[h.chunk.id for h in row] for row in expected]
    report = lookahead.prefetch_report()
    assert report["clusters"] and report["elapsed_ms"] > 0


def test_baseline_matches_engine_without_reuse(tiny_runner, engine):
    """Same token ids (segments) and greedy decoding: plain transformers == the engine in full mode."""
    request = GenerationRequest(user="Question: what is json?", system=ANSWER.system,
                                chunks=("The json module encodes JSON.", "heapq is a heap."), max_new_tokens=8)
    base = TransformersGenerator(tiny_runner, tokenization="segments").generate(request)
    full = EngineGenerator(engine, mode="full").generate(request)
    assert base.prompt_tokens == full.prompt_tokens
    assert base.token_ids == full.token_ids
    assert base.token_logprobs == pytest.approx(full.token_logprobs, abs=1e-4)
    assert 0 < base.ttft_s <= base.seconds and 0 < full.ttft_s <= full.seconds
    joint = TransformersGenerator(tiny_runner).generate(request)  # chat template over the whole text
    assert joint.prompt_tokens > 0 and joint.cache == {"mode": "transformers"}


def test_engine_logprobs_are_the_models(engine):
    """FLARE judges on real probabilities: the first token's log p equals the prefill's log-softmax."""
    gen = EngineGenerator(engine, mode="full")
    request = GenerationRequest(user="Question: what is json?", chunks=("The json module encodes JSON.",), max_new_tokens=3)
    out = gen.generate(request)
    prompts = engine.prompts
    before, after = prompts.template_split(None)
    from cachedrag.pipelines.generators import layout

    logits = engine.prefill_logits(prompts.text_segments(layout(before, request.chunks, request.user, after)), mode="full")
    expected = float(torch.log_softmax(logits.float(), dim=-1)[out.token_ids[0]])
    assert out.token_logprobs[0] == pytest.approx(expected, abs=1e-4)
    assert all(lp <= 0 and math.isfinite(lp) for lp in out.token_logprobs)


def test_stop_strings_agree(tiny_runner, engine):
    request = GenerationRequest(user="Question: hi", max_new_tokens=12, stop=("e",))
    base = TransformersGenerator(tiny_runner, tokenization="segments").generate(request)
    full = EngineGenerator(engine, mode="full").generate(request)
    assert base.token_ids == full.token_ids and base.text == full.text and "e" not in base.text


def test_chunk_warmer_plans_candidates_and_asks_the_store(engine, tiny_index, monkeypatch):
    from cachedrag.retrieval.config import LookaheadConfig

    # the tiny model writes its passage faster than the prefetch copies: keep the search from cancelling it
    config = LookaheadConfig(cancel_prefetch_on_search=False)
    search = LookaheadSearch.from_index(tiny_index, device="cpu", config=config, nprobe=2, engine=engine)
    try:
        calls = []
        monkeypatch.setattr(engine.manager, "prefetch", lambda plan: calls.append(plan) or object())
        HyDE(engine, search, max_new_tokens=4, passage_tokens=4, top_k=2).run(QUESTION)
        stats = search.warmer.stats
        assert stats["calls"] == 1 and stats["candidates"] > 0 and stats["prefetches"] == 1 and len(calls) == 1
        # candidates computed by an earlier request are found in the cache
        HyDE(engine, search, max_new_tokens=4, passage_tokens=4, top_k=4).run(QUESTION)
        search.prefetch(QUESTION)
        search.prefetch_report()
        assert search.warmer.stats["cached"] > 0
    finally:
        search.close()
