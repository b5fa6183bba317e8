"""FLARE (Jiang et al. 2023, FLARE-direct): generate ahead sentence by sentence, retrieve when unsure.

Owns: ``FLARE`` and ``FLAREConfig``. The loop, on the real log probabilities of the tokens
our generator produced (not the instruct-model approximation):

1. (``initial_retrieval``) retrieve with the question; prefetch(question) before the first LLM call;
2. ``lookahead_i``: continue the answer by one sentence (stops on ``parsing.SENTENCE_STOPS``);
3. ``judge_i``: if any token of that sentence has probability < ``threshold``, build the query
   from its confident part (tokens below ``mask_threshold`` masked out, ``parsing.masked_query``),
   ``retrieve_i`` with it and ``regenerate_i`` the sentence over the new chunks;
4. append the sentence; stop on EOS, ``max_sentences`` or ``max_new_tokens`` answer tokens.

Does not own: sentence cutting and masking (``parsing``) or the step helpers (``base``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pydantic import Field, model_validator

from cachedrag.pipelines.base import Pipeline, PipelineConfig
from cachedrag.pipelines.parsing import SENTENCE_STOPS, first_sentence, low_confidence, masked_query
from cachedrag.pipelines.prompts import PromptTemplate


class FLAREConfig(PipelineConfig):
    threshold: float = Field(0.4, gt=0.0, le=1.0, description="retrieve when any token probability is below this")
    mask_threshold: float | None = Field(None, gt=0.0, le=1.0,
                                         description="mask tokens below this in the query (default: threshold)")
    sentence_tokens: int = Field(32, ge=1, description="token limit of one look-ahead sentence")
    max_sentences: int = Field(4, ge=1, description="sentences per answer")
    max_retrievals: int | None = Field(None, ge=0, description="retrievals triggered per answer (default: no limit)")
    initial_retrieval: bool = Field(True, description="retrieve with the question before the first sentence")
    query_template: str = Field("{question} {confident}", description="triggered query; fields: question, confident")

    @model_validator(mode="after")
    def _check(self) -> "FLAREConfig":
        self.answer.check({"question"}, "answer")
        PromptTemplate(user=self.query_template).check({"question", "confident"}, "retrieve")
        return self


class FLARE(Pipeline):
    """Forward-looking active retrieval.

    >>> run = FLARE(CachedEngine(), load_index("idx"), threshold=0.5).run("What does heapq do?")  # doctest: +SKIP
    >>> [s.output for s in run.steps if s.kind == "judgment"]                                      # doctest: +SKIP
    """

    name = "flare"
    config_class = FLAREConfig

    def _run(self, question: str, rec) -> str:
        cfg = self.config
        mask = cfg.mask_threshold if cfg.mask_threshold is not None else cfg.threshold
        decode = self.generator.tokenizer.decode
        chunks: list[str] = []
        if cfg.initial_retrieval:
            chunks = self._retrieve(rec, "retrieve_0", [question]).chunks[0]
        self._prefetch(rec, question)
        answer, used, retrievals = "", 0, 0
        for i in range(1, cfg.max_sentences + 1):
            budget = min(cfg.sentence_tokens, cfg.max_new_tokens - used)
            if budget <= 0:
                break
            sentence = self._sentence(rec, f"lookahead_{i}", "pre_retrieval", question, chunks, answer, budget)
            if not sentence.token_ids:
                break
            started = rec.now()
            low = low_confidence(sentence.logprobs, cfg.threshold)
            allowed = cfg.max_retrievals is None or retrievals < cfg.max_retrievals
            decision = "retrieve" if low and allowed else "accept"
            confident = masked_query(sentence.token_ids, sentence.logprobs, mask, decode) if decision == "retrieve" else ""
            self._judge(rec, f"judge_{i}", sentence.text, decision, started,
                        {"low_confidence_tokens": low, "confident": confident,
                         "min_prob": min((math.exp(lp) for lp in sentence.logprobs), default=1.0)})
            if decision == "retrieve":
                retrievals += 1
                query = cfg.query_template.format(question=question, confident=confident).strip() or question
                chunks = self._retrieve(rec, f"retrieve_{i}", [query]).chunks[0]
                sentence = self._sentence(rec, f"regenerate_{i}", "post_retrieval", question, chunks, answer, budget)
                if not sentence.token_ids:
                    break
            answer += sentence.text
            used += len(sentence.token_ids)
            if sentence.eos:
                break
        return answer

    def _sentence(self, rec, name: str, kind: str, question: str, chunks, answer: str, budget: int) -> "_Sentence":
        """Continue ``answer`` by one sentence over ``chunks``."""
        decode = self.generator.tokenizer.decode
        gen = self._generate(rec, name, kind, self.config.answer, {"question": question}, chunks=chunks,
                             max_new_tokens=budget, assistant_prefix=answer, stop=SENTENCE_STOPS)
        cut = first_sentence(gen.token_ids, decode)
        ended_by_stop = any(s in decode(gen.token_ids) for s in SENTENCE_STOPS)
        return _Sentence(cut.text, gen.token_ids[:cut.n_tokens], gen.token_logprobs[:cut.n_tokens],
                         eos=gen.finish_reason == "stop" and not ended_by_stop)


@dataclass(frozen=True)
class _Sentence:
    """One generated sentence with the real log probability of each of its tokens."""

    text: str
    token_ids: list[int]
    logprobs: list[float]
    eos: bool  # generation ended with EOS (the answer is complete)
