"""Step recording, prefetch placement, configuration and errors (scripted generator, fake retriever)."""

from __future__ import annotations

import json

import pytest

from cachedrag.errors import ConfigError, EmptyInputError
from cachedrag.pipelines import FLARE, HyDE, IterRetGen, PromptTemplate, SubQuestion
from cachedrag.pipelines.prompts import DECOMPOSE, HYDE_PASSAGE

from .conftest import QUESTION, FakeRetriever, ScriptedGenerator

SCRIPT = {
    HYDE_PASSAGE.system: ["json.dumps(obj, indent=4) pretty-prints."],
    DECOMPOSE.system: ['["What is json.dumps?", "What does indent do?"]'],
    "Question:": ["Use json.dumps with indent. It works."],
}
ALL = [HyDE, SubQuestion, IterRetGen, FLARE]


def _pipeline(cls, **overrides):
    events: list = []
    gen, ret = ScriptedGenerator(SCRIPT, events), FakeRetriever(events)
    return cls(gen, ret, **overrides), gen, ret, events


def test_hyde_records_each_step():
    hyde, gen, ret, events = _pipeline(HyDE, top_k=2)
    run = hyde.run(f"  {QUESTION} ")
    assert run.question == QUESTION and run.pipeline == "hyde"
    assert [(s.name, s.kind) for s in run.steps] == [
        ("hypothetical_passage", "pre_retrieval"), ("retrieve", "retrieval"), ("answer", "post_retrieval")]
    passage, retrieve, answer = run.steps
    assert passage.output == "json.dumps(obj, indent=4) pretty-prints." and passage.input == f"Question: {QUESTION}"
    assert passage.generated_tokens == len(passage.output) and passage.prompt_tokens == len(passage.input)
    assert retrieve.input == [f"{QUESTION}\njson.dumps(obj, indent=4) pretty-prints."]
    assert retrieve.output == [[f"{QUESTION[:8]}#0", f"{QUESTION[:8]}#1"]] and retrieve.retrieval == {"hit_rate": 1.0}
    assert gen.requests[1].chunks == tuple(f"chunk {j} for {retrieve.input[0]}" for j in range(2))
    assert run.answer == "Use json.dumps with indent. It works."
    starts = [s.started_s for s in run.steps]
    assert starts == sorted(starts) and all(s.seconds >= 0 for s in run.steps)
    assert run.documents == [(f"{QUESTION[:8]}#{j}", f"chunk {j} for {retrieve.input[0]}") for j in range(2)]
    b = run.breakdown()
    assert b["llm_calls"] == 2 and b["llm_s"] + b["retrieval_s"] + b["other_s"] == pytest.approx(run.total_s)
    assert b["prefetch_ms"] == 1.0 and 0.0 <= b["prefetch_overlap"] <= 1.0
    json.dumps(run.to_dict())  # JSON-ready
    assert "documents" not in run.to_dict()["steps"][1] and "documents" in run.to_dict(documents=True)["steps"][1]


@pytest.mark.parametrize("cls", ALL)
def test_prefetch_of_the_original_question_precedes_the_first_llm_call(cls):
    pipeline, _, _, events = _pipeline(cls)
    pipeline.run(QUESTION)
    kinds = [e[0] for e in events]
    assert kinds.count("prefetch") == 1
    assert events[kinds.index("prefetch")] == ("prefetch", QUESTION)
    assert kinds.index("prefetch") < kinds.index("generate")


@pytest.mark.parametrize("cls", ALL)
def test_prefetch_can_be_disabled(cls):
    pipeline, _, _, events = _pipeline(cls, prefetch=False)
    run = pipeline.run(QUESTION)
    assert "prefetch" not in [e[0] for e in events] and run.prefetch is None


def test_subquestion_batches_retrieval_and_answers_each():
    sub, gen, ret, _ = _pipeline(SubQuestion, subquestion_top_k=1)
    run = sub.run(QUESTION)
    assert ret.queries == [["What is json.dumps?", "What does indent do?"]]  # one batched search
    names = [s.name for s in run.steps]
    assert names == ["decompose", "parse", "retrieve", "answer_1", "answer_2", "synthesize"]
    parse = run.steps[1]
    assert parse.kind == "judgment" and parse.output == "json"
    assert parse.details["subquestions"] == ["What is json.dumps?", "What does indent do?"]
    assert gen.requests[1].chunks == ("chunk 0 for What is json.dumps?",)
    assert gen.requests[2].user == "Question: What does indent do?"
    synth = gen.requests[-1]
    assert synth.chunks == () and "Sub-question: What is json.dumps?\nAnswer: Use json.dumps" in synth.user
    assert synth.user.endswith(f"Question: {QUESTION}")


def test_subquestion_falls_back_to_the_question():
    events: list = []
    gen = ScriptedGenerator({DECOMPOSE.system: ["no idea"], "Question:": ["An answer."]}, events)
    ret = FakeRetriever(events)
    run = SubQuestion(gen, ret).run(QUESTION)
    assert ret.queries == [[QUESTION]] and run.steps[1].output == "fallback"


def test_iter_retgen_rounds_query_with_the_previous_answer():
    events: list = []
    gen = ScriptedGenerator({"Question:": ["first answer", "second answer", "third answer"]}, events)
    ret = FakeRetriever(events)
    run = IterRetGen(gen, ret, rounds=3).run(QUESTION)
    assert ret.queries == [[QUESTION], [f"{QUESTION}\nfirst answer"], [f"{QUESTION}\nsecond answer"]]
    assert run.answer == "third answer"
    assert [e[0] for e in events] == ["search", "prefetch", "generate", "search", "generate", "search", "generate"]


def test_custom_templates_and_overrides():
    template = PromptTemplate(system="Write docs.", user="Topic: {question}")
    hyde, gen, ret, _ = _pipeline(HyDE, passage=template, passage_tokens=7, query_template="{passage}")
    hyde.run(QUESTION)
    assert gen.requests[0].system == "Write docs." and gen.requests[0].user == f"Topic: {QUESTION}"
    assert gen.requests[0].max_new_tokens == 7
    assert ret.queries[0] == ["I do no"]  # the passage alone (the fake's default text), cut at 7 tokens
    config = HyDE.config_class(top_k=3)
    assert HyDE(gen, ret, config=config, top_k=5).config.top_k == 5


@pytest.mark.parametrize("overrides", [
    {"passage": PromptTemplate(user="{nope}")},
    {"query_template": "{question} {answer}"},
    {"top_k": 0},
    {"unknown": 1},
])
def test_bad_configuration_is_a_config_error(overrides):
    with pytest.raises(ConfigError):
        _pipeline(HyDE, **overrides)


def test_bad_inputs():
    hyde, *_ = _pipeline(HyDE)
    for question in ("", "   "):
        with pytest.raises(EmptyInputError):
            hyde.run(question)
    with pytest.raises(ConfigError):
        HyDE(object(), FakeRetriever())
    with pytest.raises(ConfigError):
        HyDE(ScriptedGenerator(SCRIPT), object())
    with pytest.raises(ConfigError):
        IterRetGen(ScriptedGenerator(SCRIPT), FakeRetriever(), config=HyDE.config_class())


def test_prefetch_failure_is_reported_not_swallowed():
    class Failing(FakeRetriever):
        def prefetch_report(self):
            return {"error": "OSError: disk gone"}

    run = HyDE(ScriptedGenerator(SCRIPT), Failing()).run(QUESTION)
    assert run.prefetch == {"error": "OSError: disk gone"}
    assert any("disk gone" in note for note in run.notes)
