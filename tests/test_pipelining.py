"""Speculative pipelining: equal answers to the sequential path, kept prefixes, the load rule."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from cachedrag.config import EngineConfig
from cachedrag.engine import CachedEngine
from cachedrag.pipelining import EngineLoad, SpeculativePipeline, StageTopK
from cachedrag.retrieval.config import PipeliningConfig
from cachedrag.retrieval.policy import speculation_stages
from cachedrag.testing import tiny_runner

C = [f"Chunk {i}: " + ("the quick brown fox %d jumps. " % i) * 3 for i in range(6)]
SYSTEM = "Answer from the excerpts."
QUESTION = "What does the fox do?"


@pytest.fixture(scope="module")
def runner():
    return tiny_runner("qwen2", seed=3)


class _GatedSearch:
    """Stages posted one by one: stage s + 1 is posted once the engine ran ``after[s]`` speculative steps.

    Lock-step both ways, so the outcome does not depend on thread scheduling: the step that reaches
    ``after[s]`` returns only once stage s + 1 is in the pipeline's queue (the search thread resumes the
    generator after it queued the stage), so the pipeline sees the new stage before its next step.
    """

    def __init__(self, engine, stages: list[list[str]], after: list[int]):
        self.stages, self.after = stages, after
        self.steps = 0
        self.queued = 0  # stages the search thread has put in the pipeline's queue
        self.cond = threading.Condition()
        original = engine.generate_segments

        def counting(segments, params, **kw):
            out = original(segments, params, **kw)
            if params.max_new_tokens == 1:
                with self.cond:
                    self.steps += 1
                    self.cond.notify_all()
                    if self.steps in self.after:
                        nxt = self.after.index(self.steps) + 1
                        assert self.cond.wait_for(lambda: self.queued > nxt, timeout=30)
            return out

        engine.generate_segments = counting

    def __call__(self, n_stages):
        for s, chunks in enumerate(self.stages):
            if s > 0:
                with self.cond:
                    assert self.cond.wait_for(lambda: self.steps >= self.after[s - 1], timeout=30)
            yield StageTopK(s, tuple(chunks), s == len(self.stages) - 1)
            with self.cond:  # resumed: the stage just yielded is queued
                self.queued = s + 1
                self.cond.notify_all()


def _sequential(runner, mode, chunks):
    engine = CachedEngine(runner, config=EngineConfig(mode=mode))
    return engine.generate(chunks, QUESTION, SYSTEM, max_new_tokens=8)


@pytest.mark.parametrize("mode", ["prefix", "cachedrag"])
@pytest.mark.parametrize(
    "stages, after, kept",
    [
        ([C[:3], C[:3]], [3], 3),  # the top-k never changes: the whole prompt is speculated
        ([[C[0], C[4], C[5]], C[:3]], [3], 1),  # chunks 1-2 change: only chunk 0 is kept
        ([[C[3], C[1], C[2]], C[:3]], [2], 0),  # the first chunk changes: nothing is kept
        # re-planned after chunk 0, then stable: chunks 1-2 are speculated on the second stage
        ([[C[0], C[4], C[5]], C[:3], C[:3]], [1, 3], 3),
    ],
)
def test_speculative_answer_equals_the_sequential_one(runner, mode, stages, after, kept):
    engine = CachedEngine(runner, config=EngineConfig(mode=mode))
    pipe = SpeculativePipeline(engine, PipeliningConfig(max_stages=len(stages), prompt_chunks=3))
    out = pipe.generate(QUESTION, _GatedSearch(engine, stages, after), system_prompt=SYSTEM, max_new_tokens=8)
    ref = _sequential(runner, mode, stages[-1])
    assert out.result.token_ids == ref.token_ids
    torch.testing.assert_close(torch.tensor(out.result.token_logprobs), torch.tensor(ref.token_logprobs),
                               atol=1e-4, rtol=1e-4)
    assert out.chunks == stages[-1] and out.kept_chunks == kept
    assert out.result.prefix_hit_tokens > 0 if kept else True
    # the final request computed only what the speculation did not provide
    chunk_tokens = [len(engine.prompts.segment("chunk", c + "\n\n")) for c in stages[-1]]
    assert out.result.computed_tokens <= ref.computed_tokens - sum(chunk_tokens[:kept])
    assert 0 <= out.wasted_tokens <= out.speculative_tokens
    if kept == 3 and len(stages) == 2:
        assert out.restarts == 0
        tail = len(engine.prompts.segment("text", engine.prompts.template_split(SYSTEM)[1]))
        assert out.wasted_tokens == 3 * tail  # only the template tails of the three steps
    pipe.close()


def test_abandoned_speculation_is_not_left_in_the_cache(runner):
    engine = CachedEngine(runner, config=EngineConfig(mode="cachedrag"))
    pipe = SpeculativePipeline(engine, PipeliningConfig(max_stages=2, prompt_chunks=3))
    out = pipe.generate(QUESTION, _GatedSearch(engine, [[C[0], C[4], C[5]], C[:3]], [3]), system_prompt=SYSTEM,
                        max_new_tokens=2)
    assert out.speculative_steps == 3 and out.kept_chunks == 1
    # chunks 4 and 5 were speculated and abandoned: no variant of them may serve a later request
    keys = {engine.prompts.segment("chunk", c + "\n\n").key for c in (C[4], C[5])}
    assert not any(engine.manager.index.variants(k) for k in keys)


def test_busy_engine_does_not_speculate(runner):
    engine = CachedEngine(runner, config=EngineConfig(mode="prefix"))
    load = EngineLoad()
    pipe = SpeculativePipeline(engine, PipeliningConfig(max_stages=4, busy_requests=2, min_search_s=0),
                               load=load)
    seen = []

    def search(n_stages):
        seen.append(n_stages)
        yield StageTopK(0, tuple(C[:2]), True)

    with load.request(), load.request():  # two other requests in flight
        out = pipe.generate(QUESTION, search, system_prompt=SYSTEM, max_new_tokens=2)
    assert seen == [1] and out.stages == 1 and out.speculative_steps == 0
    out = pipe.generate(QUESTION, search, system_prompt=SYSTEM, max_new_tokens=2)
    assert seen[-1] == 4 and load.active == 0


def test_search_errors_reach_the_caller(runner):
    engine = CachedEngine(runner, config=EngineConfig(mode="prefix"))
    pipe = SpeculativePipeline(engine, PipeliningConfig(max_stages=2))

    def search(n_stages):
        yield StageTopK(0, tuple(C[:1]), False)
        raise OSError("disk gone")

    with pytest.raises(OSError, match="disk gone"):
        pipe.generate(QUESTION, search, system_prompt=SYSTEM, max_new_tokens=2)


@pytest.mark.parametrize("others, expected", [(0, 4), (1, 2), (2, 1), (5, 1)])
def test_stages_follow_the_load(others, expected):
    assert speculation_stages(others, max_stages=4, busy_requests=2) == expected


@pytest.mark.parametrize("expected_s, stages", [(None, 4), (0.01, 1), (0.2, 4)])
def test_stages_need_search_time_to_hide(expected_s, stages):
    assert speculation_stages(0, 4, 2, expected_search_s=expected_s, min_search_s=0.1) == stages


def test_short_searches_turn_speculation_off_and_long_ones_back_on(runner):
    engine = CachedEngine(runner, config=EngineConfig(mode="prefix"))
    pipe = SpeculativePipeline(engine, PipeliningConfig(max_stages=3, min_search_s=0.05, search_ema=1.0))
    seen = []

    def search(delay):
        def run(n_stages):
            seen.append(n_stages)
            time.sleep(delay)
            yield StageTopK(0, tuple(C[:2]), True)
        return run

    pipe.generate(QUESTION, search(0.0), system_prompt=SYSTEM, max_new_tokens=1)  # nothing measured yet
    pipe.generate(QUESTION, search(0.1), system_prompt=SYSTEM, max_new_tokens=1)  # the last search was short
    pipe.generate(QUESTION, search(0.0), system_prompt=SYSTEM, max_new_tokens=1)  # the last search was long
    assert seen == [3, 1, 3]


def test_a_pipelines_own_layout_is_used_for_speculation_and_answer(runner):
    engine = CachedEngine(runner, config=EngineConfig(mode="prefix"))
    pipe = SpeculativePipeline(engine, PipeliningConfig(max_stages=2, prompt_chunks=2))

    def layout(chunks):
        parts = [("text", "Context follows.\n")] + [("chunk", c + "\n\n") for c in chunks]
        return engine.prompts.text_segments(parts + [("text", "Q: " + QUESTION + "\nA:")])

    out = pipe.generate(QUESTION, _GatedSearch(engine, [[C[1], C[2]], [C[1], C[3]]], [2]), layout=layout,
                        max_new_tokens=6)
    ref_engine = CachedEngine(runner, config=EngineConfig(mode="prefix"))
    from cachedrag.model.generation import SamplingParams

    ref = ref_engine.generate_segments(layout([C[1], C[3]]), SamplingParams(max_new_tokens=6))
    assert out.result.token_ids == ref.token_ids and out.kept_chunks == 1
    assert out.result.prefix_hit_tokens > 0
