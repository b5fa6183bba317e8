"""The deterministic stand-in for an LLM query rewrite that the retrieval suites search with.

Owns: ``default_transformations`` (each question + the first sentence of its top exact-search
chunk, a stand-in for a HyDE rewrite) and its one-line description ``TRANSFORM_NOTE``. Both
``bench retrieval`` and ``bench retrieval --scale`` (``retrieval_scale``) use it, so that their
variants search the same query; it imports neither of them.
"""

from __future__ import annotations

import re

TRANSFORM_NOTE = "question + first sentence of its top exact-search chunk (deterministic stand-in for HyDE)"
_FIRST_SENTENCE_MAX_CHARS = 300


def default_transformations(index, questions: list[str]) -> list[str]:
    """Question + first sentence of its top exact-search chunk, for each question."""
    q = index.embed(questions)  # [Q, d]
    _, top = index.ivf.exact_search(q, 1)  # [Q, 1]
    return [f"{question} {_first_sentence(index.chunks[row].text)}" for question, row in zip(questions, top[:, 0].tolist())]


def _first_sentence(text: str) -> str:
    for piece in re.split(r"(?<=[.!?])\s+|\n\s*\n", text):
        piece = " ".join(piece.split())
        if len(piece) > 1:
            return piece[:_FIRST_SENTENCE_MAX_CHARS]
    return ""
