"""Iter-RetGen (Shao et al. 2023): rounds of retrieve-with-(question + last answer), generate.

Owns: ``IterRetGen`` and ``IterRetGenConfig``. Round 1 retrieves with the question; the
lookahead prefetch of the original question starts right after it, before the first LLM
call, so later rounds (whose queries add the previous answer) find their clusters in the
fast tier. The answer of the last round is the pipeline's answer. Does not own: the step
helpers (``base``).
"""

from __future__ import annotations

from pydantic import Field, model_validator

from cachedrag.pipelines.base import Pipeline, PipelineConfig
from cachedrag.pipelines.prompts import PromptTemplate


class IterRetGenConfig(PipelineConfig):
    rounds: int = Field(3, ge=1, description="retrieve-generate rounds")
    query_template: str = Field("{question}\n{answer}", description="query of rounds 2..N; fields: question, answer")

    @model_validator(mode="after")
    def _check(self) -> "IterRetGenConfig":
        self.answer.check({"question"}, "answer")
        PromptTemplate(user=self.query_template).check({"question", "answer"}, "retrieve")
        return self


class IterRetGen(Pipeline):
    """Iterative retrieval-generation synergy.

    >>> IterRetGen(CachedEngine(), load_index("idx"), rounds=3).run("What does heapq.heappush do?")  # doctest: +SKIP
    """

    name = "iter_retgen"
    config_class = IterRetGenConfig

    def _run(self, question: str, rec) -> str:
        cfg = self.config
        answer = ""
        for r in range(cfg.rounds):
            query = question if r == 0 else (cfg.query_template.format(question=question, answer=answer).strip() or question)
            found = self._retrieve(rec, f"retrieve_{r + 1}", [query])
            self._prefetch(rec, question)  # no-op after the first round
            answer = self._generate(rec, f"generate_{r + 1}", "post_retrieval", cfg.answer, {"question": question},
                                    chunks=found.chunks[0], max_new_tokens=cfg.max_new_tokens).text.strip()
        return answer
