"""Reading model output: sub-question lists, sentence cuts, FLARE's confidence masks.

Owns pure functions (no torch, no model): ``parse_subquestions`` (a JSON list, a numbered or
bulleted list, question lines, else the question itself), ``first_sentence`` (the shortest
prefix of generated tokens that ends a sentence), and FLARE's judgment on real token log
probabilities: ``low_confidence`` (which tokens fall below the threshold) and
``masked_query`` (the sentence with its low-probability tokens masked out). ``decode`` is
the tokenizer's ``decode(ids) -> str``.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

Decode = Callable[[Sequence[int]], str]

# A sentence ends at one of these; generation steps stop on them too (same rule both ways).
SENTENCE_STOPS: tuple[str, ...] = (". ", "! ", "? ", ".\n", "!\n", "?\n")

_LIST_ITEM = re.compile(r"^\s*(?:\(?\d{1,2}[.):]|[-*\u2022])\s+(.+?)\s*$")
_QUOTED = re.compile(r'"((?:[^"\\]|\\.){3,})"')
_JSON_LIST = re.compile(r"\[.*\]", re.DOTALL)
_SUBQ_KEYS = ("question", "sub_question", "subquestion", "sub-question", "query", "text")
_MIN_CHARS = 3


def parse_subquestions(text: str, question: str, max_n: int = 3) -> tuple[list[str], str]:
    """Sub-questions in ``text`` and how they were found: ``json``, ``quoted``, ``list``, ``lines``
    or ``fallback`` (``[question]``). At most ``max_n``, stripped, case-insensitively distinct."""
    assert max_n >= 1, max_n
    for how, found in (("json", _from_json(text)), ("quoted", _from_quoted(text)), ("list", _from_list(text)),
                       ("lines", _from_lines(text))):
        items = _clean(found, max_n)
        if items:
            return items, how
    return [question], "fallback"


def _from_json(text: str) -> list[str]:
    match = _JSON_LIST.search(text)
    if not match:
        return []
    try:
        value = json.loads(match.group(0))
    except json.JSONDecodeError:
        return []
    if not isinstance(value, list):
        return []
    out = []
    for item in value:
        if isinstance(item, str):
            out.append(item)
        elif isinstance(item, dict):
            out.extend(str(item[k]) for k in _SUBQ_KEYS if isinstance(item.get(k), str))
    return out


def _from_quoted(text: str) -> list[str]:
    """Strings of a JSON list cut short (generation hit its token limit)."""
    if "[" not in text:
        return []
    return [m.group(1).replace('\\"', '"') for m in _QUOTED.finditer(text[text.index("["):])]


def _from_list(text: str) -> list[str]:
    return [m.group(1) for line in text.splitlines() if (m := _LIST_ITEM.match(line))]


def _from_lines(text: str) -> list[str]:
    return [line for line in (ln.strip() for ln in text.splitlines()) if line.endswith("?")]


def _clean(items: list[str], max_n: int) -> list[str]:
    out, seen = [], set()
    for item in items:
        item = item.strip().strip("\"'`").strip()
        key = item.lower()
        if len(item) >= _MIN_CHARS and key not in seen:
            seen.add(key)
            out.append(item)
        if len(out) == max_n:
            break
    return out


@dataclass(frozen=True)
class SentenceCut:
    """The first sentence of some generated tokens."""

    n_tokens: int  # tokens[:n_tokens] hold the sentence
    text: str  # decode(tokens[:n_tokens])
    complete: bool  # a sentence end was found (False: the tokens ran out first)


def first_sentence(token_ids: Sequence[int], decode: Decode, stops: Sequence[str] = SENTENCE_STOPS) -> SentenceCut:
    """Shortest prefix of ``token_ids`` whose text reaches the first sentence end (the
    punctuation of the first ``stops`` match); all tokens when there is none."""
    full = decode(list(token_ids))
    ends = [i + 1 for i in (full.find(s) for s in stops) if i >= 0]
    if not ends:
        return SentenceCut(len(token_ids), full, False)
    end = min(ends)
    for n in range(1, len(token_ids) + 1):
        text = decode(list(token_ids[:n]))
        if len(text) >= end:
            return SentenceCut(n, text, True)
    return SentenceCut(len(token_ids), full, True)  # pragma: no cover - decode(prefix) is a prefix of full


def low_confidence(logprobs: Sequence[float], threshold: float) -> list[int]:
    """Positions of tokens whose probability is below ``threshold`` (FLARE's trigger)."""
    return [i for i, lp in enumerate(logprobs) if math.exp(lp) < threshold]


def masked_query(token_ids: Sequence[int], logprobs: Sequence[float], threshold: float, decode: Decode) -> str:
    """The sentence with tokens of probability below ``threshold`` masked out (FLARE's
    masked query): confident runs decoded separately and joined by spaces."""
    assert len(token_ids) == len(logprobs), (len(token_ids), len(logprobs))
    runs: list[list[int]] = [[]]
    for token, lp in zip(token_ids, logprobs):
        if math.exp(lp) >= threshold:
            runs[-1].append(token)
        elif runs[-1]:
            runs.append([])
    return " ".join(" ".join(decode(run).split()) for run in runs if run).strip()
