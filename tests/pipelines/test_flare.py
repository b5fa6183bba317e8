"""FLARE's loop on planted token probabilities (scripted generator, fake retriever)."""

from __future__ import annotations

import pytest

from cachedrag.pipelines import FLARE

from .conftest import QUESTION, FakeRetriever, ScriptedGenerator


def _probs(text: str, low: str = "", p_low: float = 0.05) -> tuple[str, list[float]]:
    """Probability 0.9 per character, ``p_low`` for the characters of the substring ``low``."""
    probs = [0.9] * len(text)
    if low:
        start = text.index(low)
        probs[start:start + len(low)] = [p_low] * len(low)
    return text, probs


def _flare(outputs, **overrides):
    events: list = []
    gen = ScriptedGenerator({"Question:": outputs}, events)
    ret = FakeRetriever(events)
    return FLARE(gen, ret, **{"sentence_tokens": 64, "max_new_tokens": 200, **overrides}), gen, ret, events


def test_confident_sentences_are_accepted_without_retrieval():
    flare, gen, ret, events = _flare([_probs("Use json.dumps. More"), _probs(" It takes indent.")])
    run = flare.run(QUESTION)
    assert run.answer == "Use json.dumps. It takes indent."
    assert [s.name for s in run.steps] == ["retrieve_0", "lookahead_1", "judge_1", "lookahead_2", "judge_2"]
    assert [s.output for s in run.steps_of("judgment")] == ["accept", "accept"]
    assert ret.queries == [[QUESTION]]  # the initial retrieval only
    assert gen.requests[1].assistant_prefix == "Use json.dumps."  # the second sentence continues the first
    assert all(r.stop for r in gen.requests)


def test_low_probability_token_triggers_masked_retrieval_and_regeneration():
    flare, gen, ret, events = _flare([_probs("Use json.dumps. x", low="json"), _probs("Call json.dumps(obj, indent=2).")])
    run = flare.run(QUESTION)
    judge = run.steps_of("judgment")[0]
    assert judge.output == "retrieve"
    assert judge.details["low_confidence_tokens"] == [4, 5, 6, 7]  # "json", one token per character
    assert judge.details["confident"] == "Use .dumps."
    assert ret.queries[1] == [f"{QUESTION} Use .dumps."]  # the confident part, low tokens masked out
    regen = gen.requests[1]
    assert regen.chunks == tuple(f"chunk {j} for {QUESTION} Use .dumps." for j in range(flare.config.top_k))
    assert regen.assistant_prefix == ""  # the sentence is regenerated, not continued
    assert run.answer == "Call json.dumps(obj, indent=2)."  # the regenerated sentence is kept; EOS ends the answer
    assert [s.name for s in run.steps] == ["retrieve_0", "lookahead_1", "judge_1", "retrieve_1", "regenerate_1"]


@pytest.mark.parametrize("p_low, threshold, decision", [
    (0.39, 0.4, "retrieve"), (0.4, 0.4, "accept"), (0.41, 0.4, "accept"), (0.7, 0.8, "retrieve"),
])
def test_threshold_boundary(p_low, threshold, decision):
    flare, *_ = _flare([_probs("Use json.dumps.", low="json", p_low=p_low)], threshold=threshold)
    assert flare.run(QUESTION).steps_of("judgment")[0].output == decision


def test_mask_threshold_apart_from_trigger():
    # trigger at 0.5 (0.3 < 0.5) but mask only below 0.2: nothing is masked
    flare, gen, ret, _ = _flare([_probs("Use json.dumps.", low="json", p_low=0.3), _probs("Done.")],
                                threshold=0.5, mask_threshold=0.2)
    flare.run(QUESTION)
    assert ret.queries[1] == [f"{QUESTION} Use json.dumps."]


def test_max_retrievals_limits_triggers():
    flare, _, ret, _ = _flare([_probs("Use json.dumps.", low="json")], max_retrievals=0)
    run = flare.run(QUESTION)
    assert [s.output for s in run.steps_of("judgment")] == ["accept"]
    assert len(ret.queries) == 1


def test_limits_stop_the_loop():
    flare, gen, _, _ = _flare([_probs("One. "), _probs(" Two. "), _probs(" Three. ")], max_sentences=2)
    run = flare.run(QUESTION)
    assert run.answer == "One. Two."
    assert len(run.steps_of("pre_retrieval")) == 2
    # a token budget: 10 answer tokens, sentences of at most 8
    flare, gen, _, _ = _flare([_probs("One two three four five six")], max_new_tokens=10, sentence_tokens=8)
    run = flare.run(QUESTION)
    assert [r.max_new_tokens for r in gen.requests] == [8, 2]
    assert run.answer == "One two " + "On"  # the fake replays its text; 8 + 2 tokens in all


def test_without_initial_retrieval_prefetch_precedes_the_first_generation():
    flare, gen, ret, events = _flare([_probs("Fine.")], initial_retrieval=False)
    run = flare.run(QUESTION)
    assert events[0] == ("prefetch", QUESTION) and events[1][0] == "generate"
    assert gen.requests[0].chunks == ()
    assert run.answer == "Fine."
