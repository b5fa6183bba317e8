"""HyDE (Gao et al. 2022): write a hypothetical passage, retrieve with it, answer.

Owns: ``HyDE`` and ``HyDEConfig``. Steps: prefetch(question) -> ``hypothetical_passage``
(pre-retrieval generation, no chunks) -> ``retrieve`` (query = ``query_template`` of the
question and the passage) -> ``answer`` (over the retrieved chunks). Does not own: the
recording and step helpers (``base``).
"""

from __future__ import annotations

from pydantic import Field, model_validator

from cachedrag.pipelines.base import Pipeline, PipelineConfig
from cachedrag.pipelines.prompts import HYDE_PASSAGE, PromptTemplate


class HyDEConfig(PipelineConfig):
    passage: PromptTemplate = Field(HYDE_PASSAGE, description="prompt of the hypothetical passage; fields: question")
    passage_tokens: int = Field(48, ge=1, description="tokens of the hypothetical passage")
    query_template: str = Field("{question}\n{passage}", description="retrieval query; fields: question, passage")

    @model_validator(mode="after")
    def _check(self) -> "HyDEConfig":
        self.passage.check({"question"}, "hypothetical_passage")
        self.answer.check({"question"}, "answer")
        PromptTemplate(user=self.query_template).check({"question", "passage"}, "retrieve")
        return self


class HyDE(Pipeline):
    """Hypothetical document embeddings.

    >>> run = HyDE(CachedEngine(), load_index("idx")).run("How do I pretty-print JSON?")  # doctest: +SKIP
    >>> run.answer, [(s.name, round(s.seconds, 2)) for s in run.steps]                     # doctest: +SKIP
    """

    name = "hyde"
    config_class = HyDEConfig

    def _run(self, question: str, rec) -> str:
        cfg = self.config
        self._prefetch(rec, question)
        passage = self._generate(rec, "hypothetical_passage", "pre_retrieval", cfg.passage, {"question": question},
                                 max_new_tokens=cfg.passage_tokens).text.strip()
        query = cfg.query_template.format(question=question, passage=passage).strip() or question
        found = self._retrieve(rec, "retrieve", [query])
        return self._generate(rec, "answer", "post_retrieval", cfg.answer, {"question": question},
                              chunks=found.chunks[0], max_new_tokens=cfg.max_new_tokens).text
