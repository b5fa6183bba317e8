"""Prompt-lookup drafts for speculative greedy decoding.

Owns: proposing the tokens that will probably come next by finding the latest n-gram of the
text so far in the context (prompt and generated tokens) and copying what followed it
(prompt lookup decoding; LLMA, "Inference with Reference", Yang et al. 2023). RAG answers copy
names, signatures and phrases from the retrieved chunks, so such drafts are often right. Pure
Python over token ids: no model, no tensors. The decode loop (``generation.py``) verifies a
draft with one forward pass over all its tokens and keeps the longest prefix the model itself
would have generated greedily, so the output is the model's own greedy output.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator


class LookupConfig(BaseModel):
    """How drafts are proposed. ``max_draft = 0`` turns speculation off."""

    model_config = ConfigDict(frozen=True)

    max_draft: int = Field(3, ge=0, le=32, description="most tokens proposed per verification pass")
    max_ngram: int = Field(3, ge=1, le=8, description="longest suffix n-gram looked up (tried first)")
    min_ngram: int = Field(2, ge=1, le=8, description="shortest suffix n-gram that may propose a draft")

    @model_validator(mode="after")
    def _ngram_order(self):
        if self.min_ngram > self.max_ngram:
            raise ValueError(f"min_ngram ({self.min_ngram}) must be <= max_ngram ({self.max_ngram})")
        return self


class PromptLookup:
    """Drafts from a growing token context: ``extend`` with tokens, then ``draft(n)``.

    Keeps, for every n-gram length in ``[min_ngram, max_ngram]``, the position just after the
    latest occurrence of each n-gram, so a lookup is O(max_ngram) and extending is
    O(max_ngram) per token. The index is built when the first draft is asked for, not when the
    context arrives: a 10k-token prompt takes ~25 ms to index, which the first token (chosen
    before any draft) does not wait for.
    """

    def __init__(self, config: LookupConfig, context: list[int] | tuple[int, ...] = ()):
        self.config = config
        self.passes = 0  # verification passes run with a draft
        self.proposed = 0  # draft tokens verified
        self.accepted = 0  # draft tokens the model agreed with
        self.tokens: list[int] = []
        self._after: dict[tuple[int, ...], int] = {}  # n-gram -> index after its latest occurrence
        self._pending: dict[tuple[int, ...], int] = {}  # the context's trailing n-grams (nothing follows yet)
        self._indexed = 0  # tokens[:_indexed] are in the index
        self.extend(context)

    def extend(self, tokens) -> None:
        self.tokens.extend(int(t) for t in tokens)

    def truncate(self, length: int) -> None:
        """Keep the first ``length`` context tokens (an answer rewound); the index is built again at the
        next draft. The counters stay."""
        del self.tokens[length:]
        self._after, self._pending, self._indexed = {}, {}, 0

    def _catch_up(self) -> None:
        """Index the tokens added since the last draft."""
        toks = self.tokens
        lo, hi = self.config.min_ngram, self.config.max_ngram
        for end in range(self._indexed + 1, len(toks) + 1):
            # n-grams that ended just before this token now have a follower: make them findable
            self._after.update(self._pending)
            self._pending = {tuple(toks[end - n:end]): end for n in range(lo, min(hi, end) + 1)}
        self._indexed = len(toks)

    def record(self, proposed: int, accepted: int) -> None:
        """Count one verification pass (the decode loop calls this)."""
        self.passes += 1
        self.proposed += proposed
        self.accepted += accepted

    def draft(self, limit: int | None = None) -> list[int]:
        """The tokens that followed the latest earlier occurrence of the longest matching suffix
        n-gram, at most ``min(limit, max_draft)``; empty when nothing matches."""
        limit = self.config.max_draft if limit is None else min(limit, self.config.max_draft)
        if limit <= 0:
            return []
        self._catch_up()
        end = len(self.tokens)
        for n in range(min(self.config.max_ngram, end), self.config.min_ngram - 1, -1):
            start = self._after.get(tuple(self.tokens[end - n:end]))
            if start is not None:
                return self.tokens[start:start + limit]
        return []


def prompt_lookup(config: LookupConfig | None, prompt_ids, greedy: bool) -> PromptLookup | None:
    """A ``PromptLookup`` over ``prompt_ids`` when speculation applies (a config with
    ``max_draft > 0`` and greedy decoding), else None; building one indexes the whole prompt."""
    if config is None or config.max_draft == 0 or not greedy:
        return None
    return PromptLookup(config, prompt_ids)
