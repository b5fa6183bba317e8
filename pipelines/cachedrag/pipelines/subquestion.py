"""SubQuestion (LlamaIndex's SubQuestionQueryEngine): decompose, retrieve for all, answer each, synthesise.

Owns: ``SubQuestion`` and ``SubQuestionConfig``. Steps: prefetch(question) -> ``decompose``
(pre-retrieval generation; parsed by ``parsing.parse_subquestions``: JSON, a numbered or
bulleted list, question lines, else the question itself — the way it was parsed is recorded
in a ``parse`` judgment step) -> ``retrieve`` (one batched search of every sub-question) ->
``answer_i`` per sub-question over its chunks -> ``synthesize`` (over the sub-answers). Does
not own: parsing (``parsing``) or the step helpers (``base``).
"""

from __future__ import annotations

from pydantic import Field, model_validator

from cachedrag.pipelines.base import Pipeline, PipelineConfig
from cachedrag.pipelines.parsing import parse_subquestions
from cachedrag.pipelines.prompts import DECOMPOSE, SUBANSWER_LINE, SYNTHESIZE, PromptTemplate


class SubQuestionConfig(PipelineConfig):
    decompose: PromptTemplate = Field(DECOMPOSE, description="prompt of the decomposition; fields: question")
    decompose_tokens: int = Field(64, ge=1, description="tokens of the decomposition")
    max_subquestions: int = Field(3, ge=1, description="sub-questions kept (the first ones)")
    subquestion_top_k: int | None = Field(None, ge=1, description="chunks per sub-question (default: top_k)")
    subanswer_tokens: int | None = Field(None, ge=1, description="tokens per sub-answer (default: max_new_tokens)")
    synthesize: PromptTemplate = Field(SYNTHESIZE, description="prompt of the synthesis; fields: question, subanswers")
    subanswer_line: str = Field(SUBANSWER_LINE, description="one sub-answer in the synthesis; fields: subquestion, answer")

    @model_validator(mode="after")
    def _check(self) -> "SubQuestionConfig":
        self.decompose.check({"question"}, "decompose")
        self.answer.check({"question"}, "answer")
        self.synthesize.check({"question", "subanswers"}, "synthesize")
        PromptTemplate(user=self.subanswer_line).check({"subquestion", "answer"}, "synthesize")
        return self


class SubQuestion(Pipeline):
    """Sub-question decomposition.

    >>> run = SubQuestion(CachedEngine(), load_index("idx")).run("Compare json and csv")  # doctest: +SKIP
    >>> [s.output for s in run.steps if s.name == "decompose"]                              # doctest: +SKIP
    """

    name = "subquestion"
    config_class = SubQuestionConfig

    def _run(self, question: str, rec) -> str:
        cfg = self.config
        self._prefetch(rec, question)
        raw = self._generate(rec, "decompose", "pre_retrieval", cfg.decompose, {"question": question},
                             max_new_tokens=cfg.decompose_tokens).text
        started = rec.now()
        subs, how = parse_subquestions(raw, question, cfg.max_subquestions)
        self._judge(rec, "parse", raw, how, started, {"subquestions": subs})
        found = self._retrieve(rec, "retrieve", subs, cfg.subquestion_top_k or cfg.top_k)
        lines = []
        for i, (sub, chunks) in enumerate(zip(subs, found.chunks), 1):
            answer = self._generate(rec, f"answer_{i}", "post_retrieval", cfg.answer, {"question": sub}, chunks=chunks,
                                    max_new_tokens=cfg.subanswer_tokens or cfg.max_new_tokens).text.strip()
            lines.append(cfg.subanswer_line.format(subquestion=sub, answer=answer))
        return self._generate(rec, "synthesize", "post_retrieval", cfg.synthesize,
                              {"question": question, "subanswers": "\n\n".join(lines)},
                              max_new_tokens=cfg.max_new_tokens).text
